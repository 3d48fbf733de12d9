"""GGUF tensor layout, pinned to what llama.cpp's reference converter (convert_hf_to_gguf.py in the
llama-cpp-python 0.3.36 sdist) writes. Compared once by hand on the default model and on these
tiny models (F32/F16/BF16/Q8_0): identical tensor names, shapes, types and bytes. The facts:

- names from gguf's TensorNameMap (blk.N.attn_q ...); no output.weight when embeddings are tied;
- GGUF shapes are the HF shapes reversed ([in, out]); norms and 1-D tensors stay F32;
- llama: q/k rows reordered per head (new row 2i = old i, 2i+1 = old i + d/2), k with KV heads;
  qwen2: no reordering, q/k/v biases written as blk.N.attn_*.bias;
- Q8_0 bytes are gguf.quants.quantize of the (reordered) F32 weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from exporters.gguf_model import llama3_rope_factors, permute_rope_rows
from laco_deploy.runtimes.parity import gguf_parity

pytest.importorskip("llama_cpp")


def _export(src, path, quant):
    from exporters.gguf import export

    return export(src, path, quant, check=gguf_parity)


@pytest.fixture(scope="module")
def llama_f32(tiny_llama_dir, tmp_path_factory):
    return _export(tiny_llama_dir, tmp_path_factory.mktemp("layout") / "l.f32.gguf", "f32")


def _tensors(path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_permute_rows_matches_the_definition():
    d, heads = 6, 2
    w = torch.arange(heads * d, dtype=torch.float32)[:, None].repeat(1, 3)  # row r holds value r
    out = permute_rope_rows(w, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert out[h * d + 2 * i, 0] == h * d + i
            assert out[h * d + 2 * i + 1, 0] == h * d + i + d // 2
    bias = torch.arange(heads * d, dtype=torch.float32)
    assert torch.equal(permute_rope_rows(bias, heads), out[:, 0])


def test_llama3_rope_factors_follow_the_published_formula():
    f = llama3_rope_factors(dim=128, base=500000.0, factor=8.0, low=1.0, high=4.0, old_ctx=8192)
    assert f.shape == (64,) and f.dtype == np.float32
    assert f[0] == 1.0 and f[-1] == 8.0  # short wavelengths untouched, long ones divided by the factor
    assert np.all(np.diff(f) >= 0)  # monotone blend in between


def test_names_shapes_and_values_equal_the_hf_weights(tiny_llama_dir, llama_f32):
    hf = load_file(str(tiny_llama_dir / "model.safetensors"))
    tensors = _tensors(llama_f32.path)
    expected = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2)
        for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == expected  # tied: no output.weight
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight", "output_norm.weight": "model.norm.weight"}
    for ours, theirs in pairs.items():
        t = tensors[ours]
        assert list(t.shape) == list(reversed(hf[theirs].shape))
        assert np.array_equal(np.asarray(t.data), hf[theirs].numpy())
    q = np.asarray(tensors["blk.0.attn_q.weight"].data)
    k = np.asarray(tensors["blk.0.attn_k.weight"].data)
    assert np.array_equal(q, permute_rope_rows(hf["model.layers.0.self_attn.q_proj.weight"], 4).numpy())
    assert np.array_equal(k, permute_rope_rows(hf["model.layers.0.self_attn.k_proj.weight"], 2).numpy())
    assert not np.array_equal(q, hf["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_untied_head_is_written_as_output(tiny_llama_untied_dir, tmp_path):
    res = _export(tiny_llama_untied_dir, tmp_path / "u.f16.gguf", "f16")
    tensors = _tensors(res.path)
    hf = load_file(str(tiny_llama_untied_dir / "model.safetensors"))
    out = tensors["output.weight"]
    assert out.tensor_type == gguf.GGMLQuantizationType.F16
    assert np.array_equal(np.asarray(out.data), hf["lm_head.weight"].numpy().astype(np.float16))
    assert res.checks["parity_top1"] >= 0.99


def test_qwen2_biases_and_no_reordering(tiny_qwen2_dir, tmp_path):
    res = _export(tiny_qwen2_dir, tmp_path / "q.q8_0.gguf", "q8_0")
    tensors = _tensors(res.path)
    hf = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert res.checks["architecture"] == "qwen2"
    for n in ("q", "k", "v"):
        bias = tensors[f"blk.1.attn_{n}.bias"]
        assert bias.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(bias.data), hf[f"model.layers.1.self_attn.{n}_proj.bias"].numpy())
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.quantize(hf["model.layers.0.self_attn.q_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(q.data), expected)  # quantized as-is: qwen2 uses NEOX RoPE
    assert "output.weight" in tensors and res.checks["parity_top1"] >= 0.9


def test_hparams_metadata(tiny_llama_dir, llama_f32):
    reader = gguf.GGUFReader(str(llama_f32.path))
    get = lambda k: reader.get_field(k).contents()  # noqa: E731
    assert get("general.architecture") == "llama"
    assert get("llama.block_count") == 2 and get("llama.embedding_length") == 64
    assert get("llama.feed_forward_length") == 128
    assert get("llama.attention.head_count") == 4 and get("llama.attention.head_count_kv") == 2
    assert get("llama.rope.dimension_count") == 16 and get("llama.rope.freq_base") == pytest.approx(10000.0)
    assert get("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert get("general.file_type") == int(gguf.LlamaFileType.ALL_F32)
