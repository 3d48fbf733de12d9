"""The final KL pass: after the layer walk, the whole pruned model trains briefly so that its
next-token distribution matches the dense model's (KL(dense || pruned) over the vocabulary).

Why: the walk fits every layer's hidden states, but what a user sees is the next-token
distribution, and the residual of each layer still adds up along the depth. Measured on Wanda 50%
SmolLM2-135M after the default walk (benchmarks/RESULTS.md, "A final pass on the dense logits"):
one pass over the calibration samples closes 4-6 more points of the gap in-domain and out of
domain, more than doubling the walk's samples does for the same time.

The pass trains on samples the walk carried through the layers but never trained on (budget.py
says why), and keeps 1/8 of them to measure it. No dense model is loaded for it: the teacher is the
dense path's last hidden states, which the walk computes anyway (the last layer's dense output is
kept), put through the pruned model's own final norm and LM head (pruning never changes those).
What it costs is AdamW's two moments for every pruned linear (8 bytes per weight,
memplan.final_kl_terms): each weight steps as soon as its gradient is complete in the backward and
the gradient is freed. If the held-out KL does not go down, the walk's weights come back from its
layer checkpoints. The pass is skipped, with a message naming the setting, when the model is
streamed from disk or that state would not fit in free memory.

Masks stay bit-exact as in the walk (0/1 factors and +0.0 after every update, as masks.MaskFactors
does). In a torchrun job each rank computes the rows of each global batch it holds and the gradients
are summed before the update (train.py explains the scheme), so all ranks apply the same update.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

import torch

from laco_deploy import devices, distributed, families, memplan
from laco_deploy.compensate.streamed import RAM_SHARE
from laco_deploy.compensate.masks import layer_masks
from laco_deploy.compensate.train import amp_dtype, autocast_ctx, cosine_lr, make_adamw
from laco_deploy.config import CompensateConfig
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.models import decoder_layers
from laco_deploy.progress import progress_bar

log = logging.getLogger(__name__)


class LastDense:
    """`on_layer_done` hook of the walk that keeps the dense path's output of the last layer."""

    def __init__(self, num_layers: int):
        self.num_layers, self.hidden = num_layers, None

    def __call__(self, index: int, _record: dict, _sparse_out: ActivationCache, dense_out: ActivationCache | None) -> None:
        if index == self.num_layers - 1 and dense_out is not None:
            self.hidden = dense_out  # the walk swaps its buffers afterwards but never writes this one again


def _trainable(model, targets: tuple[str, ...]) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
    """(parameter, 0/1 mask factor or None) of every pruned linear's weight and bias, all layers.
    The factors are uint8 (a byte per weight instead of float32's four, ~6% slower to apply,
    measured; the stage's peak RSS stayed at 3.3 GB, so it is set elsewhere) and None where nothing
    is masked (biases; structured widths)."""
    out = []
    for layer in decoder_layers(model):
        masks = layer_masks(layer, targets)
        for name, mask in masks.items():
            lin = layer.get_submodule(name)
            out.append((lin.weight, None if bool(mask.all()) else mask.to(torch.uint8)))
            if lin.bias is not None:
                out.append((lin.bias, None))
    return out


class StepInBackward:
    """AdamW applied to each weight as soon as its gradient is complete in the backward, and the
    gradient freed right after: the pass never holds the whole model's gradients. Before the step
    the gradient is summed over torchrun ranks and masked; after it +0.0 goes back under the mask
    (masks.MaskFactors' arithmetic)."""

    def __init__(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor | None]], device: torch.device):
        self.keep = {id(p): k for p, k in pairs}
        self.opts = {id(p): make_adamw([p], 0.0, 0.0, device) for p, _ in pairs}
        self.hooks = [p.register_post_accumulate_grad_hook(self._step) for p, _ in pairs]
        self.lr = 0.0

    @torch.no_grad()
    def _step(self, p: torch.nn.Parameter) -> None:
        distributed.all_reduce_(p.grad)
        keep = self.keep[id(p)]
        if keep is not None:
            p.grad.mul_(keep)
        opt = self.opts[id(p)]
        opt.param_groups[0]["lr"] = self.lr
        opt.step()
        p.grad = None
        if keep is not None:
            p.mul_(keep).add_(0.0)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.opts.clear()


def pass_batch(cfg: CompensateConfig) -> int:
    """Samples per step of the pass (compensate/steps.py sizes it by device; unset: the walk's)."""
    return cfg.final_kl_batch_size if cfg.final_kl_batch_size is not None else cfg.batch_size


def skip_reason(model, cfg: CompensateConfig, seqlen: int, device: torch.device,
                streamed: bool) -> str | None:
    """Why the pass cannot run here (None: it can)."""
    if streamed:
        return ("the pruned model is streamed from disk (compensate.offload disk, or too large for RAM) and the pass "
                "trains it whole")
    need = sum(memplan.final_kl_terms(memplan.weight_bytes(model), pass_batch(cfg) * seqlen).values())
    free = devices.traits(device).free_bytes
    if free is not None:  # the model moves to the device for the pass
        free -= sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        free = memplan.available_bytes()
    if free is not None and need > RAM_SHARE * free:  # the share the pruned model may take in RAM
        return (f"it needs about {need / 2**30:.1f} GiB more memory (AdamW state of every layer) and "
                f"{max(free, 0) / 2**30:.1f} GiB is free")
    return None


