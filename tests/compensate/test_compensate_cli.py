"""`laco-deploy compensate`: a summary on success; one clear line and exit code 2 on bad input."""

from __future__ import annotations

import json

from laco_deploy.config import CompensateConfig


def test_cli_runs_and_prints_summary(cli, tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    code, out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", sparse_unstructured_dir,
                         "--out", tmp_path / "o", "--samples", 8, "--seqlen", 32, "--epochs", 1,
                         "--json", tmp_path / "r.json")
    assert code == 0, err
    assert "compensated (laco)" in out and "every zero kept" in out and "(explicit)" in out
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["stage"] == "compensate" and len(rec["per_layer"]) == 2


def test_missing_sparse_dir(cli, tiny_llama_dir, tmp_path):
    code, _out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", tmp_path / "nope", "--out", tmp_path / "o")
    assert code == 2
    assert "nope" in err and "not found" in err and "laco-deploy prune" in err
    assert len(err.strip().splitlines()) <= 2  # one message (rich may wrap it)


def test_architecture_mismatch(cli, tiny_qwen2_dir, sparse_unstructured_dir, tmp_path):
    code, _out, err = cli("compensate", "--dense", tiny_qwen2_dir, "--sparse", sparse_unstructured_dir,
                          "--out", tmp_path / "o", "--samples", 4, "--seqlen", 16)
    assert code == 2
    assert "do not match" in err and "model_type qwen2 vs llama" in err
    assert not (tmp_path / "o").exists()


def test_bad_loss_name(cli, tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    code, _out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", sparse_unstructured_dir,
                          "--out", tmp_path / "o", "--loss", "l1")
    assert code == 2
    assert "--loss 'l1' is not one of mse, nmse, cos_mse, channel_nmse, subblock" in err.replace("\n", " ")


def test_bad_method_and_epochs_reported_together(cli, tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    code, _out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", sparse_unstructured_dir,
                          "--out", tmp_path / "o", "--method", "qlora", "--epochs", 0)
    assert code == 2
    assert "qlora" in err and "--epochs" in err


def test_cpu_default_budget_is_small_and_said(cli, tiny_llama_dir, sparse_24_dir, tmp_path):
    code, out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", sparse_24_dir, "--out", tmp_path / "o",
                         "--epochs", 1, "--device", "cpu")
    assert code == 0, err
    assert f"small CPU budget: {CompensateConfig.cpu_samples} x 128 tokens" in out.replace("\n", " ")
    rec_cfg = json.loads((tmp_path / "o" / "config.json").read_text())["laco_deploy"]
    assert rec_cfg["samples"] == CompensateConfig.cpu_samples and rec_cfg["seqlen"] == 128 and rec_cfg["pattern"] == "2:4"


def test_cli_calibrates_on_builtin_mixed(cli, tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    code, _out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", sparse_unstructured_dir,
                          "--out", tmp_path / "o", "--calib", "builtin:mixed", "--samples", 4, "--seqlen", 32,
                          "--epochs", 1, "--json", tmp_path / "r.json")
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["data"]["calib"] == "builtin:mixed"
