"""CLI basics: help for every command, one-line errors with exit codes, --debug tracebacks."""

from __future__ import annotations

import pytest

COMMANDS = ["build", "prune", "compensate", "fidelity", "export", "imatrix", "inspect", "bench", "bench run"]


def test_root_help_lists_every_stage(cli):
    code, out, _ = cli("--help")
    assert code == 0
    for name in ("build", "prune", "compensate", "fidelity", "export", "bench"):
        assert name in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(cli, command):
    code, out, _ = cli(*command.split(), "--help")
    assert code == 0 and "Usage" in out


def test_inspect_tiny_model(cli, tiny_llama_dir):
    code, out, _ = cli("inspect", "--model", tiny_llama_dir)
    assert code == 0
    assert "layers=2 hidden=64" in out


def test_missing_model_is_one_line_exit_2(cli, tmp_path):
    code, out, err = cli("inspect", "--model", tmp_path / "nope")
    assert code == 2
    assert "error:" in err and "not found" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3  # one message, maybe wrapped by the terminal width


def test_unsupported_architecture_exit_2(cli, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, err = cli("inspect", "--model", tmp_path)
    assert code == 2 and "unsupported architecture BertModel" in err


def test_debug_shows_the_traceback(cli, tmp_path):
    from laco_deploy.errors import ModelError

    with pytest.raises(ModelError):
        cli("--debug", "inspect", "--model", tmp_path / "nope")


def test_unknown_option_is_usage_error(cli):
    code, _, err = cli("inspect", "--no-such-flag")
    assert code == 2 and "No such option" in err


def test_threads_option_sets_torch_threads(cli, tiny_llama_dir):
    import torch

    before = torch.get_num_threads()
    try:
        code, _, _ = cli("--threads", "2", "inspect", "--model", tiny_llama_dir)
        assert code == 0 and torch.get_num_threads() == 2  # conftest pins 1
        code, _, err = cli("--threads", "0", "inspect", "--model", tiny_llama_dir)
        assert code == 2 and "--threads" in err
    finally:
        torch.set_num_threads(before)


# (command line, module and attribute of its first slow step): an unwritable output must stop the run before it
UNWRITABLE = {
    "export": (["export", "--model", "default", "--target", "gguf", "--out", "/proc/forbidden.gguf"],
               "laco_deploy.models", "ensure_default_converted"),
    "prune": (["prune", "--model", "default", "--out", "/proc/forbidden/pruned"], "laco_deploy.prune", "run"),
    "compensate": (["compensate", "--sparse", "TINY", "--out", "/proc/forbidden/recovered"], "laco_deploy.compensate", "run"),
    "fidelity": (["fidelity", "--candidate", "TINY", "--report", "/proc/forbidden/report"], "laco_deploy.fidelity", "run"),
    "build": (["build", "--out", "/proc/forbidden/build"], "laco_deploy.pipeline", "build"),
    "imatrix": (["imatrix", "--model", "default", "--out", "/proc/forbidden.gguf"], "laco_deploy.models",
                "ensure_default_converted"),
}


@pytest.mark.parametrize("command", list(UNWRITABLE))
def test_unwritable_output_is_one_line_exit_2_before_slow_work(cli, tiny_llama_dir, monkeypatch, command):
    import importlib

    args, module, attr = UNWRITABLE[command]
    args = [str(tiny_llama_dir) if a == "TINY" else a for a in args]

    def slow_work(*a, **k):
        raise AssertionError(f"{command} started its slow work before checking its output")

    monkeypatch.setattr(importlib.import_module(module), attr, slow_work)
    code, out, err = cli(*args)
    user_path = next(a for a in args if a.startswith("/proc/forbidden"))
    option = "--report" if command == "fidelity" else "--out"
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"error: cannot write {user_path}: /proc does not accept new files" in err
    assert f"choose another {option}" in err and ".partial" not in err


def test_read_only_output_is_exit_2(cli, tiny_llama_dir, tmp_path, monkeypatch):
    import errno

    from laco_deploy import fsutil

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fsutil.tempfile, "mkstemp", read_only)
    code, _, err = cli("export", "--model", tiny_llama_dir, "--target", "gguf", "--out", tmp_path / "m.gguf")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"cannot write {tmp_path / 'm.gguf'}: {tmp_path} is on a read-only file system; choose another --out" in err


