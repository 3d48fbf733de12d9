"""Structured-pruned folders: uniform widths load in plain transformers, per-layer widths name their loader."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from laco_deploy import structured
from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
from laco_deploy.models import load_model, save_model
from laco_deploy.prune import run as prune
from laco_deploy.prune.structural import layer_width, remove_ffn_channels

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 33]])


@pytest.fixture(scope="module")
def uniform_dir(tiny_qwen2_dir, tmp_path_factory):
    """Qwen2 (biases, untied head) pruned by `--structured 0.3`: 128 -> 96 FFN channels (a multiple of 32), 2 -> 1 head groups."""
    out = tmp_path_factory.mktemp("uniform") / "pruned"
    data = DataConfig(calib="builtin", samples=2, seqlen=16)
    prune(ModelConfig(model=str(tiny_qwen2_dir)), data, PruneConfig(structured=0.3), out)
    return out


@pytest.fixture(scope="module")
def per_layer_dir(tiny_llama_dir, tmp_path_factory):
    """Layer 1 keeps 64 of 128 FFN channels, layer 0 all of them."""
    loaded = load_model(str(tiny_llama_dir))
    remove_ffn_channels(loaded.model.model.layers[1].mlp, torch.arange(64))
    structured.write_widths(loaded.model.config, [layer_width(layer) for layer in loaded.model.model.layers])
    out = tmp_path_factory.mktemp("per_layer") / "model"
    save_model(loaded.model, loaded.tokenizer, out)
    return out


def test_uniform_widths_load_in_plain_transformers(uniform_dir):
    cfg = json.loads((uniform_dir / "config.json").read_text())
    assert (cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (96, 2, 1, 16)
    assert structured.WIDTHS_KEY not in cfg and structured.LOADER_KEY not in cfg
    plain = AutoModelForCausalLM.from_pretrained(uniform_dir, dtype=torch.float32).eval()  # no laco_deploy involved
    ours = load_model(str(uniform_dir)).model
    assert plain.model.layers[1].mlp.up_proj.weight.shape == (96, 64)
    assert plain.model.layers[0].self_attn.q_proj.bias.shape == (32,)
    with torch.no_grad():
        a, b = plain(IDS).logits, ours(IDS).logits
    assert torch.equal(a, b)  # the same weights, every one of them loaded (a fresh init would differ)


def test_per_layer_widths_name_their_loader(per_layer_dir):
    cfg = json.loads((per_layer_dir / "config.json").read_text())
    assert [w["intermediate_size"] for w in cfg[structured.WIDTHS_KEY]] == [128, 64]
    assert "laco_deploy.models.load_model" in cfg[structured.LOADER_KEY]
    with pytest.raises(Exception, match="size mismatch|mismatched_sizes"):  # transformers' error; the config says why
        AutoModelForCausalLM.from_pretrained(per_layer_dir, dtype=torch.float32)
    model = load_model(str(per_layer_dir)).model
    assert model.model.layers[1].mlp.down_proj.weight.shape == (64, 64)
    assert torch.isfinite(model(IDS).logits).all()


def test_rewriting_uniform_widths_drops_the_per_layer_keys(per_layer_dir):
    config = load_model(str(per_layer_dir)).model.config
    structured.write_widths(config, [{"intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}] * 2)
    assert structured.loads_in_plain_transformers(config) and config.intermediate_size == 64
    assert not hasattr(config, structured.LOADER_KEY)


def test_inspect_says_what_loads_the_folder(cli, uniform_dir, per_layer_dir):
    code, out, _ = cli("inspect", "--model", uniform_dir)
    assert code == 0 and "loads with   transformers AutoModelForCausalLM.from_pretrained" in out
    code, out, _ = cli("inspect", "--model", per_layer_dir)
    assert code == 0 and "loads with   laco_deploy.models.load_model" in out and "laco_layer_widths" in out
