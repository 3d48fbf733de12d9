"""The final KL pass: after the layer walk, the whole pruned model trains briefly so that its
next-token distribution matches the dense model's (KL(dense || pruned) over the vocabulary).

Why: the walk fits every layer's hidden states, but what a user sees is the next-token
distribution, and the residual of each layer still adds up along the depth. Measured on Wanda 50%
SmolLM2-135M after the default walk (benchmarks/RESULTS.md, "A final pass on the dense logits"):
one pass over fresh calibration samples closes 4-11 more points of the gap in-domain and out of domain.

The pass trains on samples the walk never trained on (budget.py says why), and keeps 1/8 of them to
measure it. No dense model is loaded whole for it: the teacher is the dense path's last hidden
states for those samples (`dense_teacher`, the dense twin streamed layer by layer as in the walk),
put through the pruned model's own final norm and LM head (pruning never changes those).

Its memory besides the optimizer is one layer's training state, not the model's (issue 33): the
model runs one layer at a time with each layer's input kept, the KL is made a few tokens at a time,
each layer is recomputed and backpropagated alone (klpass.py), and the masks are kept as bits. The
optimizer's state is AdamW's two moments per weight (compensate.final_kl_optimizer adamw, 0.85 GB on
the default model, 56 GB on a 7B one) or Adafactor's out + in numbers per [out, in] matrix
(adafactor), which bounds the whole pass by one layer. It runs streamed from disk too. If the
held-out KL does not go down, the walk's weights come back from its checkpoints.

Masks stay bit-exact as in the walk (0/1 factors and +0.0 after every update). In a torchrun job each
rank computes the rows of each global batch it holds and the gradients are summed before the update
(train.py explains the scheme), so all ranks apply the same update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from laco_deploy import devices, distributed, families, sizing
from laco_deploy.compensate.klpass import LayerStack, chunked_kl
from laco_deploy.compensate.optstate import LayerStates
from laco_deploy.compensate.streamed import RAM_SHARE
from laco_deploy.compensate.train import amp_dtype, autocast_ctx, cosine_lr, make_adamw
from laco_deploy.config import CompensateConfig
from laco_deploy.engine import EmbeddedOnDemand, Lane, LayerInputs, WalkOptions, walk_layers
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.memory import mapped_allocations
from laco_deploy.models import decoder_layers, linear_modules
from laco_deploy.progress import progress_bar

log = logging.getLogger(__name__)
HEAD_MODULES = ("model.norm", "lm_head")  # what a streamed model loads for the pass besides its layers
FIRST_STEP_MMAP = 2**20  # bytes: the first step's allocations this large are mapped (see _train)


class LastDense:
    """`on_layer_done` hook of the walk that keeps the dense path's output of the last layer (the
    model-level guard's teacher when there is no pass: guard.py)."""

    def __init__(self, num_layers: int):
        self.num_layers, self.hidden = num_layers, None

    def __call__(self, index: int, _record: dict, _sparse_out: ActivationCache, dense_out: ActivationCache | None) -> None:
        if index == self.num_layers - 1 and dense_out is not None:
            self.hidden = dense_out  # the walk never writes this one again


def dense_teacher(dense_model, dense_loader: Any, inputs: LayerInputs, device: torch.device, batch_size: int,
                  autocast: torch.dtype | None) -> ActivationCache:
    """The dense twin's last hidden states of the pass's samples ([n, seq, hidden]), its layers
    walked one at a time from `inputs` (the embeddings, which `inputs` no longer holds afterwards:
    the walk reuses its buffers). Computed as the walk computes its dense path (same dtype, batches)."""
    last: dict[str, ActivationCache] = {}

    def keep(index: int, _record: dict, out: ActivationCache, _dense: ActivationCache | None) -> None:
        if index == len(decoder_layers(dense_model)) - 1:
            last["hidden"] = out  # the walk swaps its buffers afterwards but never writes this one again

    walk_layers(Lane(dense_model, inputs, dense_loader), None, WalkOptions(device, batch_size, "dense teacher", autocast),
                on_layer_done=keep)
    return last["hidden"]


