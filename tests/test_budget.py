"""`build --size` / `plan --size`: a size budget picks the measured configuration with the best measured
quality whose estimated file fits, deterministically, narrowed by the settings the user gave, explained
in the log, the summary and the manifest; a budget nothing fits names the smallest achievable size."""

from __future__ import annotations

import json

import pytest
import yaml

from laco_deploy import budget
from laco_deploy.budget import choose, explain, given_settings, parse_size
from laco_deploy.budget_table import MEASURED_SHAPE, ROWS, ModelShape, Row
from laco_deploy.config import FFN_LINEARS
from laco_deploy.errors import ConfigError
from laco_deploy.summary import size_digest, size_lines

MIB = 2**20
P = MEASURED_SHAPE  # the default model: estimates equal the measured files


@pytest.mark.parametrize("text, size", [("90MiB", 90 * MIB), ("90M", 90 * MIB), ("90 mib", 90 * MIB), ("0.09GB", 90 * 10**6),
                                        ("90MB", 90 * 10**6), ("1.5GiB", int(1.5 * 2**30)), (".5G", 2**29), ("512k", 2**19)])
def test_parse_size_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["90", "abc", "-5MiB", "90 parsecs", "nan MiB", "inf GB", "9 0MiB", "", "1e3MiB", "0MiB", "0.0000001b"])
def test_nonsense_budget_is_one_config_error_naming_the_fix(text):
    with pytest.raises(ConfigError) as e:
        parse_size(text)
    assert repr(text) in str(e.value) and "90MiB" in str(e.value)


@pytest.mark.parametrize("text, label, quant", [
    ("90MiB", "dense+qaw-q3_k_m", "q3_k_m"),  # QA-LaCo Q3_K_M through the imatrix, 89.2 MiB, 1.034 x dense: best of what fits
    ("0.09GB", "dense+qaw-q2_k", "q2_k"),  # 85.8 MiB: Q3_K_M no longer fits; Q2_K through the imatrix, 1.086 x
    ("101MiB", "dense-imatrix", "q4_k_m"),  # 100.6 MiB, 1.008 x
    ("300MiB", "dense", "f16"),  # 1.000 x, tied with ONNX fp32 (513.5 MiB): the smaller file
    ("63MiB", "s50-all+qa-q4_k_m", "q4_k_m"),  # the smallest row; tied in size with + LaCo, better ratio
])
def test_choice_on_the_default_model(text, label, quant):
    c = choose(text, P)
    assert (c.chosen.row.label, c.chosen.row.quant) == (label, quant)
    assert c.chosen.est_bytes <= c.budget_bytes
    assert all(x.est_bytes > c.budget_bytes or x.rank >= c.chosen.rank for x in c.candidates)


def test_same_inputs_same_pick_and_sizes_scale_with_the_model():
    assert choose("90MiB", P).record() == choose("90MiB", P).record()
    double = ModelShape(2 * P.params, 2 * P.embed, 2 * P.vocab)
    twice = choose("180MiB", double)  # each part scales: twice the model needs twice the budget
    assert twice.chosen.row == choose("90MiB", P).chosen.row
    with pytest.raises(ConfigError):  # the smallest row is 62.6 MiB on the default model, 125.2 MiB on twice its size
        choose("90MiB", double)


def test_ties_go_to_the_smaller_file_then_the_table_order(monkeypatch):
    rows = (Row("dense", "q8_0", 138.1, 19.30, "grid"), Row("dense", "q6_k", 132.0, 19.30, "grid"),
            Row("dense", "q4_k_m", 100.6, 30.0, "grid"), Row("dense", "q5_k_m", 132.0, 19.30, "grid"))
    monkeypatch.setattr(budget, "ROWS", rows)
    assert choose("200MiB", P).chosen.row.quant == "q6_k"  # equal quality: q6_k and q5_k_m smaller than q8_0, q6_k first
    assert [c.row.quant for c in choose("200MiB", P).candidates] == ["q6_k", "q5_k_m", "q8_0", "q4_k_m"]
    assert choose("110MiB", P).chosen.row.quant == "q4_k_m"  # the only one that fits, however poor


