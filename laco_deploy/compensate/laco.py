"""LaCo: layer-wise compensation on the shared layer engine.

For each decoder layer in order, walk_layers(paths=BOTH) hands us the pruned layer, its sparse
inputs (outputs of the already compensated layers 0..l-1) and the dense twin's outputs on the
dense inputs. The layer is trained to reproduce those outputs (train.LayerTrainer), then the
engine propagates its new outputs as the next layer's inputs and checkpoints it. Only the layer
and its dense twin are on the device; activations stay in CPU RAM or on disk. Then, unless
compensate.final_kl_epochs is 0, a short pass trains the whole model on the dense logits of samples
the walk carried through the layers but never trained on (distill.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from laco_deploy import devices, distributed, memplan
from laco_deploy.compensate import distill, lsq, steps
from laco_deploy.compensate.fakequant import fake_quantized
from laco_deploy.compensate.guard import ModelGuard
from laco_deploy.compensate.masks import layer_masks
from laco_deploy.compensate.train import LayerData, LayerTrainer, amp_dtype, layer_forward, split_indices
from laco_deploy.config import CompensateConfig
from laco_deploy.engine import (
    Lane,
    LayerCheckpoints,
    LayerContext,
    LayerLoader,
    Paths,
    WalkOptions,
    capture_inputs,
    walk_layers,
)
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.fsutil import mark_folder
from laco_deploy.memory import Measurement, current_rss_bytes, measure
from laco_deploy.models import decoder_layers

log = logging.getLogger(__name__)


class SegmentMeter:
    """Peak memory over consecutive segments (setup, layer 0, layer 1, ...), measured with
    laco_deploy.memory.measure. measure() resets the peak counter on entry, so nested use would
    lose the earlier peak; chaining segments keeps the overall peak = max over segments."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = torch.cuda.memory_allocated(device) if device.type == "cuda" else current_rss_bytes()
        self.done: list[Measurement] = []
        self._stack: contextlib.ExitStack | None = None
        self._current: Measurement | None = None

    def next(self) -> None:
        """Close the running segment (if any) and start a new one."""
        self.close()
        self._stack = contextlib.ExitStack()
        self._current = self._stack.enter_context(measure(self.device))

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self.done.append(self._current)
            self._stack = self._current = None

    @property
    def peak_bytes(self) -> int:
        return max((m.peak_bytes for m in self.done), default=0)

    @property
    def peak_delta_bytes(self) -> int:
        """Peak above the footprint when the meter was created."""
        return max(0, self.peak_bytes - self.base)


@torch.no_grad()
def dense_mid_cache(ctx: LayerContext) -> ActivationCache:
    """The dense twin's residual stream after attention, for every sample. [n, seq, hidden]."""
    cache = ctx.dense_inputs.clone_empty()
    for start in range(0, len(cache), ctx.batch_size):
        stop = min(start + ctx.batch_size, len(cache))
        _, mid = layer_forward(ctx.dense_layer, ctx.dense_inputs.batch(start, stop, ctx.device), ctx.kwargs, True)
        cache.store(start, mid)
    return cache


def layer_lr(cfg: CompensateConfig, index: int, num_layers: int) -> float:
    """Learning rate of layer `index`: `lr`, decayed geometrically to lr * lr_last_factor at the last layer."""
    if num_layers <= 1:
        return cfg.lr
    return cfg.lr * cfg.lr_last_factor ** (index / (num_layers - 1))


def _refit(ctx: LayerContext, trainer: LayerTrainer, masks, cfg: CompensateConfig, split) -> tuple[float, bool]:
    """Closed-form start (compensate/lsq.py) on the training samples; returns the layer's held-out
    nmse before it (so the record shows what the refit and the training each contributed) and
    whether the refit was kept."""
    watch = split[1] if len(split[1]) else split[0]
    before = trainer.evaluate(watch)
    start = {k: v.detach().clone() for k, v in ctx.layer.state_dict().items()}
    ctx.progress("least-squares refit")
    lsq.refit_layer(ctx, masks, split[0], cfg.lsq_damp, cfg.lsq_token_weight, trainer.data.shard)
    if trainer.evaluate(watch)["loss"] > before["loss"]:  # never start from worse than the pruned layer
        ctx.layer.load_state_dict(start)
        log.debug("layer %d: least-squares refit raised the held-out loss; kept the pruned weights", ctx.index)
        return before["nmse"], False
    return before["nmse"], True


