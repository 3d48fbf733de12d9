"""CLI basics: help for every command, one-line errors with exit codes, --debug tracebacks."""

from __future__ import annotations

import pytest

COMMANDS = ["build", "prune", "compensate", "fidelity", "export", "inspect", "bench", "bench run"]


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