def test_too_small_a_budget_names_the_smallest_achievable_size():
    with pytest.raises(ConfigError) as e:
        choose("60MiB", P)
    assert "smallest achievable is 62.6 MiB" in str(e.value) and "60MiB" in str(e.value)
    choose("62.6MiB", P)  # the size the message names fits
    with pytest.raises(ConfigError) as e:
        choose("100MiB", P, {"export.target": "onnx"})
    assert "smallest achievable is 160.8 MiB" in str(e.value) and "export.target onnx" in str(e.value)


def test_given_settings_narrow_the_choice():
    assert choose("95MiB", P, {"export.quant": "Q3_K_M"}).chosen.row.label == "dense+qaw-q3_k_m"
    assert choose("90MiB", P, {"compensate.method": "none"}).chosen.row.label == "dense-imatrix"
    assert choose("90MiB", P, {"compensate.method": "none", "export.imatrix": None}).chosen.row.label == "dense"
    ffn = choose("95MiB", P, {"prune.structured": 0.3, "prune.targets": list(FFN_LINEARS)}).chosen.row
    assert (ffn.label, ffn.quant) == ("s30-ffn+laco", "q4_k_m")
    assert choose("95MiB", P, {"prune.structured": 0.3}).chosen.row.label.startswith("s30-all")  # --structured's targets: all
    assert choose("300MiB", P, {"prune.sparsity": 0.5}).chosen.row.label == "wanda50+laco"
    with pytest.raises(ConfigError) as e:
        choose("90MiB", P, {"compensate.method": "lora"})
    assert "compensate.method 'lora'" in str(e.value) and "laco, none" in str(e.value)
    for wrong in ({"prune.structured": "abc"}, {"prune.targets": 5}, {"prune.sparsity": True}):  # YAML of the wrong type
        with pytest.raises(ConfigError, match="no measured configuration has"):
            choose("90MiB", P, wrong)


def test_given_settings_come_from_the_file_and_the_flags():
    file_values = {"prune": {"structured": 0.3, "batch_size": 4}, "data": {"samples": 8}}
    overrides = {"export.quant": "q4_k_m", "data.samples": 4, "export.target": None, "compensate.method": "laco"}
    assert given_settings(file_values, overrides) == {"prune.structured": 0.3, "export.quant": "q4_k_m",
                                                      "compensate.method": "laco"}


def test_explanation_names_choice_rule_measurement_and_candidates():
    rec = choose("90MiB", P, {"export.target": "gguf"}).record()
    json.dumps(rec)
    short, full = explain(rec), explain(rec, full=True)
    text = "\n".join(short)
    for part in ("dense + QA-LaCo q3_k_m through the importance matrix, gguf q3_k_m", "89.2 MiB", "1.034 x dense", "SmolLM2-135M", "ties",
                 "benchmarks/RESULTS.md", "export.target gguf", "better, too big", "dense-imatrix q4_k_m 100.6 MiB"):
        assert part in text, part
    assert len(full) == len(short) + 1 + len(rec["candidates"]) and all(c["label"] in "\n".join(full) for c in rec["candidates"])


def test_summary_says_whether_the_file_kept_to_the_budget():
    rec = choose("90MiB", P).record()
    assert "within the budget" in "\n".join(size_lines(size_digest(rec, 89 * MIB)))
    over = size_digest(rec, 91 * MIB)
    assert over["within"] is False and "OVER the budget" in "\n".join(size_lines(over))


def _model_opts(tiny_llama_dir, tmp_path):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"samples": 6, "seqlen": 32, "eval_samples": 2}, "compensate": {"epochs": 1},
                                   "bench": {"repetitions": 1, "n_prompt": 16, "n_gen": 4, "ppl_ctx": 32, "ppl_windows": 1}}))
    return ["--model", tiny_llama_dir, "--device", "cpu", "--config", cfg, "--no-tasks"]