class MaskBits:
    """A 0/1 mask kept as bits (1/32 of the fp32 weight), unpacked for one update at a time."""

    def __init__(self, mask: torch.Tensor):
        self.shape, self.bits = mask.shape, np.packbits(mask.cpu().numpy().ravel())

    def factor(self, device: torch.device) -> torch.Tensor:
        keep = np.unpackbits(self.bits, count=math.prod(self.shape))
        return torch.from_numpy(keep).view(self.shape).to(device)


def _make_optimizer(kind: str, p: torch.nn.Parameter, device: torch.device) -> torch.optim.Optimizer:
    if kind == "adamw":
        return make_adamw([p], 0.0, 0.0, device)
    return torch.optim.Adafactor([p], lr=0.0)


class StepInBackward:
    """The optimizer applied to each weight as soon as its gradient is complete in the backward, and
    the gradient freed right after: the pass never holds more than one layer's gradients. Layers are
    attached while they are backpropagated; in between, their masks are kept by (layer, name) and their
    optimizer state by layer in optstate.LayerStates (in memory, or on disk with --offload disk), so a
    streamed layer read again from disk (new tensors) continues where it was.
    Before the step the gradient is summed over torchrun ranks and masked; after it +0.0 goes back
    under the mask (masks.MaskFactors' arithmetic)."""

    def __init__(self, kind: str, targets: tuple[str, ...], device: torch.device, states: LayerStates):
        self.kind, self.targets, self.device, self.lr = kind, targets, device, 0.0
        self.states = states
        self.masks: dict[tuple[int, str], MaskBits | None] = {}
        self.live: dict[int, tuple[str, torch.optim.Optimizer, MaskBits | None]] = {}
        self.hooks: list = []

    def params(self, index: int, layer: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        out = []
        for name, lin in linear_modules(layer, self.targets).items():
            out.append((f"{name}.weight", lin.weight))
            if lin.bias is not None:
                out.append((f"{name}.bias", lin.bias))
        return out

    def attach(self, index: int, layer: torch.nn.Module) -> None:
        params = self.params(index, layer)
        for name, p in params:
            key = (index, name)
            if key not in self.masks:  # first sight: the walk's weights, zero exactly where pruned
                keep = p.detach() != 0
                self.masks[key] = None if name.endswith(".bias") or bool(keep.all()) else MaskBits(keep)
        saved = self.states.get(index, self.device)
        for name, p in params:
            opt = _make_optimizer(self.kind, p, self.device)
            if name in saved:
                opt.state[p] = saved[name]
            p.requires_grad_(True)
            self.live[id(p)] = (name, opt, self.masks[(index, name)])
            self.hooks.append(p.register_post_accumulate_grad_hook(lambda q, i=index: self._step(q, i)))

    def detach(self, index: int, layer: torch.nn.Module) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        params = self.params(index, layer)
        states = {}
        for name, p in params:
            _, opt, _ = self.live.pop(id(p))
            if p in opt.state:
                states[name] = opt.state[p]
            p.requires_grad_(False)
            p.grad = None
        self.states.put(index, states)

    @torch.no_grad()
    def _step(self, p: torch.nn.Parameter, index: int) -> None:
        distributed.all_reduce_(p.grad)
        _, opt, bits = self.live[id(p)]
        keep = bits.factor(p.device) if bits is not None else None
        if keep is not None:
            p.grad.mul_(keep)
        opt.param_groups[0]["lr"] = self.lr
        opt.step()
        p.grad = None
        if keep is not None:
            p.mul_(keep).add_(0.0)

    def state_bytes(self) -> int:
        return self.states.nbytes()


def pass_batch(cfg: CompensateConfig) -> int:
    """Samples per step of the pass (compensate/steps.py sizes it by device; unset: the walk's)."""
    return cfg.final_kl_batch_size if cfg.final_kl_batch_size is not None else cfg.batch_size


def skip_reason(model, cfg: CompensateConfig, seqlen: int, device: torch.device, streamed: bool) -> str | None:
    """Why the pass cannot run here (None: it can): its state beyond the walk's does not fit."""
    w = sizing.weight_bytes(model)
    tokens = pass_batch(cfg) * seqlen
    free = devices.traits(device).free_bytes
    if free is not None:  # on the device: one layer and the head at a time, with the pass's terms
        need = sizing.final_kl_device_bytes(w, tokens, cfg.final_kl_optimizer)
    else:
        need, free = sum(sizing.final_kl_terms(w, tokens, cfg.final_kl_optimizer).values()), sizing.available_bytes()
    if free is not None and need > RAM_SHARE * free:  # the share the pruned model may take in RAM
        return (f"it needs about {need / 2**30:.1f} GiB more memory ({cfg.final_kl_optimizer} state and one layer's "
                f"training) and {max(free, 0) / 2**30:.1f} GiB is free")
    return None


class _Pass:
    """The pass's model, samples and teacher on this rank."""

    def __init__(self, stack: LayerStack, inputs: ActivationCache | EmbeddedOnDemand, teacher: ActivationCache,
                 cfg: CompensateConfig, shard: distributed.Shard):
        """inputs: this rank's samples' embeddings [local n, seq, hidden], rows matching `teacher`'s."""
        self.stack, self.inputs, self.teacher, self.cfg, self.shard = stack, inputs, teacher, cfg, shard
        self.softcap = families.logit_softcap(stack.model.config)
        self.amp = lambda: autocast_ctx(stack.device, cfg.precision)

    def _kl(self, rows: torch.Tensor, want_grad: bool):
        device = self.stack.device
        last, saved = self.stack.forward(self.inputs.rows(rows, device), keep=want_grad)
        kl, grad = chunked_kl(self.stack.model, last, self.teacher.rows(rows, device), self.softcap, self.amp, want_grad)
        return kl, saved, grad

    def train_step(self, chunk: torch.Tensor, stepper: StepInBackward) -> None:
        """One update on the global samples `chunk`: this rank's rows forward, backward layer by layer."""
        rows = self.shard.local(chunk)
        scale = len(rows) / len(chunk)
        if not len(rows):  # this rank holds none of the batch: a zero gradient still runs the hooks' collectives
            rows, scale = torch.zeros(1, dtype=torch.long), 0.0
        _, saved, grad = self._kl(rows, want_grad=True)
        self.stack.backward(saved, grad * scale, stepper.attach, stepper.detach)

    def evaluate(self, idx: torch.Tensor) -> float:
        """Mean token KL over the global samples `idx` (summed over ranks)."""
        rows = self.shard.local(idx)
        total = (sum(self._kl(chunk, want_grad=False)[0] * len(chunk) for chunk in rows.split(pass_batch(self.cfg)))
                 if len(rows) else 0.0)
        return distributed.all_reduce_floats([float(total)])[0] / max(1, len(idx))


def _train(work: _Pass, stepper: StepInBackward, train_idx: torch.Tensor, cfg: CompensateConfig, seed: int) -> int:
    """cfg.final_kl_epochs shuffled passes over `train_idx` on the cosine schedule -> steps taken."""
    gen = torch.Generator().manual_seed(seed)
    total = math.ceil(len(train_idx) / pass_batch(cfg)) * cfg.final_kl_epochs
    warmup, step = int(total * cfg.warmup_fraction), 0
    with progress_bar(range(total), desc="final KL pass", unit="step") as bar:
        for _epoch in range(cfg.final_kl_epochs):
            order = train_idx[torch.randperm(len(train_idx), generator=gen)]
            for chunk in order.split(pass_batch(cfg)):
                stepper.lr = cfg.kl_lr * cosine_lr(step, total, warmup)
                # the first step makes every layer's optimizer state and mask, each between that layer's
                # backward temporaries: mapped, those leave no heap holes that the state keeps resident
                # for the whole pass (+180 MiB on SmolLM2-135M); later steps make nothing that lasts
                with mapped_allocations(FIRST_STEP_MMAP) if step == 0 else contextlib.nullcontext():
                    work.train_step(chunk, stepper)
                step += 1
                bar.update(1)
    return step


def final_kl(model, inputs: ActivationCache | EmbeddedOnDemand, teacher: ActivationCache, cfg: CompensateConfig,
             targets: tuple[str, ...], split: tuple[torch.Tensor, torch.Tensor], *, device: torch.device,
             kwargs: list[dict[str, Any]], seed: int, shard: distributed.Shard,
             restore: Callable[[int, torch.nn.Module], Any], loader: Any = None,
             state_dir: Path | None = None) -> dict[str, Any]:
    """Train `model` (the walked pruned model, in place; its layers streamed by `loader` if set) on KL
    to the dense logits for cfg.final_kl_epochs passes over the samples split[0] (indices into the
    pass's samples, whose embeddings `inputs` and dense last hidden states `teacher` this rank holds);
    split[1] measures it. Unless the held-out KL goes down, `restore(i, layer)` puts the walk's
    layer i back. `kwargs`: each layer's call arguments on `device`. `state_dir`: where the optimizer
    state waits between a layer's steps (optstate.LayerStates; None: in memory)."""
    train_idx, val_idx = split
    watch = val_idx if len(val_idx) else train_idx
    if amp_dtype(device, cfg.precision) is torch.float16:  # no loss scaling with steps inside the backward
        cfg = dataclasses.replace(cfg, precision="fp32")
    if loader is not None:
        loader.load_rest(HEAD_MODULES)
    for name in HEAD_MODULES:
        model.get_submodule(name).to(device)
    stack = LayerStack(model, loader, kwargs, device, lambda: autocast_ctx(device, cfg.precision))
    work = _Pass(stack, inputs, teacher, cfg, shard)
    model.requires_grad_(False)
    model.eval()  # no dropout: the walk trains layers the same way
    t0 = time.perf_counter()
    before = work.evaluate(watch)
    stepper = StepInBackward(cfg.final_kl_optimizer, targets, device, LayerStates(state_dir))
    try:
        step = _train(work, stepper, train_idx, cfg, seed)
    finally:
        model.requires_grad_(False)
        state_bytes = stepper.state_bytes()
        stepper.states.close()
    trained = work.evaluate(watch)
    kept = trained < before
    if not kept:
        for i in range(len(stack)):
            restore(i, stack.open(i))
            stack.close(i, changed=True)
        log.warning("the final KL pass raised the held-out KL (%.4g -> %.4g): the walk's weights are kept",
                    before, trained)
    for name in HEAD_MODULES:
        model.get_submodule(name).to("cpu")
    if loader is not None:
        loader.release_rest(HEAD_MODULES)
    return {"kl_before": round(before, 6), "kl_after": round(trained if kept else before, 6),
            "kl_trained": round(trained, 6), "kept": kept, "epochs": cfg.final_kl_epochs, "steps": step,
            "lr": cfg.kl_lr, "optimizer": cfg.final_kl_optimizer,
            "optimizer_state_mib": round(state_bytes / 2**20, 1),
            "optimizer_state_on": "disk" if state_dir is not None else "memory",
            "measured_on": "validation" if len(val_idx) else "training",
            "trainable_params": sum(p.numel() for i, layer in enumerate(decoder_layers(model))
                                    for _, p in stepper.params(i, layer)),
            "train_s": round(time.perf_counter() - t0, 3)}
