"""GGUF export: every output type round-trips (gguf reader + llama.cpp vs PyTorch), metadata, errors."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest

from laco_deploy.errors import ExportError

pytest.importorskip("llama_cpp")
from exporters.gguf import export  # noqa: E402
from laco_deploy.runtimes.parity import gguf_parity

# Tiny random models give near-flat distributions, so quantization flips many top-1 choices;
# these bounds check that each type is decoded as what it claims, not production quality.
BOUNDS = {  # quant: (min top-1 agreement, max mean KL) vs PyTorch on 128 evaluation tokens
    "f32": (0.999, 1e-4),
    "f16": (0.99, 1e-4),
    "bf16": (0.9, 1e-3),
    "q8_0": (0.85, 1e-3),
    "q6_k": (0.8, 1e-2),
    "q5_k_m": (0.7, 2e-2),
    "q4_k_m": (0.6, 2e-2),
    "q3_k_m": (0.6, 2e-2),
    "q2_k": (0.4, 5e-2),
}
MAIN_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


@pytest.mark.parametrize("quant", list(BOUNDS))
def test_every_output_type_round_trips(tiny_llama_dir, tmp_path, quant):
    res = export(tiny_llama_dir, tmp_path / f"m.{quant}.gguf", quant, check=gguf_parity)
    top1, kl = BOUNDS[quant]
    assert res.checks["parity_top1"] >= top1 and res.checks["parity_mean_kl"] <= kl, res.checks
    assert res.checks["tokenizer_match"] is True
    reader = gguf.GGUFReader(res.path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay F32 in every type
    if quant in MAIN_TYPE:
        assert types["blk.0.ffn_up.weight"] == MAIN_TYPE[quant]
    else:  # llama.cpp's quantizer: k-quant rows need 256 columns, the tiny model's 64/128 fall back
        assert set(types.values()) - {"F32", "F16"}, types
        assert reader.get_field("general.file_type").contents() == int(getattr(gguf.LlamaFileType, "MOSTLY_" + quant.upper()))
    assert res.size_bytes == (tmp_path / f"m.{quant}.gguf").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.{quant}.gguf"]  # temp files removed


def test_f32_meets_the_issue_bar(tiny_llama_sp_dir, tmp_path):
    res = export(tiny_llama_sp_dir, tmp_path / "sp.f32.gguf", "f32", check=gguf_parity)
    assert res.checks["parity_top1"] >= 0.999 and res.checks["parity_mean_kl"] <= 1e-4


def test_laco_metadata_is_recorded(tiny_llama_dir, tmp_path):
    src = tmp_path / "pruned"
    shutil.copytree(tiny_llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["laco_deploy"] = {"stage": "compensate", "method": "wanda", "pattern": "unstructured", "sparsity": 0.5,
                             "owl": False, "targets": ["q_proj", "down_proj"], "calibration": {"samples": 8}}
    (src / "config.json").write_text(json.dumps(config))
    res = export(src, tmp_path / "p.gguf", "f16", metadata={"recover": "laco", "epochs": 4})
    reader = gguf.GGUFReader(res.path)
    get = lambda k: reader.get_field(k).contents()  # noqa: E731
    assert get("laco_deploy.stage") == "compensate" and get("laco_deploy.method") == "wanda"
    assert get("laco_deploy.pattern") == "unstructured" and get("laco_deploy.sparsity") == pytest.approx(0.5)
    assert get("laco_deploy.owl") is False and get("laco_deploy.targets") == ["q_proj", "down_proj"]
    assert get("laco_deploy.calibration.samples") == 8
    assert get("laco_deploy.recover") == "laco" and get("laco_deploy.epochs") == 4
    assert "laco_deploy.stage" in res.checks["laco_deploy_keys"]


def test_failed_write_leaves_no_file(tiny_llama_dir, tmp_path, monkeypatch):
    from exporters import gguf as mod

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(mod, "_write_tensors", boom)
    with pytest.raises(RuntimeError):
        export(tiny_llama_dir, tmp_path / "x.q4_k_m.gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == []


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    src = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        export(src, tmp_path / "g.gguf", "f16")
    assert not (tmp_path / "g.gguf").exists()


def test_unknown_quant_and_missing_inputs(tiny_llama_dir, tmp_path):
    with pytest.raises(ExportError, match="'q3_k'.*q8_0.*q4_k_m"):
        export(tiny_llama_dir, tmp_path / "a.gguf", "q3_k")
    with pytest.raises(ExportError, match="not found"):
        export(tmp_path / "nope", tmp_path / "b.gguf", "f16")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", weightless)
    with pytest.raises(ExportError, match="safetensors"):
        export(weightless, tmp_path / "c.gguf", "f16")


def test_cli_export(tiny_llama_dir, tmp_path, cli):
    out = tmp_path / "cli.gguf"
    code, stdout, _ = cli("export", "--model", tiny_llama_dir, "--target", "gguf", "--quant", "f16", "--out", out)
    assert code == 0 and out.is_file() and "parity_top1" in stdout
    code, _, err = cli("export", "--model", tiny_llama_dir, "--target", "gguf", "--quant", "q3_k", "--out", out)
    assert code == 2 and "q3_k" in err and "q8_0" in err
    code, _, err = cli("export", "--model", tmp_path / "missing", "--target", "gguf", "--out", out)
    assert code == 2 and "not found" in err