def logits_from_hidden(model, hidden: torch.Tensor, softcap: float | None, *, norm: bool = True) -> torch.Tensor:
    """Last hidden states [b, seq, hidden] (before the final norm, or after it with norm=False) ->
    logits [b, seq, vocab] through the model's own final norm, LM head and soft-capping."""
    logits = model.lm_head(model.model.norm(hidden) if norm else hidden)
    return torch.tanh(logits / softcap) * softcap if softcap is not None else logits


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student). [b, seq, vocab] x2 -> scalar."""
    s = torch.log_softmax(student.float(), dim=-1).flatten(0, 1)
    t = torch.log_softmax(teacher.float(), dim=-1).flatten(0, 1)
    return torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")


class _Pass:
    def __init__(self, model, input_ids: torch.Tensor, teacher: ActivationCache, cfg: CompensateConfig,
                 device: torch.device, shard: distributed.Shard):
        """input_ids: this rank's samples [local n, seq], rows matching `teacher`'s."""
        self.model, self.ids, self.teacher, self.cfg, self.device, self.shard = model, input_ids, teacher, cfg, device, shard
        self.softcap = families.logit_softcap(model.config)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's cache rows of the global samples `idx`."""
        return self.shard.local(idx)

    def loss(self, rows: torch.Tensor) -> torch.Tensor:
        """Mean token KL of this rank's cache rows `rows` (a non-empty tensor of local indices)."""
        ids = devices.send(self.ids[rows], self.device)
        with torch.no_grad(), autocast_ctx(self.device, self.cfg.precision):
            teacher = logits_from_hidden(self.model, self.teacher.rows(rows, self.device), self.softcap)
        with autocast_ctx(self.device, self.cfg.precision):
            student = self.model(input_ids=ids, use_cache=False).logits
        return kl_to_teacher(student, teacher)

    @torch.no_grad()
    def evaluate(self, idx: torch.Tensor) -> float:
        """Mean token KL over the global samples `idx` (summed over ranks)."""
        rows = self.rows(idx)
        # summed on the device, read once
        total = float(sum(self.loss(chunk).double() * len(chunk) for chunk in rows.split(pass_batch(self.cfg)))) if len(rows) else 0.0
        return distributed.all_reduce_floats([total])[0] / max(1, len(idx))


def final_kl(model, input_ids: torch.Tensor, teacher: ActivationCache, cfg: CompensateConfig,
             targets: tuple[str, ...], split: tuple[torch.Tensor, torch.Tensor], *, device: torch.device,
             seed: int, shard: distributed.Shard, restore: Callable[[], Any]) -> dict[str, Any]:
    """Train `model` (the walked pruned model, in place) on KL to the dense logits for
    cfg.final_kl_epochs passes over the global samples split[0]; split[1] measures it. Unless the
    held-out KL goes down, `restore()` puts the walk's weights back (from its layer checkpoints)."""
    train_idx, val_idx = split
    watch = val_idx if len(val_idx) else train_idx
    if amp_dtype(device, cfg.precision) is torch.float16:  # no loss scaling with steps inside the backward
        cfg = dataclasses.replace(cfg, precision="fp32")
    work = _Pass(model, input_ids, teacher, cfg, device, shard)
    model.to(device)
    pairs = _trainable(model, targets)
    params = [p for p, _ in pairs]
    model.requires_grad_(False)
    model.eval()  # no dropout: the walk trains layers the same way
    t0 = time.perf_counter()
    before = work.evaluate(watch)
    for p in params:
        p.requires_grad_(True)
    stepper = StepInBackward(pairs, device)
    gen = torch.Generator().manual_seed(seed)
    total = math.ceil(len(train_idx) / pass_batch(cfg)) * cfg.final_kl_epochs
    warmup, step = int(total * cfg.warmup_fraction), 0
    bar = progress_bar(range(total), desc="final KL pass", unit="step")
    try:
        for _epoch in range(cfg.final_kl_epochs):
            order = train_idx[torch.randperm(len(train_idx), generator=gen)]
            for chunk in order.split(pass_batch(cfg)):
                stepper.lr = cfg.final_kl_lr * cosine_lr(step, total, warmup)
                rows = work.rows(chunk)
                if len(rows):
                    loss = work.loss(rows) * (len(rows) / len(chunk))
                else:  # this rank holds none of the batch: a zero loss still runs the hooks' collectives
                    loss = work.loss(torch.zeros(1, dtype=torch.long)) * 0.0
                loss.backward()
                step += 1
                bar.update(1)
    finally:
        stepper.close()
        bar.close()
        model.requires_grad_(False)
    trained = work.evaluate(watch)
    kept = trained < before
    if not kept:
        restore()
        log.warning("the final KL pass raised the held-out KL (%.4g -> %.4g): the walk's weights are kept",
                    before, trained)
    model.to("cpu")
    return {"kl_before": round(before, 6), "kl_after": round(trained if kept else before, 6),
            "kl_trained": round(trained, 6), "kept": kept, "epochs": cfg.final_kl_epochs, "steps": step,
            "lr": cfg.final_kl_lr, "measured_on": "validation" if len(val_idx) else "training",
            "trainable_params": sum(p.numel() for p in params), "train_s": round(time.perf_counter() - t0, 3)}
