"""`laco-deploy fidelity`: exit codes (0 pass, 1 failed gate, 2 usage error), messages, reports."""

from __future__ import annotations

import json

SMALL = ["--eval-samples", "2", "--seqlen", "32", "--device", "cpu"]


def test_passing_gates_exit_0_and_print_the_table(cli, trained_dir, tmp_path):
    code, out, err = cli("fidelity", "--dense", trained_dir, "--candidate", f"same={trained_dir}", "--report", tmp_path / "rep",
                         "--max-kl", "1e-6", "--min-top1", "1", "--max-ppl-ratio", "1.0001", *SMALL)
    assert code == 0, err
    assert "| same | pytorch |" in out and "pass" in out and "ppl ratio" in out
    assert {p.name for p in (tmp_path / "rep").iterdir()} >= {"fidelity.json", "fidelity.md", "fidelity.html"}


def test_failed_gate_exits_1_says_which_and_by_how_much(cli, trained_dir, perturbed_dirs, tmp_path):
    noisy = perturbed_dirs[max(perturbed_dirs)]  # the strongly damaged copy
    code, _, err = cli("fidelity", "--dense", trained_dir, "--candidate", noisy, "--report", tmp_path / "rep",
                         "--max-kl", "0.001", "--min-top1", "0", *SMALL)
    assert code == 1
    label = noisy.name  # a bare PATH is labelled with its folder name
    assert "gate max_kl FAILED by" in err and label in err and "required <= 0.001" in err
    assert "min_top1 FAILED" not in err  # only the failing gate is named
    doc = json.loads((tmp_path / "rep" / "fidelity.json").read_text())  # reports still written
    assert doc["passed"] is False and label in doc["candidates"]
    failed = [g for g in doc["gates"] if not g["passed"]]
    assert [g["name"] for g in failed] == ["max_kl"]
    assert f"{failed[0]['miss']:.4g}" in err


def test_usage_errors_exit_2(cli, trained_dir, tmp_path):
    base = ["fidelity", "--dense", trained_dir, "--report", tmp_path / "rep", *SMALL]
    code, _, err = cli(*base, "--candidate", f"x={tmp_path / 'missing'}")
    assert code == 2 and "not found" in err and "missing" in err
    code, _, err = cli(*base, "--candidate", f"same={trained_dir}", "--min-top1", "1.5")
    assert code == 2 and "--min-top1 1.5 must be in [0, 1]" in err
    code, _, err = cli(*base, "--candidate", f"same={trained_dir}", "--max-ppl-ratio", "0.5")
    assert code == 2 and "--max-ppl-ratio 0.5" in err
    code, _, err = cli(*base, "--candidate", f"a={trained_dir}", "--candidate", f"a={trained_dir}")
    assert code == 2 and "used twice" in err
    code, _, err = cli(*base)
    assert code == 2 and "--candidate" in err
    code, _, err = cli("fidelity", "--dense", tmp_path / "nope", "--candidate", trained_dir, "--report", tmp_path / "rep", *SMALL)
    assert code == 2 and "not found" in err
    assert not (tmp_path / "rep" / "fidelity.json").exists()  # usage errors write nothing


def test_help_shows_defaults(cli):
    code, out, _ = cli("fidelity", "--help")
    assert code == 0
    for flag in ("--dense", "--candidate", "--report", "--max-kl", "--min-top1", "--max-ppl-ratio", "--eval-samples", "--seqlen"):
        assert flag in out
    assert "fidelity-report" in out and "default" in out