def needs_dense_layer(cfg: CompensateConfig) -> bool:
    """Whether the step runs the dense twin itself (the sub-block loss, the least-squares refit);
    otherwise it only reads the twin's outputs and a streamed twin leaves memory before training."""
    return cfg.loss == "subblock" or cfg.init == "lsq"


def make_step(cfg: CompensateConfig, targets: tuple[str, ...], split: tuple[torch.Tensor, torch.Tensor],
              seed: int, meter: SegmentMeter, shard: distributed.Shard | None = None, scratch: Path | None = None):
    """The per-layer step for walk_layers: fit the layer, return its record. `split` holds global
    sample indices; `shard` says which of them this rank's caches hold (torchrun). `scratch`: a
    folder for the trainer's best-state snapshot (offload disk), else it stays in RAM."""

    def step(ctx: LayerContext) -> dict[str, Any]:
        meter.next()
        t0 = time.perf_counter()
        with measure(ctx.device) as m:
            masks = layer_masks(ctx.layer, targets)
            mid = dense_mid_cache(ctx) if cfg.loss == "subblock" else None
            data = LayerData(ctx.inputs, ctx.dense_targets, mid, ctx.kwargs, split[0], split[1],
                             ctx.dense_inputs if cfg.dense_input_mix > 0 else None, shard)
            dense = list(ctx.dense_layer.parameters()) if ctx.dense_layer is not None else []
            resident = list(ctx.layer.parameters()) + dense
            trainer = LayerTrainer(ctx.layer, data, masks, cfg, layer_lr(cfg, ctx.index, ctx.num_layers),
                                   ctx.device, seed + ctx.index, resident,
                                   scratch / "best_state.safetensors" if scratch is not None else None)
            refit = _refit(ctx, trainer, masks, cfg, split) if cfg.init == "lsq" else None
            record = trainer.fit(ctx.progress)
            if refit is not None:
                record["nmse_pruned"], record["refit_kept"] = refit
            del mid, data
        after = layer_masks(ctx.layer, targets)
        assert all(torch.equal(masks[k], after[k]) for k in masks), "mask changed during training"
        record.update({"layer": ctx.index, "time_s": round(time.perf_counter() - t0, 3),
                       "peak_mib": round(m.peak_bytes / 2**20, 1),
                       "peak_delta_mib": round(m.peak_delta_bytes / 2**20, 1), "memory_kind": m.kind})
        log.debug("layer %d: %s %.4g -> %.4g", ctx.index, cfg.loss, record["loss_before"], record["loss_after"])
        return record

    return step


