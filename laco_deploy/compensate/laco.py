"""LaCo: layer-wise compensation on the shared layer engine.

For each decoder layer in order, walk_layers(paths=BOTH) hands us the pruned layer, its sparse
inputs (outputs of the already compensated layers 0..l-1) and the dense twin's outputs on the
dense inputs. The layer is trained to reproduce those outputs (train.LayerTrainer), then the
engine propagates its new outputs as the next layer's inputs and checkpoints it. Only the layer
and its dense twin are on the device; activations stay in CPU RAM or on disk. Then, unless
compensate.final_kl_epochs is 0, a short pass trains the whole model on the dense logits of fresh
samples the walk never saw, their dense teacher walked on the dense path alone (distill.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laco_deploy import devices, distributed, families, sizing
from laco_deploy.compensate import distill, lsq, steps
from laco_deploy.compensate.fakequant import fake_quantized
from laco_deploy.compensate.guard import ModelGuard
from laco_deploy.compensate.masks import layer_masks
from laco_deploy.compensate.train import LayerData, LayerTrainer, layer_forward, propagate_dtype, split_indices
from laco_deploy.config import CompensateConfig
from laco_deploy.engine import (
    EmbeddedOnDemand,
    Lane,
    LayerCheckpoints,
    LayerContext,
    LayerLoader,
    Paths,
    WalkOptions,
    capture_inputs,
    capture_layer_inputs,
    walk_layers,
)
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.fsutil import mark_folder
from laco_deploy.memory import Measurement, current_rss_bytes, measure
from laco_deploy.models import decoder_layers

log = logging.getLogger(__name__)


class SegmentMeter:
    """Peak memory over consecutive segments (setup, layer 0, layer 1, ...), measured with
    laco_deploy.memory.measure: the overall peak is the max over segments, and each segment's own
    peak says which part of the walk set it."""

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


def layer_lr(cfg: CompensateConfig, index: int, num_layers: int, layer: torch.nn.Module) -> float:
    """Learning rate of layer `index`: `lr` (unset: the layer's family's), decayed geometrically to
    lr * lr_last_factor at the last layer."""
    lr = cfg.lr if cfg.lr is not None else families.of_layer(layer).layer_lr
    if num_layers <= 1:
        return lr
    return lr * cfg.lr_last_factor ** (index / (num_layers - 1))


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
            trainer = LayerTrainer(ctx.layer, data, masks, cfg, layer_lr(cfg, ctx.index, ctx.num_layers, ctx.layer),
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
               guard: ModelGuard | None = None,
               importance: dict[str, torch.Tensor] | None = None) -> tuple[list[dict], dict | None]:
    """Run LaCo over all layers of `sparse_model` in place, then the final KL pass. input_ids [n, seq]:
    the walk trains on the first n - kl_samples, the pass on the last kl_samples (their dense teacher
    is walked after the walk, on the dense path only). Returns (per-layer records, the final pass's
    record or None). `layer_loader` / `dense_loader` stream the layers of a model kept on disk (engine.lazy).
    `guard`: compares the result with the pruned model on held-out samples at the end (guard.py);
    its record is `guard.record` (None where it could not run: a streamed model). `importance`: per decoder
    linear, the importance matrix compensate.quant_aware's quantizer is weighted by (fakequant.fake_quantized)."""
    for m in (dense_model, sparse_model):
        m.requires_grad_(False)
    cfg = _settled(cfg, sparse_model, input_ids, kl_samples, device)
    mark_folder(checkpoint_dir)  # marked as ours: a rerun may resume or clear it
    kl_samples = _final_pass_samples(sparse_model, cfg, input_ids.shape[1], device, layer_loader is not None, kl_samples)
    walk_samples = input_ids.shape[0] - kl_samples
    # torchrun: each rank embeds and walks its own shard of the walk's samples (and of the pass's)
    shard = distributed.shard(walk_samples)
    walk_ids = input_ids[shard.start:shard.stop]
    inputs = capture_inputs(sparse_model, layer_loader, walk_ids, device, cfg.offload, checkpoint_dir)
    if steps.fits_on_device(sizing.weight_bytes(sparse_model), cfg, len(inputs.hidden), input_ids.shape[1],
                            devices.traits(device), cfg.needs_dense_layer):
        inputs.hidden.place(device)  # the walk's caches are made like it: no batch crosses the bus
        log.info("activation caches on %s (%.0f MiB each)", device, inputs.hidden.data.nbytes / 2**20)
    split = split_indices(walk_samples, cfg.val_fraction, seed)
    scratch = distributed.rank_dir(checkpoint_dir / "snapshot") if cfg.offload == "disk" else None
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    step = make_step(cfg, targets, split, seed, meter, shard, scratch)
    kl_ids = input_ids[walk_samples:]
    held = _Held.of(walk_ids, shard, split, kl_ids, cfg, seed)
    guard = _guard_on(guard, layer_loader is not None, held)
    propagate = propagate_dtype(device, cfg.precision)
    # the guard's teacher without a pass: the walk's last dense outputs (with one: the pass's teacher)
    last_dense = distill.LastDense(len(decoder_layers(sparse_model))) if guard is not None and not kl_samples else None
    checkpoints = LayerCheckpoints(checkpoint_dir, fingerprint, resume)
    # --quant-aware: every layer computes with the weights as exported, while it trains and when its
    # outputs become the next layer's inputs (also when a resumed run re-propagates finished layers)
    # the guard too: QA-LaCo trades float error for quantized error, so both models are judged as exported
    with fake_quantized(decoder_layers(sparse_model), cfg.quant_aware, targets, importance):
        if guard is not None:
            guard.capture(sparse_model, held.ids, held.rows, device, cfg.batch_size)
        records = walk_layers(Lane(sparse_model, inputs, layer_loader), step,
                              WalkOptions(device, cfg.batch_size, "LaCo", propagate), paths=Paths.BOTH,
                              dense=Lane(dense_model, loader=dense_loader), checkpoints=checkpoints,
                              dense_in_step=cfg.needs_dense_layer, on_layer_done=last_dense)
        del inputs
        final, teacher = None, (last_dense.hidden if last_dense is not None else None)
        if kl_samples:
            final, teacher = _final_pass(dense_model, sparse_model, kl_ids, cfg, targets, device=device, seed=seed,
                                         meter=meter, checkpoints=checkpoints, layer_loader=layer_loader,
                                         dense_loader=dense_loader, propagate=propagate, workdir=checkpoint_dir)
        if guard is not None and teacher is not None:
            guard.check(sparse_model, held.ids, held.rows, len(held.idx), teacher, device, cfg.batch_size)
    return records, final


