"""Qwen2 (q/k/v biases, untied head), Mistral (sliding window) and a SentencePiece-tokenized Llama
exported to ONNX."""

from __future__ import annotations

import onnx
import torch

from exporters import onnx as onnx_exporter
from laco_deploy.models import load_model
from laco_deploy.runtimes.onnxrt import OrtRunner
from laco_deploy.runtimes.parity import onnx_parity


def test_qwen2_with_biases(tiny_qwen2_dir, tmp_path):
    result = onnx_exporter.export(tiny_qwen2_dir, tmp_path / "qwen2", "fp32", check=onnx_parity)
    p = result.checks["parity"]
    assert p["max_abs_diff_prefill"] <= 1e-3 and p["max_abs_diff_decode"] <= 1e-3 and p["top1_agreement"] >= 0.999
    assert result.checks["greedy"]["identical"]
    genai = result.checks["genai"]  # the same folder in onnxruntime-genai (tests/exporters/test_onnx_genai.py)
    assert genai["greedy_identical"] and "tokenizer_match" in genai  # genai 0.18 tokenizes this Qwen2 BPE differently
    names = {t.name for t in onnx.load(str(tmp_path / "qwen2" / "model.onnx")).graph.initializer}
    assert any("q_proj.bias" in n for n in names)  # the biases made it into the graph
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = load_model(str(tiny_qwen2_dir)).model(ids.view(1, -1)).logits[0]
    assert (OrtRunner(tmp_path / "qwen2").logits(ids) - ref).abs().max() <= 1e-3


def test_sentencepiece_model_and_upper_case_type(tiny_llama_sp_dir, tmp_path):
    """The SentencePiece tokenizer travels with the export; type names are case-insensitive."""
    result = onnx_exporter.export(tiny_llama_sp_dir, tmp_path / "sp", "FP32", check=onnx_parity)
    assert result.quant == "fp32" and (tmp_path / "sp" / "tokenizer.model").is_file()
    assert result.checks["parity"]["max_abs_logit_diff"] <= 1e-3
    assert result.checks["genai"]["greedy_identical"]


def test_mistral_sliding_window(bpe_tokenizer, tmp_path):
    """A 64-token sliding window, crossed by the 144-token parity check (prefill and decode)."""
    import tiny  # tests/ is on sys.path (conftest)
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512, sliding_window=64, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)
    src = tiny.save_tiny(tiny.build_model(cfg, seed=4), bpe_tokenizer, tmp_path / "mistral")
    result = onnx_exporter.export(src, tmp_path / "onnx", "fp32", check=onnx_parity)
    p = result.checks["parity"]
    assert p["prefill_tokens"] + p["decode_steps"] > 2 * cfg.sliding_window
    assert p["max_abs_logit_diff"] <= 1e-3 and p["top1_agreement"] >= 0.999 and result.checks["greedy"]["identical"]
    assert result.checks["genai"]["greedy_identical"]
