"""LaCo's learning rate on a model that keeps its scale in its norms (issue 31).

Gemma 3 270M's linears have an RMS of ~0.04 (SmolLM2's ~0.19) and its (1 + w) norms scales of 13-30:
at the default lr every layer tried got worse in its first epoch, training loss included, so the walk
kept the pruned weights. A tiny Gemma 3 rescaled the same way (pre-norms x S, every linear / S; the
q/k norms and the post-norms take the scale back out) computes the same function and shows it.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tiny
from laco_deploy.compensate.laco import SegmentMeter, make_step
from laco_deploy.compensate.train import split_indices
from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig, PruneConfig
from laco_deploy.families import Family
from laco_deploy.engine import Lane, Paths, WalkOptions, capture_inputs, walk_layers
from laco_deploy.models import decoder_layers, linear_modules
from laco_deploy.prune.step import MatrixRule, prune_layer

CPU = torch.device("cpu")
LARGE_LR = Family.layer_lr  # SmolLM2's rate (3e-3): too large for a model scaled like Gemma 3 (whose family's is 3e-4)
PRE_NORMS = ("input_layernorm", "pre_feedforward_layernorm")


def _gemma3(scale: float):
    """A 2-layer tiny Gemma 3 whose pre-norms carry `scale` and whose linears carry 1 / scale."""
    model = tiny.build_model(tiny.gemma3_config(layers=2), seed=7, norms=0.1)
    with torch.no_grad():
        for layer in decoder_layers(model):
            for name in PRE_NORMS:
                w = layer.get_submodule(name).weight  # Gemma's norm multiplies by (1 + w)
                w.copy_((1 + w) * scale - 1)
            for lin in linear_modules(layer, PRUNABLE_LINEARS).values():
                lin.weight.div_(scale)
    return model


def _walk(scale: float, **cfg) -> list[dict]:
    """Magnitude 50% (the same masks at any scale), then the LaCo walk at the default settings."""
    dense = _gemma3(scale).requires_grad_(False)
    ids = torch.randint(1, 200, (16, 32), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0  # BOS, as the samples start
    sparse = copy.deepcopy(dense)
    walk_layers(Lane(sparse, capture_inputs(sparse, None, ids, CPU)),
                lambda ctx: prune_layer(ctx, MatrixRule.of(PruneConfig(method="magnitude")), 0.5), WalkOptions(CPU, 8, "prune"))
    comp = dataclasses.replace(CompensateConfig(), batch_size=2, final_kl_epochs=0, **cfg)
    step = make_step(comp, PRUNABLE_LINEARS, split_indices(16, comp.val_fraction, 0), 0, SegmentMeter(CPU))
    return walk_layers(Lane(sparse, capture_inputs(sparse, None, ids, CPU)), step, WalkOptions(CPU, 2, "LaCo"),
                       paths=Paths.BOTH, dense=Lane(dense), dense_in_step=False)


def test_rescaled_model_computes_the_same_function():
    """Up to the post-norms' eps (their inputs are 10x smaller): within 1% of the largest logit."""
    ids = torch.randint(1, 200, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base, scaled = _gemma3(1.0)(ids).logits, _gemma3(10.0)(ids).logits
    assert (base - scaled).abs().max() < 0.01 * base.abs().max()


def test_layers_with_small_linears_still_improve():
    """At SmolLM2's lr every layer of the rescaled model rises in its first epoch; it starts over at
    lr * lr_backoff and ends below its starting held-out loss instead of keeping the pruned weights."""
    for r in _walk(10.0, lr=LARGE_LR):
        assert r["lr_tried"][0] == LARGE_LR and len(r["lr_tried"]) > 1, r
        assert r["best_epoch"] > 0 and r["loss_after"] < 0.97 * r["loss_before"], r


def test_without_retries_the_pruned_weights_stay():
    """What the walk did before (and what lr_retries 0 still does): no epoch beats the start."""
    for r in _walk(10.0, lr=LARGE_LR, lr_retries=0):
        assert r["best_epoch"] == 0 and r["loss_after"] == r["loss_before"] and r["lr_tried"] == [r["lr"]], r


@pytest.mark.parametrize("retries", [0, 2])
def test_a_layer_that_improves_at_lr_trains_as_before(retries):
    """Unscaled, every layer improves in its first epoch at the family's lr (Gemma 3: 3e-4, taken when
    none is set): no retry, the same result either way."""
    records = _walk(1.0, lr_retries=retries)
    assert [r["lr_tried"] for r in records] == [[3e-4]] * len(records)
    assert all(r["loss_after"] < r["loss_before"] for r in records)
    if retries:
        assert [r["loss_after"] for r in records] == [r["loss_after"] for r in _walk(1.0, lr_retries=0)]
