"""The LaCo step never waits on the device: batches come from device-resident caches (or pinned host
memory), and nothing is read back per step. On CUDA, torch's sync debug mode turns any host sync
inside the training epoch into an error; on CPU the same epoch runs, so the test itself is checked."""

from __future__ import annotations

import contextlib

import pytest
import torch

import tiny
from laco_deploy.compensate.masks import layer_masks
from laco_deploy.compensate.train import LayerData, LayerTrainer, make_adamw
from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import capture_layer_inputs, kwargs_on


def _trainer(device: torch.device, cache_on_device: bool) -> LayerTrainer:
    torch.manual_seed(0)
    model = tiny.build_model(tiny.llama_config(), seed=3)
    inputs = capture_layer_inputs(model, torch.randint(0, 512, (24, 32)), device)
    layer = model.model.layers[0].to(device)
    with torch.no_grad():  # half the weights pruned, the dense outputs as targets
        targets = ActivationCache(inputs.hidden.shape)
        kwargs = kwargs_on(inputs.kwargs, device)
        for i in range(0, 24, 8):
            out = layer(inputs.hidden.batch(i, i + 8, device), **kwargs)
            targets.store(i, out[0] if isinstance(out, tuple) else out)
        for name in PRUNABLE_LINEARS:
            w = layer.get_submodule(("self_attn." if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp.")
                                    + name).weight
            w.mul_(torch.rand_like(w) > 0.5)
    if cache_on_device:
        inputs.hidden.place(device)
        targets.place(device)
    data = LayerData(inputs.hidden, targets, None, kwargs, torch.arange(20), torch.arange(20, 24))
    cfg = CompensateConfig(loss="nmse", batch_size=4, epochs=1, precision="bf16" if device.type == "cuda" else "fp32")
    trainer = LayerTrainer(layer, data, layer_masks(layer, PRUNABLE_LINEARS), cfg, 1e-3, device, 0,
                           list(layer.parameters()))
    layer.requires_grad_(False)
    for p in trainer.params:
        p.requires_grad_(True)
    return trainer


def _two_epochs(device: torch.device, cache_on_device: bool, strict) -> LayerTrainer:
    """The first epoch counts FLOPs and the working set (allowed to sync); the second must not."""
    trainer = _trainer(device, cache_on_device)
    opt = make_adamw(trainer.params, 1e-3, 0.0, device)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    gen = torch.Generator().manual_seed(0)
    order = trainer.data.train_idx
    step = trainer._epoch(order, opt, scaler, 0, 10, 1, gen)
    with strict():
        step = trainer._epoch(order.flip(0), opt, scaler, step, 10, 1, gen)
    assert step == 10 and trainer.sample_flops
    return trainer


@pytest.mark.parametrize("cache_on_device", [True, False])
def test_epoch_runs_on_cpu(cache_on_device):
    trainer = _two_epochs(torch.device("cpu"), cache_on_device, contextlib.nullcontext)
    after = layer_masks(trainer.layer, PRUNABLE_LINEARS)
    assert all(torch.equal(trainer.mask_factors.pairs[i][1].bool(), after[k]) for i, k in enumerate(after))


@contextlib.contextmanager
def _no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_on_device", [True, False])
def test_epoch_never_syncs_on_cuda(cache_on_device):
    _two_epochs(torch.device("cuda"), cache_on_device, _no_sync)
