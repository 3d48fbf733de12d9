"""Bad input is reported before slow work: one line, exit 2, nothing left behind.

Every case below is checkable without loading or converting a model (pipeline.check_inputs,
models.check_source, data.check_texts). Each test replaces the first slow step with a function that
fails the test if it is reached, so the order is checked, not only the message.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from laco_deploy.errors import DataError, ModelError


def _never(what: str):
    def slow(*args, **kwargs):
        raise AssertionError(f"{what} ran although an input was bad")
    return slow


@pytest.fixture()
def inputs(tmp_path, tiny_llama_dir):
    """Paths of good and bad inputs, by name."""
    good = tmp_path / "calib.txt"
    good.write_text("Some calibration text.\n\nAnother document.\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    not_gguf = tmp_path / "bad.gguf"
    not_gguf.write_bytes(b"NOPE" + b"\0" * 64)
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 24)  # version 3, absurd tensor/key counts, no data
    broken_cfg = tmp_path / "broken_cfg"
    broken_cfg.mkdir()
    (broken_cfg / "config.json").write_text("{not json")
    (broken_cfg / "model.safetensors").write_bytes(b"")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    return {"TINY": tiny_llama_dir, "GOOD": good, "EMPTY": empty, "LATIN1": latin1, "BADJSONL": bad_jsonl,
            "NOTGGUF": not_gguf, "TRUNC": truncated, "BROKENCFG": broken_cfg, "NOWEIGHTS": no_weights, "BERT": bert,
            "DIR": tmp_path, "MISSING": tmp_path / "missing.txt"}


# build arguments (after --model TINY --calib GOOD unless overridden) -> what the one error line says
BUILD_CASES = {
    "sparsity": (["--sparsity", "1.5"], "--sparsity 1.5 must be in [0, 1)"),
    "pattern": (["--pattern", "4:2"], "need 0 < N < M"),
    "target": (["--target", "tflite"], "--target 'tflite' is not one of"),
    "quant": (["--quant", "q3_z"], "--quant 'q3_z' is not valid for gguf"),
    "missing model": (["--model", "MISSING"], "not found"),
    "not a gguf": (["--model", "NOTGGUF"], "is not a GGUF file"),
    "truncated gguf": (["--model", "TRUNC"], "corrupt or truncated GGUF"),
    "config not json": (["--model", "BROKENCFG"], "cannot read"),
    "no weights": (["--model", "NOWEIGHTS"], "has no weights"),
    "unsupported family": (["--model", "BERT"], "unsupported architecture BertModel"),
    "empty calibration": (["--calib", "EMPTY"], "holds no text"),
    "missing calibration": (["--calib", "MISSING"], "not found"),
    "calibration is a folder": (["--calib", "DIR"], "is a directory"),
    "calibration not utf-8": (["--calib", "LATIN1"], "is not UTF-8 text"),
    "bad jsonl": (["--calib", "BADJSONL"], 'has no string "text" field'),
    "empty evaluation": (["--eval", "builtin,EMPTY"], "holds no text"),
    "evaluation-only domain as calibration": (["--calib", "builtin:fiction"], "evaluation-only text"),
    "calibration mix as evaluation": (["--eval", "builtin:mixed"], "calibration-only text"),
    # (a mistyped task name is found the same way, but only after lm-eval indexes its ~10k tasks: 20-40 s)
    "missing task file": (["--tasks", "no_such_task.yaml"], "task file no_such_task.yaml not found"),
}
if not torch.cuda.is_available():
    BUILD_CASES["cuda without a gpu"] = (["--device", "cuda"], "no CUDA GPU is visible")


@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_build_reports_bad_input_before_any_work(cli, inputs, tmp_path, monkeypatch, cache_dir, case):
    args, message = BUILD_CASES[case]
    monkeypatch.setattr(importlib.import_module("laco_deploy.pipeline"), "build", _never("the build"))
    monkeypatch.setattr(importlib.import_module("laco_deploy.models"), "ensure_gguf_converted", _never("GGUF conversion"))
    out = tmp_path / "build"
    argv = ["build", "--model", inputs["TINY"], "--calib", inputs["GOOD"], "--out", out]
    argv += [inputs.get(a, a) if not str(a).startswith("builtin,") else "builtin," + str(inputs[a.split(",")[1]]) for a in args]
    code, stdout, err = cli(*argv)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert message in err, err
    assert "converting" not in err and "Traceback" not in err
    assert not out.exists()  # no build folder, no build.log: nothing that looks like a started build
    assert not list(cache_dir.rglob("*.safetensors"))


def test_library_build_checks_inputs_before_the_folder_or_a_model(tmp_path, monkeypatch, inputs):
    from laco_deploy import pipeline
    from laco_deploy.buildconfig import merge

    monkeypatch.setattr(importlib.import_module("laco_deploy.prune"), "run_checked", _never("pruning"))  # a build's entry
    cfg = merge({}, {"model.model": str(inputs["TINY"]), "data.calib": str(inputs["EMPTY"]), "out": str(tmp_path / "b")})
    with pytest.raises(DataError, match="holds no text"):
        pipeline.build(cfg)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["prune", "compensate"])
def test_stage_commands_check_calibration_before_loading(cli, inputs, tmp_path, monkeypatch, command):
    # the stages call load_model through their own modules; replace the names they hold
    monkeypatch.setattr(importlib.import_module("laco_deploy.prune.run"), "load_model", _never("loading the model"))
    monkeypatch.setattr(importlib.import_module("laco_deploy.compensate.streamed"), "load_model", _never("loading the model"))
    if command == "prune":
        args = ["prune", "--model", inputs["TINY"], "--calib", inputs["EMPTY"], "--out", tmp_path / "p"]
    else:
        args = ["compensate", "--dense", inputs["TINY"], "--sparse", inputs["TINY"], "--calib", inputs["EMPTY"],
                "--out", tmp_path / "p"]
    code, _, err = cli(*args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds no text" in err
    assert not (tmp_path / "p").exists() and not (tmp_path / "p.ckpt").exists()


def test_fidelity_checks_evaluation_text_before_loading(cli, inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.import_module("laco_deploy.fidelity.evaluate"), "local_model_dir", _never("loading the dense model"))
    code, _, err = cli("fidelity", "--dense", inputs["TINY"], "--candidate", inputs["TINY"], "--eval", inputs["EMPTY"],
                       "--report", tmp_path / "r")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds no text" in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_corrupt_gguf_is_reported_before_converting(cli, inputs, tmp_path, cache_dir, command):
    args = ["--model", inputs["TRUNC"]] + (["--out", tmp_path / "m.gguf"] if command == "export" else [])
    code, _, err = cli(command, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "corrupt or truncated GGUF" in err and "converting" not in err
    assert not list(cache_dir.rglob("*")) and not (tmp_path / "m.gguf").exists()


def test_check_source_skips_the_gguf_read_once_converted(tmp_path, monkeypatch, cache_dir):
    """A GGUF already converted (same size and mtime) is not parsed again: the check costs ~3 s on 100 MB."""
    from laco_deploy import models

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"NOPE")
    with pytest.raises(ModelError, match="not a GGUF file"):
        models.check_source(str(gguf))
    converted = models._gguf_cache_path(gguf)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / "model.safetensors").write_bytes(b"")
    assert models.check_source(str(gguf)).kind == models.GGUF_FILE


def test_hub_datasets_are_left_to_the_loader(monkeypatch):
    """Checking hf: specs would mean downloading them; the preflight leaves them alone."""
    from laco_deploy import data

    monkeypatch.setattr(data, "_read_hf", _never("a hub download"))
    data.check_texts("hf:wikitext:wikitext-2-raw-v1:test", "calib")
    data.check_texts("builtin,hf:some/set", "eval")