def _settled(cfg: CompensateConfig, sparse_model, input_ids: torch.Tensor, kl_samples: int,
             device: torch.device) -> CompensateConfig:
    """For a caller other than the stage: the family's learning rate when unset, and steps by device, as
    the stage sizes them (an unset loss is the family's, taken by LayerTrainer)."""
    if cfg.lr is None:
        cfg = dataclasses.replace(cfg, lr=families.layer_lr(sparse_model.config))
    if cfg.batch_size is None:
        n_train = input_ids.shape[0] - kl_samples
        cfg = steps.plan(cfg, input_ids.shape[1], n_train - int(n_train * cfg.val_fraction),
                         sizing.weight_bytes(sparse_model), devices.traits(device), cfg.needs_dense_layer).apply(cfg)
    return cfg


def _final_pass_samples(sparse_model, cfg: CompensateConfig, seqlen: int, device: torch.device, streamed: bool,
                        kl_samples: int) -> int:
    """The final KL pass's samples, 0 where it is skipped (rank 0 decides: every rank must run the
    same collectives)."""
    skip = distill.skip_reason(sparse_model, cfg, seqlen, device, streamed) if kl_samples else None
    if not distributed.agree(skip is None):
        skip = skip or "rank 0 skips it"
    if skip is None:
        return kl_samples
    log.warning("the final KL pass on the dense logits is skipped: %s (set compensate.final_kl_epochs 0 "
                "to silence this)", skip)
    return 0