def compensate(dense_model, sparse_model, input_ids: torch.Tensor, cfg: CompensateConfig, targets: tuple[str, ...], *,
               device: torch.device, seed: int, checkpoint_dir, fingerprint: dict, resume: bool,
               meter: SegmentMeter, layer_loader: LayerLoader | None = None,
               dense_loader: LayerLoader | None = None, kl_samples: int = 0,
               guard: ModelGuard | None = None) -> tuple[list[dict], dict | None]:
    """Run LaCo over all layers of `sparse_model` in place, then the final KL pass. input_ids [n, seq]:
    the walk trains on the first n - kl_samples, the pass on the last kl_samples (the walk only carries
    them through the layers). Returns (per-layer records, the final pass's record or None).
    `layer_loader` / `dense_loader` stream the layers of a model kept on disk (engine.lazy).
    `guard`: compares the result with the pruned model on held-out samples at the end (guard.py);
    its record is `guard.record` (None where it could not run: a streamed model)."""
    for m in (dense_model, sparse_model):
        m.requires_grad_(False)
    if cfg.batch_size is None:  # a caller other than the stage: steps by device, as the stage sizes them
        n_train = input_ids.shape[0] - kl_samples
        cfg = steps.plan(cfg, input_ids.shape[1], n_train - int(n_train * cfg.val_fraction),
                         memplan.weight_bytes(sparse_model), devices.traits(device), needs_dense_layer(cfg)).apply(cfg)
    mark_folder(checkpoint_dir)  # marked as ours: a rerun may resume or clear it
    skip = (distill.skip_reason(sparse_model, cfg, input_ids.shape[1], device, layer_loader is not None)
            if kl_samples else None)
    if not distributed.agree(skip is None):  # rank 0 decides: every rank must run the same collectives
        skip = skip or "rank 0 skips it"
    if skip is not None:
        log.warning("the final KL pass on the dense logits is skipped: %s (set compensate.final_kl_epochs 0 "
                    "to silence this)", skip)
        input_ids, kl_samples = input_ids[: input_ids.shape[0] - kl_samples], 0
    walk_samples = input_ids.shape[0] - kl_samples
    # torchrun: each rank embeds and walks its own shard; the splits are over all samples
    shard = distributed.shard(input_ids.shape[0])
    inputs = capture_inputs(sparse_model, layer_loader, input_ids[shard.start:shard.stop], device, cfg.offload,
                            checkpoint_dir)
    if steps.fits_on_device(memplan.weight_bytes(sparse_model), cfg, len(inputs.hidden), input_ids.shape[1],
                            devices.traits(device), needs_dense_layer(cfg)):
        inputs.hidden.place(device)  # the walk's caches are made like it: no batch crosses the bus
        log.info("activation caches on %s (%.0f MiB each)", device, inputs.hidden.data.nbytes / 2**20)
    split = split_indices(walk_samples, cfg.val_fraction, seed)
    scratch = distributed.rank_dir(checkpoint_dir / "snapshot") if cfg.offload == "disk" else None
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    step = make_step(cfg, targets, split, seed, meter, shard, scratch)
    local_ids = input_ids[shard.start:shard.stop]
    held = _held_out(split, walk_samples, kl_samples, cfg, seed)
    if guard is not None and (layer_loader is not None or not len(held)):
        log.info("the model-level guard against the pruned model is off: %s",
                 "the model is streamed from disk" if layer_loader is not None else "no held-out samples")
        guard = None
    if guard is not None:
        guard.capture(sparse_model, local_ids, shard.local(held), device, cfg.batch_size)
    # propagation (dense targets, next layer's inputs) in bf16 where training is: fp16's range can
    # overflow on the outlier activations of large models, so an fp16 run propagates in fp32
    propagate = torch.bfloat16 if amp_dtype(device, cfg.precision) is torch.bfloat16 else None
    last_dense = distill.LastDense(len(decoder_layers(sparse_model)))
    checkpoints = LayerCheckpoints(checkpoint_dir, fingerprint, resume)
    # --quant-aware: every layer computes with the weights as exported, while it trains and when its
    # outputs become the next layer's inputs (also when a resumed run re-propagates finished layers)
    with fake_quantized(decoder_layers(sparse_model), cfg.quant_aware, targets):
        records = walk_layers(Lane(sparse_model, inputs, layer_loader), step,
                              WalkOptions(device, cfg.batch_size, "LaCo", propagate), paths=Paths.BOTH,
                              dense=Lane(dense_model, loader=dense_loader), checkpoints=checkpoints,
                              dense_in_step=needs_dense_layer(cfg), on_layer_done=last_dense)
        del inputs
        final = _final_pass(sparse_model, local_ids, last_dense, cfg, targets, walk_samples, kl_samples, device, seed,
                            shard, meter, checkpoints) if kl_samples else None
    if guard is not None and last_dense.hidden is not None:
        guard.check(sparse_model, local_ids, shard.local(held), len(held), last_dense.hidden, device, cfg.batch_size)
    return records, final


def _held_out(split, walk_samples: int, kl_samples: int, cfg: CompensateConfig, seed: int) -> torch.Tensor:
    """Global indices of the samples nothing trains on: the final pass's held-out share, else the walk's."""
    if kl_samples:
        return walk_samples + split_indices(kl_samples, cfg.val_fraction, seed)[1]
    return split[1]


def _final_pass(model, local_ids, last_dense, cfg, targets, walk_samples, kl_samples, device, seed, shard, meter,
                checkpoints) -> dict:
    fresh = tuple(walk_samples + idx for idx in split_indices(kl_samples, cfg.val_fraction, seed))
    meter.next()  # its own segment: measure() below resets the peak counter
    with measure(device) as m:
        final = distill.final_kl(
            model, local_ids, last_dense.hidden, cfg, targets, fresh, device=device, seed=seed, shard=shard,
            restore=lambda: [checkpoints.reload(i, layer) for i, layer in enumerate(decoder_layers(model))])
    final.update({"peak_mib": round(m.peak_bytes / 2**20, 1), "peak_delta_mib": round(m.peak_delta_bytes / 2**20, 1),
                  "memory_kind": m.kind})
    log.info("final KL pass: held-out KL to the dense logits %.4g -> %.4g (%d steps, %.0f s, +%.0f MiB)",
             final["kl_before"], final["kl_after"], final["steps"], final["train_s"], final["peak_delta_mib"])
    return final
