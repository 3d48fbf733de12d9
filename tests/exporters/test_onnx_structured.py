"""Structured-pruned models export with their smaller shapes."""

from __future__ import annotations

import json

import onnx
import pytest
import torch

from exporters import onnx as onnx_exporter
from laco_deploy.models import load_model, save_model
from laco_deploy.runtimes.onnxrt import OrtDecoder, OrtRunner
from laco_deploy.runtimes.parity import onnx_parity
from laco_deploy.structured import WIDTHS_KEY, shrink_layer

WIDTHS = [{"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
          {"intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}]


def _slice_layer(layer, width: dict, head_dim: int) -> None:
    """Keep the FFN channels with the largest up_proj row norms and the first KV group(s)."""
    attn, mlp = layer.self_attn, layer.mlp
    old = {n: m.weight.detach().clone() for n, m in [*attn.named_children(), *mlp.named_children()]
           if isinstance(m, torch.nn.Linear)}
    keep = old["up_proj"].norm(dim=1).topk(width["intermediate_size"]).indices.sort().values
    q_rows = width["num_attention_heads"] * head_dim
    kv_rows = width["num_key_value_heads"] * head_dim
    shrink_layer(layer, width, head_dim)
    with torch.no_grad():
        attn.q_proj.weight.copy_(old["q_proj"][:q_rows])
        attn.k_proj.weight.copy_(old["k_proj"][:kv_rows])
        attn.v_proj.weight.copy_(old["v_proj"][:kv_rows])
        attn.o_proj.weight.copy_(old["o_proj"][:, :q_rows])
        mlp.gate_proj.weight.copy_(old["gate_proj"][keep])
        mlp.up_proj.weight.copy_(old["up_proj"][keep])
        mlp.down_proj.weight.copy_(old["down_proj"][:, keep])


@pytest.fixture(scope="module")
def structured_dir(tiny_llama_dir, tmp_path_factory):
    loaded = load_model(str(tiny_llama_dir))
    model = loaded.model
    for layer, width in zip(model.model.layers, WIDTHS):
        _slice_layer(layer, width, model.config.hidden_size // model.config.num_attention_heads)
    setattr(model.config, WIDTHS_KEY, WIDTHS)
    model.config.laco_deploy = {"stage": "prune", "method": "magnitude", "pattern": "structured 25%"}
    out = tmp_path_factory.mktemp("structured") / "model"
    save_model(model, loaded.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def structured_export(structured_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "structured"
    return onnx_exporter.export(structured_dir, out, "fp32", sparse_storage=True, check=onnx_parity), out


def test_smaller_shapes_in_the_graph(structured_export):
    _, out = structured_export
    model = onnx.load(str(out / "model.onnx"))
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    assert dims["model.layers.0.mlp.gate_proj.weight.T"] == [64, 64]
    assert dims["model.layers.1.mlp.down_proj.weight.T"] == [96, 64]
    assert dims["model.layers.1.self_attn.k_proj.weight.T"] == [64, 16]
    past = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert past["past_key_values.0.key"][1] == 2 and past["past_key_values.1.key"][1] == 1
    assert OrtDecoder(out).kv_dims["past_key_values.1.value"] == (1, 16)
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["laco_deploy.layer_widths"]) == WIDTHS and meta["laco_deploy.pattern"] == "structured 25%"


def test_structured_parity_and_decoding(structured_export, structured_dir):
    result, out = structured_export
    p = result.checks["parity"]
    assert p["max_abs_diff_prefill"] <= 1e-3 and p["max_abs_diff_decode"] <= 1e-3 and p["top1_agreement"] >= 0.999
    assert result.checks["greedy"]["identical"]
    assert any("FFN sizes [64, 96]" in n for n in result.notes)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = load_model(str(structured_dir)).model(ids.view(1, -1)).logits[0]
    assert (OrtRunner(out).logits(ids) - ref).abs().max() <= 1e-4


def test_sizes_and_dense_note(structured_export):
    result, out = structured_export
    assert (out / "model.onnx_data").is_file()
    assert result.size_bytes == (out / "model.onnx").stat().st_size + (out / "model.onnx_data").stat().st_size
    assert (out / "model.onnx").stat().st_size < (out / "model.onnx_data").stat().st_size
    # no zeros in a structured model: sparse storage keeps it dense and says so
    assert result.checks["storage"]["tensors_compressed"] == 0
    assert any("stored dense" in n for n in result.notes)
    assert not (out / "genai_config.json").is_file() and "genai" not in result.checks  # genai reads no sparse storage
    assert any("no genai_config.json: sparse storage" in n for n in result.notes)
