"""Bad input is exit 2 in one line, and no model's own code ever runs unasked (issue 28).

One case per fault found by trying the installed tool as a new user would; each names the words of
the one error line. A model folder with `auto_map` carries a module that leaves a file behind when
imported, and stdin offers "y": no command may read it (no library prompt) nor run the module.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

FAST = ["--samples", "4", "--seqlen", "16", "--device", "cpu"]


class _Hostile:
    """A pickle that would run a shell command when loaded without torch's weights-only guard."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _copy_model(src: Path, dst: Path, weights: bool = True) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if weights or f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture()
def bad(tmp_path, tiny_llama_dir):
    """Broken or hostile model folders (by name) made from the tiny Llama; RAN / PWNED appear if code ran."""
    d = {"TINY": tiny_llama_dir, "RAN": tmp_path / "RAN", "PWNED": tmp_path / "PWNED"}
    d["BADCFG"] = _copy_model(tiny_llama_dir, tmp_path / "badcfg")
    (d["BADCFG"] / "config.json").write_text("{not json")
    d["GPT2"] = _copy_model(tiny_llama_dir, tmp_path / "gpt2")
    (d["GPT2"] / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    d["TRUNC"] = _copy_model(tiny_llama_dir, tmp_path / "trunc", weights=False)
    data = (tiny_llama_dir / "model.safetensors").read_bytes()
    (d["TRUNC"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    d["SHAPE"] = _copy_model(tiny_llama_dir, tmp_path / "shape", weights=False)
    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)  # config.json says [64, 128]
    save_file(state, str(d["SHAPE"] / "model.safetensors"), metadata={"format": "pt"})
    d["PICKLE"] = _copy_model(tiny_llama_dir, tmp_path / "pickle", weights=False)
    (d["PICKLE"] / "pytorch_model.bin").write_bytes(pickle.dumps(_Hostile(d["PWNED"])))
    d["REMOTE"] = _copy_model(tiny_llama_dir, tmp_path / "remote")
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg.update(model_type="my_llama", auto_map={"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"})
    (d["REMOTE"] / "config.json").write_text(json.dumps(cfg))
    (d["REMOTE"] / "custom.py").write_text(f"import pathlib\npathlib.Path({str(d['RAN'])!r}).write_text('ran')\n"
                                           "from transformers import LlamaConfig, LlamaForCausalLM\n"
                                           "class MyConfig(LlamaConfig):\n    model_type = 'my_llama'\n"
                                           "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
    d["YAML"] = tmp_path / "bad.yaml"
    d["YAML"].write_text("prune:\n  sparsity: abc\n")
    d["OUT"] = tmp_path / "out"
    return d


# case -> (arguments, words of the one error line); names in capitals are paths from `bad`
CASES = {
    "plan: config.json not JSON": (["plan", "--model", "BADCFG"], "cannot read"),
    "plan: unsupported architecture": (["plan", "--model", "GPT2"], "unsupported architecture GPT2LMHeadModel"),
    "inspect: truncated safetensors": (["inspect", "--model", "TRUNC"], "not a complete safetensors file"),
    "prune: truncated safetensors": (["prune", "--model", "TRUNC", "--out", "OUT", *FAST], "not a complete safetensors file"),
    "inspect: a tensor of the wrong shape": (["inspect", "--model", "SHAPE"], "down_proj.weight has shape [64, 100]"),
    "export: a tensor of the wrong shape": (["export", "--model", "SHAPE", "--out", "OUT"], "down_proj.weight has shape [64, 100]"),
    "build: --config value of the wrong type": (["build", "--config", "YAML", "--model", "TINY", "--out", "OUT"], "'abc' must be a number"),
    "inspect --allow-pickle: hostile pickle": (["inspect", "--model", "PICKLE", "--allow-pickle"], "hold more than tensors"),
    "export: pickled weights": (["export", "--model", "PICKLE", "--out", "OUT"], "reads safetensors only"),
    "prune: --sparsity with --pattern": (["prune", "--model", "TINY", "--sparsity", "0.3", "--pattern", "2:4", "--out", "OUT"],
                                         "--sparsity 0.3 is not used with --pattern 2:4"),
    "build: --sparsity with --pattern": (["build", "--model", "TINY", "--sparsity", "0.3", "--pattern", "2:4", "--out", "OUT"],
                                         "--sparsity 0.3 is not used with --pattern 2:4"),
    "prune: --structured beyond one block": (["prune", "--model", "TINY", "--structured", "0.99", "--targets",
                                              "gate_proj,up_proj,down_proj", "--out", "OUT", *FAST], "less than one block"),
    "prune: --seqlen beyond the context": (["prune", "--model", "TINY", "--samples", "2", "--seqlen", "100000", "--out", "OUT"],
                                           "--seqlen 100000 is longer than the 512 tokens"),
    "build: --seqlen beyond the context": (["build", "--model", "TINY", "--seqlen", "100000", "--out", "OUT"],
                                           "--seqlen 100000 is longer than the 512 tokens"),
}
REMOTE = {  # every command that reads a model's config
    "plan": ["plan", "--model", "REMOTE"],
    "inspect": ["inspect", "--model", "REMOTE"],
    "prune": ["prune", "--model", "REMOTE", "--out", "OUT", *FAST],
    "compensate": ["compensate", "--dense", "REMOTE", "--sparse", "TINY", "--out", "OUT", *FAST[2:]],
    "fidelity": ["fidelity", "--dense", "REMOTE", "--candidate", "TINY", "--report", "OUT"],
    "export": ["export", "--model", "REMOTE", "--out", "OUT"],
    "build": ["build", "--model", "REMOTE", "--out", "OUT"],
    "imatrix": ["imatrix", "--model", "REMOTE", "--out", "OUT", *FAST],
}
NO_CODE_OPTION = ("export", "imatrix")  # commands that never run a model's code, so suggest no opt-in


@pytest.fixture()
def answer_yes(monkeypatch):
    """stdin holding "y" answers; -> a function saying whether anything read it."""
    stdin = io.StringIO("y\n" * 8)
    monkeypatch.setattr(sys, "stdin", stdin)
    return lambda: stdin.tell() != 0


def _run(cli, bad, args):
    return cli(*[bad.get(a, a) if isinstance(a, str) else a for a in args])


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2(cli, bad, answer_yes, case):
    args, words = CASES[case]
    code, _, err = _run(cli, bad, args)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert words in err, err
    assert "--allow-pickle" not in err or args[0] != "export"  # export has no such option to suggest
    assert not bad["PWNED"].exists() and not answer_yes()
    assert not list(bad["OUT"].parent.glob("*.gguf")) and not bad["OUT"].exists()  # nothing that looks like a result


@pytest.mark.parametrize("command", list(REMOTE))
def test_a_models_own_code_never_runs_unasked(cli, bad, answer_yes, command):
    code, _, err = _run(cli, bad, REMOTE[command])
    assert code == 2, err
    assert "ships its own Python code (config.json auto_map: AutoConfig, AutoModelForCausalLM)" in err, err
    assert ("--trust-remote-code" in err) == (command not in NO_CODE_OPTION), err  # suggested where the command has it
    assert not bad["RAN"].exists(), "the model's module was imported"
    assert not answer_yes(), "a prompt read stdin"


def test_no_prompt_reaches_a_terminal_user(bad):
    """The case that prompted: transformers asks "[y/N]" for a config of an unknown type with auto_map.
    With stdin an open pipe nobody writes to, a prompt would hang until the timeout."""
    proc = subprocess.run([sys.executable, "-m", "laco_deploy.cli", "plan", "--model", str(bad["REMOTE"])],
                          stdin=subprocess.PIPE, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr and not bad["RAN"].exists()


def test_hub_offline_is_not_called_missing(cli, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = importlib.import_module("huggingface_hub")
    for error, words in ((LocalEntryNotFoundError("offline"), "offline or the hub is unreachable"),
                         (RepositoryNotFoundError("404", response=SimpleNamespace(headers={}, status_code=404, request=None)),
                          "does not exist or is private")):
        def fail(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(hub, "snapshot_download", fail)
        code, _, err = cli("inspect", "--model", "someorg/somemodel")
        assert code == 2 and words in err, err


@pytest.mark.parametrize("command,resume", [("prune", True), ("export", False)])
def test_interrupt_suggests_resume_only_where_the_command_has_it(cli, tiny_llama_dir, tmp_path, monkeypatch, command, resume):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module("laco_deploy.prune"), "run_checked", interrupted)  # what the command runs
    monkeypatch.setattr(importlib.import_module("laco_deploy.targets").Target, "export", interrupted)
    args = {"prune": ["prune", "--model", tiny_llama_dir, "--out", tmp_path / "p", *FAST],
            "export": ["export", "--model", tiny_llama_dir, "--out", tmp_path / "m.gguf"]}[command]
    code, _, err = cli(*args)
    assert code == 130 and "interrupted" in err
    assert ("--resume" in err) == resume, err


def test_export_is_published_only_after_its_parity_check(cli, tiny_llama_dir, tmp_path, monkeypatch):
    """Killed (or failing) during the llama.cpp check: no .gguf under the final name, no partial file."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module("laco_deploy.runtimes.parity"), "gguf_parity", killed)
    out = tmp_path / "m.gguf"
    code, _, err = cli("export", "--model", tiny_llama_dir, "--quant", "f32", "--out", out)
    assert code == 130, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_to_a_full_disk_is_exit_2(cli, tiny_llama_dir, tmp_path, monkeypatch):
    """numpy's short write (no errno) from the GGUF writer, as a full disk makes it."""
    gguf_export = importlib.import_module("exporters.gguf")

    def short_write(*args, **kwargs):
        raise OSError("34816 requested and 27040 written")
    monkeypatch.setattr(gguf_export, "_write", short_write)
    code, _, err = cli("export", "--model", tiny_llama_dir, "--quant", "f32", "--out", tmp_path / "m.gguf")
    assert code == 2 and "no space left on the device" in err and "m.gguf" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
