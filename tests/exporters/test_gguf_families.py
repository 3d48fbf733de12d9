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

    return export(src, path, quant)


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
