"""The LoRA baseline: trains adapters on the whole model, merges them under the mask."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from laco_deploy.compensate import run
from laco_deploy.compensate.lora import attach_lora, lora_layers, merge_under_mask
from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig
from laco_deploy.models import load_model


def _w(d):
    return load_file(str(next(d.glob("*.safetensors"))))


def test_merge_under_mask_keeps_every_zero(sparse_unstructured_dir):
    model = load_model(str(sparse_unstructured_dir)).model
    model.requires_grad_(False)
    peft_model = attach_lora(model, CompensateConfig(), ("q_proj", "down_proj"), seed=0)
    with torch.no_grad():
        for mod in lora_layers(peft_model).values():  # B starts at zero: give the adapters a real delta
            mod.lora_B["default"].weight.normal_(0, 0.1)
    merged, stats = merge_under_mask(peft_model)
    q = merged.model.layers[0].self_attn.q_proj.weight
    ref = load_model(str(sparse_unstructured_dir)).model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q == 0, ref == 0)
    assert not torch.equal(q, ref)
    assert stats["lost_unmasked"] == stats["zeros"] > 0  # a dense delta fills every zero
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_lora_run_preserves_sparsity_and_records_loss(tiny_llama_dir, sparse_24_dir, tmp_path):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DataConfig(samples=16, seqlen=32),
              CompensateConfig(method="lora", samples=16, epochs=3, lora_lr=5e-3), sparse_24_dir, tmp_path / "lora")
    before, after = _w(sparse_24_dir), _w(tmp_path / "lora")
    assert before.keys() == after.keys()
    trained = [k for k in before if not torch.equal(before[k], after[k])]
    assert trained and all("proj" in k for k in trained)
    for k in before:
        assert torch.equal(before[k] == 0, after[k] == 0), k
    lo = res.settings["lora"]
    assert lo["lm_loss_after"] < lo["lm_loss_before"]
    assert lo["merge"]["share_of_zeros_lost_unmasked"] > 0.9
    assert res.sparsity == res.settings["sparsity_before"]
    ws = res.settings["memory"]["device_working_set_mib"]
    assert ws["saved_activations"] > 0 and ws["optimizer"] > 0
    cfg = json.loads((tmp_path / "lora" / "config.json").read_text())["laco_deploy"]
    assert cfg["method"] == "lora" and cfg["stage"] == "compensate" and cfg["pattern"] == "2:4"


def test_none_copies(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DataConfig(), CompensateConfig(method="none"),
              sparse_unstructured_dir, tmp_path / "copy")
    a, b = _w(sparse_unstructured_dir), _w(tmp_path / "copy")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert res.sparsity == 0.5