def test_cli_flags_narrow_and_keep_the_chosen_qa_type(tiny_llama_dir, tmp_path):
    """A flag the choice agrees with is left to it: --quant q3_k_m keeps the chosen row's QA-LaCo
    (a preset's quant-aware type would be dropped by another --quant)."""
    from laco_deploy.cli.build_cmd import _settings

    flags = {"model.model": str(tiny_llama_dir), "export.quant": "q3_k_m", "data.samples": 6, "out": str(tmp_path / "b")}
    cfg, _, rec = _settings(None, None, flags, "50MiB")
    assert rec["chosen"]["label"] == "dense+qaw-q3_k_m" and rec["given"] == {"export.quant": "q3_k_m"}
    assert (cfg.compensate.quant_aware, cfg.export.quant, cfg.prune.sparsity, cfg.data.samples) == ("q3_k_m", "q3_k_m", 0.0, 6)
    config = tmp_path / "q2.yaml"  # the same from a config file, whose other settings stay
    config.write_text(yaml.safe_dump({"export": {"quant": "q2_k"}, "compensate": {"epochs": 3}}))
    cfg, _, rec = _settings(config, None, {"model.model": str(tiny_llama_dir), "out": str(tmp_path / "b")}, "50MiB")
    assert rec["chosen"]["label"] == "dense+qaw-q2_k" and (cfg.compensate.quant_aware, cfg.compensate.epochs) == ("q2_k", 3)


def test_cli_size_with_preset_or_nonsense_is_one_line_exit_2(cli, tiny_llama_dir, tmp_path):
    code, _, err = cli("build", "--size", "90MiB", "--preset", "speed", "--out", tmp_path / "b")
    assert code == 2 and "--size and --preset" in err and "Traceback" not in err
    code, _, err = cli("build", "--size", "ninety", "--out", tmp_path / "b")
    assert code == 2 and "size budget 'ninety' is not a file size" in err
    code, _, err = cli("build", "--model", tiny_llama_dir, "--size", "1MiB", "--recover", "lora", "--out", tmp_path / "b")
    assert code == 2 and "--recover 'lora'" in err
    code, _, err = cli("build", "--model", tiny_llama_dir, "--size", "1kB", "--out", tmp_path / "b")
    assert code == 2 and "smallest achievable" in err
    assert not (tmp_path / "b").exists()


def test_plan_shows_the_choice_without_building(cli, tiny_llama_dir, tmp_path):
    code, out, _ = cli("plan", "--model", tiny_llama_dir, "--size", "1MiB")
    assert code == 0 and "chosen           dense, gguf f16" in out and "fits source" in out
    code, out, _ = cli("plan", "--model", tiny_llama_dir, "--size", "1MiB", "--json")
    assert code == 0 and json.loads(out)["size_budget"]["chosen"]["label"] == "dense"


def test_build_by_size_end_to_end(cli, tiny_llama_dir, tmp_path):
    """A tiny build: the choice and why are in build.log, the summary and manifest.json."""
    out = tmp_path / "b"
    code, stdout, err = cli("build", *_model_opts(tiny_llama_dir, tmp_path), "--size", "1MiB", "--out", out)
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    rec = manifest["size_budget"]
    assert rec["chosen"]["label"] == "dense" and rec["chosen"]["quant"] == "f16" and len(rec["candidates"]) == len(ROWS)
    assert manifest["config"]["prune"]["sparsity"] == 0.0 and manifest["config"]["compensate"]["method"] == "none"
    assert manifest["summary"]["size_budget"]["within"] is True
    assert "chosen           dense, gguf f16" in stdout and "within the budget" in stdout
    log = (out / "build.log").read_text()
    assert "fits source" in log and "s50-all+laco q4_k_m" in log and "size 1MiB -> dense f16" in err
