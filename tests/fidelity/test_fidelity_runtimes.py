"""Fidelity of real exported candidates: GGUF files run by llama.cpp (cheap) and an ONNX export
run by onnxruntime (slow: the export takes ~10-30 s, so it runs with the slow suite)."""

from __future__ import annotations

import pytest

from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig
from laco_deploy.fidelity import run

DATA = DataConfig(eval_samples=2, seqlen=48)


def test_gguf_candidates_through_llama_cpp(trained_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from exporters.gguf import export

    f32 = export(trained_dir, tmp_path / "tiny.f32.gguf", "f32").path
    q8 = export(trained_dir, tmp_path / "tiny.q8_0.gguf", "q8_0").path
    result = run(ModelConfig(model=str(trained_dir), device="cpu"), DATA, FidelityConfig(max_kl=1e-2),
                 {"f32": f32, "q8_0": q8}, tmp_path / "report")
    a, b = result.candidates["f32"], result.candidates["q8_0"]
    assert a["runtime"] == b["runtime"] == "llama.cpp" and a["per_layer"] is None
    assert a["metrics"]["kl"]["max"] < 1e-4 and a["metrics"]["top1"] >= 0.99  # f32 reproduces PyTorch
    assert a["metrics"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert a["metrics"]["kl"]["mean"] < b["metrics"]["kl"]["mean"] < 1e-2  # 8-bit weights cost a little
    assert result.passed and "llama-cpp-python" in result.versions
    assert a["sha256"] != b["sha256"]


@pytest.mark.slow
def test_onnx_candidate_through_onnxruntime(trained_dir, tmp_path):
    from exporters.onnx import export

    folder = export(trained_dir, tmp_path / "onnx", "fp32").path
    result = run(ModelConfig(model=str(trained_dir), device="cpu"), DATA, FidelityConfig(max_kl=1e-6, min_top1=1.0),
                 {"onnx": folder}, tmp_path / "report")
    c = result.candidates["onnx"]
    assert c["runtime"] == "onnxruntime" and c["per_layer"] is None
    assert c["metrics"]["kl"]["max"] < 1e-6 and c["metrics"]["top1"] == 1.0
    assert result.passed and "onnxruntime" in result.versions


def test_dense_runtime_reference_agrees_on_the_same_windows(trained_dir, tmp_path):
    """The dense model's own GGUF scored on the fidelity windows: f32 agrees with PyTorch; a tolerance
    below what 8-bit weights cost makes the report say DISAGREE loudly."""
    pytest.importorskip("llama_cpp")
    from exporters.gguf import export
    from laco_deploy.fidelity.report import markdown

    f32 = export(trained_dir, tmp_path / "dense.f32.gguf", "f32").path
    q8 = export(trained_dir, tmp_path / "dense.q8_0.gguf", "q8_0").path
    mcfg = ModelConfig(model=str(trained_dir), device="cpu")
    ok = run(mcfg, DATA, FidelityConfig(), {"q8_0": q8}, tmp_path / "r1", runtime_dense=f32).runtime_agreement
    assert ok["agree"] and ok["ratio"] == pytest.approx(1.0, abs=1e-3) and ok["runtime"] == "llama.cpp"
    assert ok["windows"] == 2 * 5 and set(ok["domains"]) == {"wikipedia", "code", "dialogue", "fiction", "techdoc"}
    res = run(mcfg, DATA, FidelityConfig(runtime_ppl_tolerance=1e-7), {"q8_0": q8}, tmp_path / "r2", runtime_dense=q8)
    bad = res.runtime_agreement
    assert not bad["agree"] and bad["ratio"] != 1.0 and "q8_0" in res.candidates
    assert any("DISAGREE" in n for n in res.notes) and "**PyTorch and llama.cpp DISAGREE" in markdown(res.to_dict())