def _guard_on(guard: ModelGuard | None, streamed: bool, held: _Held) -> ModelGuard | None:
    """The guard, or None (said why) where it cannot run."""
    if guard is not None and (streamed or not len(held.idx)):
        log.info("the model-level guard against the pruned model is off: %s",
                 "the model is streamed from disk" if streamed else "no held-out samples")
        return None
    return guard


@dataclass(frozen=True)
class _Held:
    """The samples nothing trains on, which the guard scores: the final pass's held-out share (its
    teacher holds them), else the walk's. idx: global indices; ids: this rank's samples of that set
    [local n, seq]; rows: the local rows of idx in ids."""

    idx: torch.Tensor
    ids: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of(cls, walk_ids: torch.Tensor, shard: distributed.Shard, split, kl_ids: torch.Tensor,
           cfg: CompensateConfig, seed: int) -> _Held:
        if not len(kl_ids):
            return cls(split[1], walk_ids, shard.local(split[1]))
        kl_shard = distributed.shard(len(kl_ids))
        idx = split_indices(len(kl_ids), cfg.val_fraction, seed)[1]
        return cls(idx, kl_ids[kl_shard.start:kl_shard.stop], kl_shard.local(idx))


def _final_pass(dense_model, sparse_model, kl_ids: torch.Tensor, cfg: CompensateConfig, targets: tuple[str, ...], *,
                device: torch.device, seed: int, meter: SegmentMeter, checkpoints: LayerCheckpoints, layer_loader,
                dense_loader, propagate: torch.dtype | None, workdir: Path) -> tuple[dict, ActivationCache]:
    """The dense teacher of the pass's samples kl_ids [n, seq] (the dense twin walked alone), then the
    pass (distill.py), measured as a segment of its own. Each rank holds its shard of those samples.
    Returns (the pass's record, the teacher)."""
    shard = distributed.shard(kl_ids.shape[0])
    mine = kl_ids[shard.start:shard.stop]
    meter.next()  # its own segment, so the report says what the pass itself peaked at
    with measure(device) as m:
        teacher = distill.dense_teacher(dense_model, dense_loader,
                                        capture_inputs(sparse_model, layer_loader, mine, device, cfg.offload, workdir),
                                        device, cfg.batch_size, propagate)
        if layer_loader is not None:  # streamed: its embedding matrix is read once, so the rows are held
            inputs = capture_inputs(sparse_model, layer_loader, mine, device, cfg.offload, workdir)
            hidden = inputs.hidden
        else:  # resident: each batch is embedded when asked for, no cache of every sample's
            inputs = capture_layer_inputs(sparse_model, kl_ids[:1], device)  # call arguments, alike for all
            hidden = EmbeddedOnDemand(sparse_model, mine)
        fresh = split_indices(kl_ids.shape[0], cfg.val_fraction, seed)
        final = distill.final_kl(sparse_model, hidden, teacher, cfg, targets, fresh, device=device,
                                 kwargs=inputs.kwargs_per_layer(len(decoder_layers(sparse_model)), device), seed=seed,
                                 shard=shard, restore=checkpoints.reload, loader=layer_loader,
                                 state_dir=workdir / "final-kl-state" if cfg.offload == "disk" else None)
    final.update({"peak_mib": round(m.peak_bytes / 2**20, 1), "peak_delta_mib": round(m.peak_delta_bytes / 2**20, 1),
                  "memory_kind": m.kind})
    log.info("final KL pass: held-out KL to the dense logits %.4g -> %.4g (%d steps, %.0f s, +%.0f MiB)",
             final["kl_before"], final["kl_after"], final["steps"], final["train_s"], final["peak_delta_mib"])
    return final, teacher