def test_build_help_shows_examples_and_exit_codes(cli):
    code, out, _ = cli("build", "--help")
    assert code == 0
    assert "Examples" in out and "laco-deploy build --target gguf --max-kl 0.6 --min-top1 0.6" in out
    assert "0.6 nats of KL per token" in out  # what the gate values mean
    assert "Exit codes" in out
    for line in ("1    a gate", "2    bad input", "3    internal error", "130  interrupted (Ctrl-C), 143 terminated"):
        assert line in out


@pytest.mark.parametrize("command", ["prune", "compensate", "fidelity", "export", "imatrix", "inspect", "bench run",
                                     "bench compare"])
def test_every_command_help_lists_the_exit_codes(cli, command):
    code, out, _ = cli(*command.split(), "--help")
    assert code == 0 and "Exit codes" in out and "2    bad input" in out


def test_root_help_shows_how_to_start(cli):
    code, out, _ = cli("--help")
    assert code == 0 and "laco-deploy build --target gguf" in out and "Exit codes" in out
    assert "--verbose" in out and "--quiet" in out


@pytest.mark.parametrize("columns", ["80", "100"])
def test_prune_help_keeps_the_targets_default_whole(cli, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    code, out, _ = cli("prune", "--help")
    assert code == 0 and "…" not in out
    assert "[default: all]" in out and "down_proj" in out


@pytest.mark.parametrize("command", [[], ["build"], ["compensate"]])
def test_help_and_readme_name_the_method_by_its_full_title(cli, command):
    """Another paper is also called "LaCo" (layer collapse, merging layers): say which one this is."""
    from pathlib import Path

    code, out, _ = cli(*command, "--help")
    flat = " ".join(out.split())
    assert code == 0 and "LaCo: Layer-wise Compensation for Pruned Large Language Models (ACL 2026)" in flat
    assert "Layer Collapse" in flat
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "*LaCo: Layer-wise Compensation for Pruned Large Language Models* (ACL 2026)" in readme
    assert "Layer Collapse" in readme


@pytest.mark.parametrize("args, shown, hidden", [
    (["prune", "--out", "o", "--sparsity", "2", "--damp", "3"], ["--sparsity 2.0", "--damp 3.0"], ["prune."]),
    (["build", "--recover", "bogus", "--samples", "0"], ["--recover 'bogus'", "--samples 0"], ["compensate.", "data."]),
    (["compensate", "--sparse", ".", "--out", "o", "--method", "bogus"], ["--method 'bogus'"], ["compensate."]),
])
def test_errors_show_the_running_commands_flags(cli, tmp_path, monkeypatch, args, shown, hidden):
    """The library names settings (prune.sparsegpt_damp); the CLI prints the flag of the command that ran."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*args)
    err = " ".join(err.split())
    assert code == 2 and all(s in err for s in shown) and not any(h in err for h in hidden), err


def _group():
    import typer

    from laco_deploy.cli.app import app

    return typer.main.get_command(app)


@pytest.mark.parametrize("command, message, shown", [
    # a setting the command runs but has no flag for stays: the YAML key to fix
    ("build", "compensate.samples 0; data.samples 0", "compensate.samples 0; --samples 0"),
    # a stage the command does not run: the stage command's flag
    ("bench", "re-export with export.sparse_storage", "re-export with laco-deploy export --sparse-storage"),
    ("compensate", "prune one first (prune.out DIR)", "prune one first (laco-deploy prune --out DIR)"),
    ("fidelity", "bench.tolerance x", "laco-deploy bench compare --tolerance x"),
    # file names and paths are not settings, even where a flag of that name exists (build --json)
    ("build", "delete fidelity.json or out/fidelity.md; a model.safetensors file",
     "delete fidelity.json or out/fidelity.md; a model.safetensors file"),
    ("bench", "model.model default", "model.model default"),  # no flag and no stage command for it
])
def test_settings_become_the_flags_the_user_types(command, message, shown):
    from laco_deploy.cli.flags import with_flags

    assert with_flags(message, _group(), command) == shown


def test_log_lines_show_the_running_commands_flags(capsys):
    """Warnings and notes from the library name settings too; the terminal shows flags."""
    import logging

    from laco_deploy.cli import flags, output

    flags.use(_group(), "prune")
    output.configure(output.Verbosity.NORMAL)
    logging.getLogger("laco_deploy.test").warning("prune.offload disk needs safetensors")
    assert "warning: --offload disk needs safetensors" in capsys.readouterr().err
