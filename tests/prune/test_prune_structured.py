"""Structured pruning: removing channels / head groups equals masking them; widths survive a save/load."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from laco_deploy.config import ModelConfig, PruneConfig
from laco_deploy.errors import ConfigError
from laco_deploy.models import load_model
from laco_deploy.prune import run, structural


def _layer_call(model, layer, hidden):
    pos = torch.arange(hidden.shape[1]).unsqueeze(0)
    cos_sin = model.model.rotary_emb(hidden, pos)
    out = layer(hidden, position_embeddings=cos_sin, position_ids=pos, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def _mask_like_removal(layer, keep_ffn: torch.Tensor, keep_groups: torch.Tensor, kv_heads: int) -> None:
    """Zero (instead of removing) everything outside the kept channels and head groups."""
    mlp, attn = layer.mlp, layer.self_attn
    drop = torch.ones(mlp.gate_proj.out_features, dtype=torch.bool)
    drop[keep_ffn] = False
    with torch.no_grad():
        mlp.gate_proj.weight[drop] = 0
        mlp.up_proj.weight[drop] = 0
        mlp.down_proj.weight[:, drop] = 0
        hd = attn.head_dim
        group = attn.q_proj.out_features // hd // kv_heads
        q_keep = structural.head_rows(keep_groups, group, hd)
        kv_keep = structural.head_rows(keep_groups, 1, hd)
        for lin, keep, rows in ((attn.q_proj, q_keep, True), (attn.k_proj, kv_keep, True),
                                (attn.v_proj, kv_keep, True), (attn.o_proj, q_keep, False)):
            dropped = torch.ones(lin.weight.shape[0 if rows else 1], dtype=torch.bool)
            dropped[keep] = False
            if rows:
                lin.weight[dropped] = 0
                if lin.bias is not None:
                    lin.bias[dropped] = 0
            else:
                lin.weight[:, dropped] = 0


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_removal_equals_masking(fixture, request):
    model = load_model(str(request.getfixturevalue(fixture))).model
    layer = model.model.layers[0]
    masked, shrunk = copy.deepcopy(layer), copy.deepcopy(layer)
    keep_ffn = torch.tensor([0, 3, 7, 8, 40, 99, 127])
    keep_groups = torch.tensor([1])
    _mask_like_removal(masked, keep_ffn, keep_groups, kv_heads=2)
    structural.remove_ffn_channels(shrunk.mlp, keep_ffn)
    structural.remove_head_groups(shrunk.self_attn, keep_groups, kv_heads=2)
    assert shrunk.mlp.down_proj.weight.shape == (64, 7)
    assert shrunk.self_attn.q_proj.weight.shape == (32, 64) and shrunk.self_attn.k_proj.weight.shape == (16, 64)
    assert structural.layer_width(shrunk) == {"intermediate_size": 7, "num_attention_heads": 2, "num_key_value_heads": 1}
    hidden = torch.randn(2, 12, 64)
    with torch.no_grad():
        a, b = _layer_call(model, masked, hidden), _layer_call(model, shrunk, hidden)
    assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(a, _layer_call(model, layer, hidden), atol=1e-3)  # the masking did something


@pytest.mark.parametrize("metric", ["wanda", "fluctuation"])
def test_structured_run_matches_masked_dense_model(tiny_llama_dir, tmp_path, metric, data_cfg):
    out = tmp_path / "structured"
    result = run(ModelConfig(model=str(tiny_llama_dir)), data_cfg,
                 PruneConfig(structured=0.3, structured_metric=metric, structured_multiple=1), out)
    cfg = json.loads((out / "config.json").read_text())
    # 128 FFN channels -> 38 removed (exact ratio: structured_multiple 1); 2 KV groups -> round(0.6) = 1 removed
    # uniform widths in transformers' own keys; head_dim pinned (hidden 64 / 2 heads would say 32)
    assert {k: cfg[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")} == \
        {"intermediate_size": 90, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    assert "laco_layer_widths" not in cfg and "laco_loader" not in cfg
    assert cfg["laco_deploy"]["pattern"] == "structured"
    removed = 2 * (38 * 64 * 3) + 2 * (64 * 64 * 2 + 32 * 64 * 2) // 2
    total = 2 * (128 * 64 * 3 + 64 * 64 * 2 + 32 * 64 * 2)
    assert result.sparsity == pytest.approx(removed / total, abs=1e-6)
    pruned = load_model(str(out)).model
    assert pruned.model.layers[1].mlp.up_proj.weight.shape == (90, 64)
    dense = load_model(str(tiny_llama_dir)).model
    doc = json.loads((out / "sparsity.json").read_text())
    for layer, rec in zip(dense.model.layers, doc["per_layer"]):
        _mask_like_removal(layer, torch.tensor(rec["kept_ffn_channels"]), torch.tensor(rec["kept_head_groups"]), 2)
    ids = torch.randint(0, 500, (2, 20))
    with torch.no_grad():
        assert torch.allclose(pruned(ids).logits, dense(ids).logits, atol=1e-4)


@pytest.mark.parametrize("ratio, multiple, kept", [(0.3, 32, 96), (0.3, 64, 64), (0.3, 1, 90), (0.1, 32, 128),
                                                    (0.9, 32, 32), (0.3, 256, 90)])
def test_structured_keeps_a_multiple_of_ffn_channels(ratio, multiple, kept):
    # 128 channels; a multiple wider than the layer falls back to the exact count
    assert 128 - structural.removal_count(128, ratio, multiple) == kept


def test_structured_default_widths_export_to_gguf_without_f16_fallback(tiny_llama_dir, tmp_path, data_cfg):
    """Kept FFN channels are a multiple of 32 by default, so Q8_0 quantizes ffn_down's rows too."""
    import gguf

    from exporters.gguf import export

    out = tmp_path / "s30"
    run(ModelConfig(model=str(tiny_llama_dir)), data_cfg, PruneConfig(structured=0.3), out)
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 96
    result = export(out, tmp_path / "s30.gguf", "q8_0")
    assert not any("F16" in n for n in result.notes)
    reader = gguf.GGUFReader(tmp_path / "s30.gguf")
    down = [t for t in reader.tensors if t.name.endswith("ffn_down.weight")]
    assert down and all(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in down)


def test_structured_ffn_only_targets_keep_attention(tiny_llama_dir, tmp_path, data_cfg):
    out = tmp_path / "ffn_only"
    run(ModelConfig(model=str(tiny_llama_dir)), data_cfg,
        PruneConfig(structured=0.5, targets=("gate_proj", "up_proj", "down_proj")), out)
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads")} == \
        {"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_structured_ratio_leaving_no_head_group_is_refused(tiny_llama_dir, tmp_path, data_cfg):
    with pytest.raises(ConfigError, match="would remove all 2 attention head groups.*smaller|would remove all 2"):
        run(ModelConfig(model=str(tiny_llama_dir)), data_cfg, PruneConfig(structured=0.8), tmp_path / "x")
    assert not (tmp_path / "x").exists()
