"""GGUF layout of the families added after Llama/Qwen2, pinned to what llama.cpp's reference converter
writes for them (convert_hf_to_gguf.py / conversion/*.py) and its loader reads: tensor names from
gguf's own tables (gguf.MODEL_TENSORS / TENSOR_NAMES for the architecture), shapes reversed,
norms F32, the architecture's hyper-parameter keys. Runtime parity is checked by every export.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

pytest.importorskip("llama_cpp")


def _export(src, path, quant="f32"):
    from exporters.gguf import export
    from laco_deploy.runtimes.parity import gguf_parity

    return export(src, path, quant, check=gguf_parity)


def _read(path):
    reader = gguf.GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


def _allowed_names(arch: gguf.MODEL_ARCH, n_layers: int) -> set[str]:
    """Every tensor name llama.cpp's tables know for `arch` (gguf.MODEL_TENSORS), with .weight/.bias."""
    names = set()
    for kind in gguf.MODEL_TENSORS[arch]:
        base = gguf.TENSOR_NAMES[kind]
        for bid in range(n_layers) if "{bid}" in base else [None]:
            for suffix in (".weight", ".bias"):
                names.add(base.format(bid=bid) + suffix)
    return names


def _hf(src):
    return {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_qwen3_q_k_norms_and_no_reordering(tiny_qwen3_dir, tmp_path):
    res = _export(tiny_qwen3_dir, tmp_path / "q3.f32.gguf")
    reader, tensors = _read(res.path)
    hf = _hf(tiny_qwen3_dir)
    get = lambda k: reader.get_field(k).contents()  # noqa: E731
    assert get("general.architecture") == "qwen3"
    per_block = ("attn_norm", "attn_q", "attn_q_norm", "attn_k", "attn_k_norm", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")
    expected = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(2) for n in per_block}
    assert set(tensors) == expected  # tied head: no output.weight, as the converter writes it
    assert expected <= _allowed_names(gguf.MODEL_ARCH.QWEN3, 2)
    for n in ("q", "k"):  # per-head norms over head_dim, F32, unchanged
        t = tensors[f"blk.1.attn_{n}_norm.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [16]
        assert np.array_equal(np.asarray(t.data), hf[f"model.layers.1.self_attn.{n}_norm.weight"].numpy())
    q = hf["model.layers.0.self_attn.q_proj.weight"]  # NEOX RoPE: rows as in HF
    assert list(tensors["blk.0.attn_q.weight"].shape) == list(reversed(q.shape))
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), q.numpy())
    assert get("qwen3.attention.key_length") == 16 and get("qwen3.attention.value_length") == 16
    assert get("qwen3.attention.head_count") == 4 and get("qwen3.attention.head_count_kv") == 2
    assert get("qwen3.feed_forward_length") == 128 and get("qwen3.rope.freq_base") == pytest.approx(1e6)
    assert get("qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert res.checks["parity_top1"] >= 0.99


def test_per_layer_widths_refused_where_llama_cpp_has_no_graph(tiny_qwen3_dir, tmp_path):
    """deci (llama.cpp's per-layer-width graph) is Llama's layer: a Qwen3 with differing widths is refused."""
    import json
    import shutil

    from laco_deploy.errors import ExportError

    src = tmp_path / "q3"
    shutil.copytree(tiny_qwen3_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["laco_layer_widths"] = [{"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
                                {"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="Qwen3ForCausalLM with widths that differ between layers"):
        _export(src, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


GEMMA_BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate",
               "ffn_up", "ffn_down", "post_ffw_norm")


@pytest.mark.parametrize("fixture,arch,layers,qk_norms", [("tiny_gemma2_dir", gguf.MODEL_ARCH.GEMMA2, 2, False),
                                                          ("tiny_gemma3_dir", gguf.MODEL_ARCH.GEMMA3, 6, True)])
def test_gemma_norms_shifted_soft_capping_and_window(fixture, arch, layers, qk_norms, request, tmp_path):
    src = request.getfixturevalue(fixture)
    res = _export(src, tmp_path / "g.f32.gguf")
    reader, tensors = _read(res.path)
    hf = _hf(src)
    name = gguf.MODEL_ARCH_NAMES[arch]
    get = lambda k: reader.get_field(k).contents() if reader.get_field(k) is not None else None  # noqa: E731
    assert get("general.architecture") == name
    block = GEMMA_BLOCK + (("attn_q_norm", "attn_k_norm") if qk_norms else ())
    expected = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(layers) for n in block}
    assert set(tensors) == expected and expected <= _allowed_names(arch, layers)  # tied: no output.weight
    pairs = {"blk.0.attn_norm": "model.layers.0.input_layernorm", "blk.0.post_attention_norm":
             "model.layers.0.post_attention_layernorm", "blk.1.ffn_norm": "model.layers.1.pre_feedforward_layernorm",
             "blk.1.post_ffw_norm": "model.layers.1.post_feedforward_layernorm", "output_norm": "model.norm"}
    if qk_norms:
        pairs["blk.0.attn_k_norm"] = "model.layers.0.self_attn.k_norm"
    for ours, theirs in pairs.items():  # Gemma's RMSNorm scales by (1 + w): the converter writes w + 1
        t = tensors[ours + ".weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(t.data), hf[theirs + ".weight"].numpy() + 1)
    emb = hf["model.embed_tokens.weight"]  # unscaled: llama.cpp multiplies by sqrt(hidden) itself
    assert np.array_equal(np.asarray(tensors["token_embd.weight"].data), emb.numpy())
    q = hf["model.layers.0.self_attn.q_proj.weight"]  # NEOX RoPE: rows as in HF
    assert np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), q.numpy())
    assert get(f"{name}.attention.sliding_window") == 16
    assert get(f"{name}.attention.key_length") == 16 and get(f"{name}.attention.head_count_kv") == 2
    if arch == gguf.MODEL_ARCH.GEMMA2:
        assert get("gemma2.attn_logit_softcapping") == pytest.approx(50.0)
        assert get("gemma2.final_logit_softcapping") == pytest.approx(30.0)
    else:
        assert get("gemma3.rope.freq_base") == pytest.approx(1e6)  # the full-attention layers' base
        assert get("gemma3.final_logit_softcapping") is None and get("gemma3.attn_logit_softcapping") is None
    assert res.checks["parity_top1"] >= 0.99 and res.checks["parity_mean_kl"] <= 1e-5  # llama.cpp runs it as HF does


@pytest.mark.parametrize("change,message", [
    ({"tie_word_embeddings": False}, "untied LM head"),
    ({"query_pre_attn_scalar": 24}, "query_pre_attn_scalar 24 differs from head_dim 16"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "differ from llama.cpp's fixed"),
])
def test_gemma_settings_llama_cpp_fixes_otherwise_are_refused(tiny_gemma2_dir, tmp_path, change, message):
    import json
    import shutil

    from laco_deploy.errors import ExportError

    src = tmp_path / "g2"
    shutil.copytree(tiny_gemma2_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=message):
        _export(src, tmp_path / "x.gguf")


def test_phi3_fused_matrices_written_as_llama_cpp_expects(tiny_phi3_dir, tmp_path):
    """qkv_proj -> attn_qkv ([q; k; v] rows) and gate_up_proj -> ffn_up ([gate; up] rows, split by
    llama.cpp), both unchanged (NEOX RoPE); untied head -> output; Phi-3's context keys."""
    res = _export(tiny_phi3_dir, tmp_path / "p3.q8_0.gguf", "q8_0")
    reader, tensors = _read(res.path)
    hf = _hf(tiny_phi3_dir)
    get = lambda k: reader.get_field(k).contents()  # noqa: E731
    assert get("general.architecture") == "phi3"
    per_block = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in per_block}
    assert set(tensors) == expected and expected <= _allowed_names(gguf.MODEL_ARCH.PHI3, 2)
    for ours, theirs, shape in (("blk.0.attn_qkv", "model.layers.0.self_attn.qkv_proj", [64, 128]),
                                ("blk.1.ffn_up", "model.layers.1.mlp.gate_up_proj", [64, 256])):
        t = tensors[ours + ".weight"]
        assert list(t.shape) == shape and t.tensor_type == gguf.GGMLQuantizationType.Q8_0
        want = gguf.quants.quantize(hf[theirs + ".weight"].numpy(), gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(np.asarray(t.data), want)
    assert get("phi3.rope.scaling.original_context_length") == 512 and get("phi3.attention.sliding_window") == 0
    assert get("phi3.feed_forward_length") == 128 and get("phi3.rope.dimension_count") == 16
    assert res.checks["parity_top1"] >= 0.9 and res.checks["parity_mean_kl"] <= 1e-3  # q8_0 on near-flat random logits


def test_smollm3_llama_tensors_reordered_and_nope_layers_as_llama_cpp_fixes_them(tiny_smollm3_dir, tmp_path):
    """SmolLM3 -> arch `smollm3`: Llama's tensors and keys, Q/K rows reordered for normal RoPE, tied head
    dropped; no key for the NoPE layers (llama.cpp fixes every 4th). llama.cpp's logits match HF's so
    closely that a model rotating layer 3 as well could not pass (its KL is ~1e-4 on this fixture)."""
    from exporters.gguf_model import permute_rope_rows

    res = _export(tiny_smollm3_dir, tmp_path / "s3.f32.gguf")
    reader, tensors = _read(res.path)
    hf = _hf(tiny_smollm3_dir)
    get = lambda k: reader.get_field(k).contents() if reader.get_field(k) is not None else None  # noqa: E731
    assert get("general.architecture") == "smollm3"
    per_block = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    expected = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(4) for n in per_block}
    assert set(tensors) == expected and expected <= _allowed_names(gguf.MODEL_ARCH.SMOLLM3, 4)
    for n, heads in (("q", 4), ("k", 2)):  # normal RoPE: rows of each head interleaved, as for Llama
        w = hf[f"model.layers.3.self_attn.{n}_proj.weight"]
        assert np.array_equal(np.asarray(tensors[f"blk.3.attn_{n}.weight"].data), permute_rope_rows(w, heads).numpy())
    assert np.array_equal(np.asarray(tensors["blk.0.attn_v.weight"].data), hf["model.layers.0.self_attn.v_proj.weight"].numpy())
    assert tensors["blk.2.ffn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert get("smollm3.rope.freq_base") == pytest.approx(1e4) and get("smollm3.rope.dimension_count") == 16
    assert get("smollm3.attention.head_count") == 4 and get("smollm3.attention.head_count_kv") == 2
    assert get("smollm3.block_count") == 4 and get("smollm3.feed_forward_length") == 128
    assert not [k for k in reader.fields if "rope" in k and "layer" in k]  # no NoPE key: llama.cpp reads none
    assert res.checks["parity_top1"] >= 0.99 and res.checks["parity_mean_kl"] <= 1e-6


@pytest.mark.parametrize("change,message", [
    ({"no_rope_layers": [1, 0, 1, 0]}, r"no_rope_layers \[1, 0, 1, 0\] differ from llama.cpp's fixed"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 2}, r"no_rope_layers \[1, 0, 1, 0\] differ"),
    ({"use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["full_attention", "full_attention", "full_attention", "sliding_attention"]},
     "has sliding-window layers, which llama.cpp's smollm3 graph does not build"),
])
def test_smollm3_settings_llama_cpp_fixes_otherwise_are_refused(tiny_smollm3_dir, tmp_path, change, message):
    import json
    import shutil

    from laco_deploy.errors import ExportError

    src = tmp_path / "s3"
    shutil.copytree(tiny_smollm3_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=message):
        _export(src, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
