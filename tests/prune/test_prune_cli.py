"""`laco-deploy prune`: summary on success; one-line errors with the fix and exit code 2."""

from __future__ import annotations

import json

import pytest


def test_prune_cli_writes_model_and_prints_summary(cli, tiny_llama_dir, calib_file, tmp_path):
    out = tmp_path / "p"
    code, stdout, stderr = cli("prune", "--model", tiny_llama_dir, "--method", "sparsegpt", "--pattern", "2:4",
                               "--calib", calib_file, "--samples", 4, "--seqlen", 32, "--out", out, "--device", "cpu")
    assert code == 0, stderr
    assert "sparsity     50.00%" in stdout and "peak memory" in stdout and str(out) in stdout
    assert json.loads((out / "config.json").read_text())["laco_deploy"]["pattern"] == "2:4"


def test_prune_cli_targets_and_owl(cli, tiny_llama_dir, calib_file, tmp_path):
    out = tmp_path / "owl"
    code, stdout, stderr = cli("prune", "--model", tiny_llama_dir, "--owl", "--targets", "q_proj, down_proj",
                               "--calib", calib_file, "--samples", 4, "--seqlen", 32, "--out", out)
    assert code == 0, stderr
    assert "OWL" in stdout
    doc = json.loads((out / "sparsity.json").read_text())
    assert {name.rsplit(".", 1)[-1] for name in doc["matrices"]} == {"q_proj", "down_proj"}
    ratios = [r["ratio"] for r in doc["per_layer"]]
    assert sum(ratios) / len(ratios) == pytest.approx(0.5) and ratios[0] != ratios[1]


@pytest.mark.parametrize("args,message", [
    (["--sparsity", "1.5"], "--sparsity 1.5 must be in [0, 1)"),
    (["--pattern", "4:2"], "need 0 < N < M"),
    (["--structured", "0.9"], "would remove all 2 attention head groups"),
    (["--method", "random"], "--method 'random' is not one of magnitude, wanda, sparsegpt"),
    (["--offload", "gpu"], "--offload 'gpu' is not one of cpu, disk"),
    (["--targets", "embed_tokens"], "--targets embed_tokens unknown"),
])
def test_prune_cli_bad_input(cli, tiny_llama_dir, calib_file, tmp_path, args, message):
    code, _out, err = cli("prune", "--model", tiny_llama_dir, "--calib", calib_file, "--samples", 2, "--seqlen", 16,
                          "--out", tmp_path / "x", *args)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err


def test_prune_cli_short_calibration(cli, tiny_llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    code, _out, err = cli("prune", "--model", tiny_llama_dir, "--calib", short, "--seqlen", 64, "--out", tmp_path / "x")
    assert code == 2
    assert "fewer than one sample of --seqlen 64" in " ".join(err.split())


def test_prune_cli_calibrates_on_builtin_mixed(cli, tiny_llama_dir, tmp_path):
    out = tmp_path / "mixed"
    code, _out, err = cli("prune", "--model", tiny_llama_dir, "--calib", "builtin:mixed", "--samples", 4,
                          "--seqlen", 32, "--out", out, "--device", "cpu")
    assert code == 0, err
    assert "builtin:mixed" in (out / "sparsity.json").read_text() + (out / "config.json").read_text()
