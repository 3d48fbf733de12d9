"""Corrections (channel scales, low-rank under the mask): merged weights equal the hooked layer,
the zero pattern survives the merge, and LaCo trains them end to end."""

from __future__ import annotations

import pytest
import torch
from test_laco import DATA, _assert_same_pattern

from laco_deploy.compensate import run
from laco_deploy.compensate.corrections import Corrections
from laco_deploy.config import CompensateConfig, ModelConfig


def _sparse_block(bias: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.proj = torch.nn.Linear(12, 8, bias=bias)
    with torch.no_grad():
        block.proj.weight.mul_(torch.rand(8, 12) > 0.5)
    return block, {"proj": block.proj.weight != 0}


@pytest.mark.parametrize("kind,bias", [("channel", True), ("lowrank", False), ("lowrank", True)])
def test_merge_equals_hooked_forward_and_keeps_zeros(kind, bias):
    block, masks = _sparse_block(bias)
    corr = Corrections(block, masks, kind, rank=3, seed=0)
    with torch.no_grad():  # a correction that does something: random factors
        for p in corr.params:
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 12)
    hooked = block.proj(x)
    assert not torch.allclose(hooked, torch.nn.functional.linear(x, block.proj.weight, block.proj.bias))
    corr.merge()
    merged = block.proj(x)  # hooks are gone: plain linear with the folded weights
    torch.testing.assert_close(merged, hooked, rtol=1e-5, atol=1e-5)
    w = block.proj.weight
    assert not ((w != 0) & ~masks["proj"]).any(), "a pruned weight became non-zero"
    assert not torch.signbit(w[~masks["proj"]]).any()


def test_lowrank_starts_as_identity():
    block, masks = _sparse_block(True)
    x = torch.randn(4, 12)
    before = block.proj(x)
    corr = Corrections(block, masks, "lowrank", rank=2, seed=0)
    torch.testing.assert_close(block.proj(x), before)
    corr.remove()


@pytest.mark.parametrize("kind", ["channel", "lowrank"])
def test_laco_trains_corrections_under_the_mask(tiny_llama_dir, sparse_unstructured_dir, tmp_path, kind):
    cfg = CompensateConfig(samples=16, epochs=3, batch_size=4, lr=3e-3, trainable=kind, correction_rank=4)
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, cfg, sparse_unstructured_dir, tmp_path / "out")
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")
    assert all(r["nmse_after"] < r["nmse_before"] for r in res.per_layer)
    weights_cfg = CompensateConfig(samples=16, epochs=3, batch_size=4, lr=3e-3)
    full = run(ModelConfig(model=str(tiny_llama_dir)), DATA, weights_cfg, sparse_unstructured_dir, tmp_path / "w")
    ws = res.per_layer[0]["device_working_set"]
    assert ws["optimizer"] < full.per_layer[0]["device_working_set"]["optimizer"] / 4


def test_unknown_trainable_is_reported():
    errs = CompensateConfig(trainable="everything", correction_rank=0).validate()
    assert any("compensate.trainable" in e for e in errs) and any("compensate.correction_rank" in e for e in errs)
