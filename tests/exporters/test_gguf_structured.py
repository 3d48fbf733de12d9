"""Structured-pruned models: per-layer widths become llama.cpp's `deci` architecture, which loads
and runs in llama-cpp-python and matches PyTorch; uniform widths stay `llama`."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from laco_deploy.errors import ExportError

pytest.importorskip("llama_cpp")
from exporters.gguf import export  # noqa: E402
from laco_deploy.runtimes.parity import gguf_parity

NON_UNIFORM = [{"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
               {"intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}]
UNIFORM = [{"intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}] * 2


def make_structured(src, dst, widths):
    """Shrink each layer with laco_deploy.structured.shrink_layer, keeping the FFN channels with the
    largest down_proj column norms and the first KV head groups; save with laco_layer_widths."""
    from laco_deploy.models import load_model
    from laco_deploy.structured import WIDTHS_KEY, shrink_layer

    loaded = load_model(str(src))
    model, cfg = loaded.model, loaded.model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    for layer, w in zip(model.model.layers, widths, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        old = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        old.update({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})
        keep = mlp.down_proj.weight.norm(dim=0).argsort(descending=True)[: w["intermediate_size"]].sort().values
        q_rows = torch.arange(w["num_attention_heads"] * hd)
        kv_rows = torch.arange(w["num_key_value_heads"] * hd)
        shrink_layer(layer, w, hd)
        with torch.no_grad():
            for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                getattr(attn, name).weight.copy_(old[name].weight[rows])
                if old[name].bias is not None:
                    getattr(attn, name).bias.copy_(old[name].bias[rows])
            attn.o_proj.weight.copy_(old["o_proj"].weight[:, q_rows])
            mlp.gate_proj.weight.copy_(old["gate_proj"].weight[keep])
            mlp.up_proj.weight.copy_(old["up_proj"].weight[keep])
            mlp.down_proj.weight.copy_(old["down_proj"].weight[:, keep])
    setattr(cfg, WIDTHS_KEY, widths)
    model.save_pretrained(dst, safe_serialization=True)
    loaded.tokenizer.save_pretrained(dst)
    return dst


def _get(path, key):
    return gguf.GGUFReader(str(path)).get_field(key).contents()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_per_layer_widths_export_as_deci_and_run(fixture, request, tmp_path):
    src = make_structured(request.getfixturevalue(fixture), tmp_path / "structured", NON_UNIFORM)
    res = export(src, tmp_path / "s.f32.gguf", "f32", check=gguf_parity)
    assert res.checks["architecture"] == "deci" and any("deci" in n for n in res.notes)
    assert _get(res.path, "deci.feed_forward_length") == [64, 96]
    assert _get(res.path, "deci.attention.head_count") == [4, 2]
    assert _get(res.path, "deci.attention.head_count_kv") == [2, 1]
    assert _get(res.path, "deci.attention.key_length") == 16
    shapes = {t.name: list(t.shape) for t in gguf.GGUFReader(res.path).tensors}
    assert shapes["blk.1.ffn_up.weight"] == [64, 96] and shapes["blk.1.attn_q.weight"] == [64, 32]
    # llama.cpp loads the file and its logits match PyTorch's structured model
    assert res.checks["parity_top1"] >= 0.999 and res.checks["parity_mean_kl"] <= 1e-4, res.checks
    q = export(src, tmp_path / "s.q4_k_m.gguf", "q4_k_m", check=gguf_parity)
    assert q.checks["architecture"] == "deci" and q.checks["parity_top1"] >= 0.6


def test_uniform_widths_stay_llama(tiny_llama_dir, tmp_path):
    src = make_structured(tiny_llama_dir, tmp_path / "uniform", UNIFORM)
    res = export(src, tmp_path / "u.f16.gguf", "f16", check=gguf_parity)
    assert res.checks["architecture"] == "llama"
    assert _get(res.path, "llama.feed_forward_length") == 64  # the pruned width, not config.intermediate_size
    assert _get(res.path, "llama.attention.head_count") == 2
    assert res.checks["parity_top1"] >= 0.99


def test_bad_widths_are_refused(tiny_llama_dir, tmp_path):
    import shutil

    src = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["laco_layer_widths"] = NON_UNIFORM[:1]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="2 entries"):
        export(src, tmp_path / "b.gguf", "f16")
    config["laco_layer_widths"] = [{"intermediate_size": 0, "num_attention_heads": 4, "num_key_value_heads": 2}] * 2
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="no FFN channels"):
        export(src, tmp_path / "b.gguf", "f16")
