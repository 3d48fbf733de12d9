"""Train one pruned decoder layer to reproduce its dense twin's output (the LaCo step's math loop).

Inputs are the sparse-path hidden states of the layer, targets the dense path's; both stay in
their ActivationCache (CPU or disk) and only one batch at a time goes to the device. The
surviving weights (or a lighter correction merged afterwards, see corrections.py) are trained
with AdamW under a cosine schedule; after every update the masked positions are set back to
+0.0, so the sparsity pattern never changes. Early stopping watches a held-out slice of the
samples and the best state (the untouched layer included) is kept, so a layer never leaves worse
than it came on held-out data.

In a torchrun job each rank holds a contiguous shard of the samples (`LayerData.shard`); batches
are drawn from the global sample order as in one process, every rank computes the part of each
batch it holds, weighted by its share of the batch, and the gradients are summed over ranks
before each update, so all ranks apply the same update. The losses are means over tokens, and
cos_mse's scale is the whole batch's (from per-sample sums added over ranks), so this equals the
one-process gradient up to the order of the float sums.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from laco_deploy import devices, distributed, families, flops
from laco_deploy.compensate import losses
from laco_deploy.compensate.corrections import Corrections
from laco_deploy.compensate.masks import MaskFactors
from laco_deploy.compensate.workingset import count_saved, working_set
from laco_deploy.config import CompensateConfig
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.lazy import read_tensors
from laco_deploy.fsutil import atomic_path


@dataclass
class LayerData:
    """One layer's training data: caches are [samples, seq, hidden] on CPU or disk."""

    inputs: ActivationCache  # sparse-path inputs
    targets: ActivationCache  # dense layer outputs on dense inputs
    mid_targets: ActivationCache | None  # dense residual stream after attention (subblock loss)
    kwargs: dict[str, Any]  # layer call arguments, on the device
    train_idx: torch.Tensor  # [n_train] sample indices
    val_idx: torch.Tensor  # [n_val], may be empty
    dense_inputs: ActivationCache | None = None  # dense-path inputs (for dense_input_mix)
    shard: distributed.Shard | None = None  # the global samples this rank's caches hold (None: all)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded train/validation split of n samples; validation gets floor(n * fraction), >=1 if >0."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = min(n - 1, max(1, int(n * val_fraction))) if val_fraction > 0 and n > 1 else 0
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def resolve_precision(precision: str, device: torch.device) -> str:
    """compensate.precision made concrete: fp32, bf16 or fp16 (see config.CompensateConfig). auto:
    bf16 where it is native; on a GPU without it fp16 (with loss scaling), on a CPU fp32."""
    if precision != "auto":
        return precision
    t = devices.traits(device)
    if t.bf16:
        return "bf16"
    return "fp16" if t.accelerator else "fp32"


def amp_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of training and of LaCo's layer calls (None: plain fp32)."""
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[resolve_precision(precision, device)]


def propagate_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """LaCo's propagation dtype (dense targets, next layer's inputs): bf16 where training is; fp16's
    range can overflow on the outlier activations of large models, so an fp16 run propagates in fp32."""
    return torch.bfloat16 if amp_dtype(device, precision) is torch.bfloat16 else None


def autocast_ctx(device: torch.device, precision: str):
    dtype = amp_dtype(device, precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def layer_forward(layer, hidden: torch.Tensor, kwargs: dict, want_mid: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a decoder layer; optionally return the residual stream after attention too.

    hidden [b, s, h] -> (out [b, s, h], mid [b, s, h] or None). `mid` is the input of the
    post-attention norm, caught by a pre-hook (same module layout in Llama, Mistral, Qwen2).
    """
    caught: list[torch.Tensor] = []
    handle = None
    if want_mid:
        handle = layer.post_attention_layernorm.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
    try:
        out = layer(hidden, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    out = out[0] if isinstance(out, tuple) else out
    return out, (caught[0] if caught else None)


def trainable_parameters(layer, masks: dict[str, torch.Tensor], train_norms: bool,
                         train_weights: bool = True) -> list[torch.nn.Parameter]:
    """Surviving weights (unless a correction is trained instead) and biases of the pruned
    linears, plus norm scales if asked."""
    params = []
    for name in masks:
        lin = layer.get_submodule(name)
        if train_weights:
            params.append(lin.weight)
        if lin.bias is not None:
            params.append(lin.bias)
    if train_norms:
        params.extend(layer.get_submodule(n).weight for n in families.of_layer(layer).norms)
    return params


def make_adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused where PyTorch has the kernel (CPU, CUDA): on CPU the per-tensor default spent
    ~15 ms of a ~50 ms LaCo step at batch 2 (measured), half of it in sqrt over moments that are
    zero under the mask; the fused kernel takes about half that."""
    fused = device.type in ("cpu", "cuda") and all(p.dtype in (torch.float32, torch.bfloat16) for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def cosine_lr(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class LayerTrainer:
    """Fits one layer in place. `fit()` returns the per-layer record (errors, steps, working set)."""

    def __init__(self, layer, data: LayerData, masks: dict[str, torch.Tensor], cfg: CompensateConfig,
                 lr: float, device: torch.device, seed: int, resident: list[torch.Tensor],
                 snapshot_file: Path | None = None):
        """snapshot_file: keep the best state in this file instead of in RAM (offload disk: one
        layer less in memory while the optimizer state is; written and read back bit for bit)."""
        self.layer, self.data, self.masks, self.cfg = layer, data, masks, cfg
        self.snapshot_file = snapshot_file
        self.lr, self.device, self.seed, self.resident = lr, device, seed, resident
        self.subblock = cfg.loss == "subblock"
        # unset (a caller that skips the stage's resolution, e.g. make_step directly): the family's
        self.loss_fn = losses.get_loss(cfg.loss or families.of_layer(layer).layer_loss)
        self.corrections = (Corrections(layer, masks, cfg.trainable, cfg.correction_rank, seed)
                            if cfg.trainable != "weights" else None)
        self.params = trainable_parameters(layer, masks, cfg.train_norms, train_weights=self.corrections is None)
        if self.corrections is not None:
            self.params = self.corrections.params + self.params
            self.resident = resident + self.corrections.params
        self.mask_factors = MaskFactors(layer, masks)
        self.working_set: dict[str, int] | None = None
        # training FLOPs per sample (forward + backward), counted on the first step; None: not counted
        self.sample_flops: float | None = 0.0
        self.samples_seen = 0
        self.step_s = 0.0  # seconds in training steps, over every try
        self.anchor: list[torch.Tensor] | None = None  # starting weights, for cfg.anchor_decay
        self.energy = self._target_energy()  # [samples] fp64, cos_mse only

    def _local(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cache rows of the global samples `idx` held by this rank, and which of `idx` they are
        (None: all of them, as in a single process)."""
        shard = self.data.shard
        if shard is None or shard.whole:
            return idx, None
        return shard.local(idx), shard.owned(idx)

    def _target_energy(self) -> torch.Tensor | None:
        """cos_mse: every global sample's sum of squared targets (losses.sample_energy), summed over
        ranks, so a batch's scale is its whole mean square even where a rank holds part of it."""
        if self.cfg.loss != "cos_mse":
            return None
        shard, targets = self.data.shard, self.data.targets.data  # [local samples, seq, hidden]
        start, total = (shard.start, shard.total) if shard is not None else (0, len(targets))
        energy = torch.zeros(total, dtype=torch.float64)
        for i in range(0, len(targets), self.cfg.batch_size):
            part = targets[i:i + self.cfg.batch_size]
            energy[start + i:start + i + len(part)] = losses.sample_energy(part)
        return distributed.all_reduce_(energy)

    def _scale(self, idx: torch.Tensor) -> float | None:
        """cos_mse's scale for the global samples `idx` (None for the other losses)."""
        if self.energy is None:
            return None
        return losses.mean_square(self.energy[idx], math.prod(self.data.targets.shape[1:]))

    def _batch(self, idx: torch.Tensor, mix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inputs, targets (and mid targets) of the cache rows `idx`; rows where `mix` is True take
        the dense-path input instead of the sparse one (both map to the same dense target)."""
        d, dev = self.data, self.device
        x = d.inputs.rows(idx, dev)
        if mix is not None and bool(mix.any()):  # mix is drawn on the host: no device sync
            x = torch.where(devices.send(mix, dev)[:, None, None], d.dense_inputs.rows(idx, dev), x)
        t = d.targets.rows(idx, dev)
        m = d.mid_targets.rows(idx, dev) if self.subblock else None
        return x, t, m

    def _objective(self, out, mid, t, m, scale: float | None) -> torch.Tensor:
        if self.subblock:
            return losses.subblock_loss(mid, m, out, t)
        if scale is not None:
            return losses.cos_mse(out, t, scale)
        return self.loss_fn(out, t)

    def _loss(self, x, t, m, scale: float | None = None) -> torch.Tensor:
        with autocast_ctx(self.device, self.cfg.precision):
            out, mid = layer_forward(self.layer, x, self.data.kwargs, self.subblock)
        return self._objective(out, mid, t, m, scale)

    @torch.no_grad()
    def evaluate(self, idx: torch.Tensor) -> dict[str, float]:
        """Mean training loss, nmse and mse of the layer output over the global samples `idx`
        (each rank scores those it holds; the sums are added over ranks)."""
        sums = {"loss": 0.0, "nmse": 0.0, "mse": 0.0}
        rows, _ = self._local(idx)
        parts: list[torch.Tensor] = []
        scale = self._scale(idx)  # cos_mse: one scale for all of idx, however it is split into chunks
        for chunk in rows.split(self.cfg.batch_size) if len(rows) else ():  # split() of nothing gives one empty chunk
            x, t, m = self._batch(chunk)
            with autocast_ctx(self.device, self.cfg.precision):
                out, mid = layer_forward(self.layer, x, self.data.kwargs, self.subblock)
            loss = self._objective(out, mid, t, m, scale)
            w = len(chunk)
            parts.append(torch.stack([loss, losses.nmse(out, t), losses.mse(out, t)]).double() * w)
        if parts:  # one read from the device per evaluation, not three per batch
            sums = dict(zip(sums, torch.stack(parts).sum(0).tolist()))
        if distributed.world() > 1:
            sums = dict(zip(sums, distributed.all_reduce_floats(list(sums.values()))))
        return {k: v / max(1, len(idx)) for k, v in sums.items()}

    def _snapshot(self) -> list[torch.Tensor] | Path:
        if self.snapshot_file is None:
            return [p.detach().to("cpu", copy=True) for p in self.params]
        with atomic_path(self.snapshot_file) as tmp:
            save_file({str(i): p.detach().contiguous().cpu() for i, p in enumerate(self.params)}, str(tmp))
        return self.snapshot_file

    @torch.no_grad()
    def _restore(self, snap: list[torch.Tensor] | Path) -> None:
        if isinstance(snap, Path):
            saved = read_tensors(snap)
            snap = [saved[str(i)] for i in range(len(self.params))]
        for p, s in zip(self.params, snap):
            p.copy_(s.to(p.device))

    def _backward(self, chunk: torch.Tensor, mix: torch.Tensor | None, scaler) -> None:
        """Loss and backward of the part of the micro-batch `chunk` (global sample indices) this
        rank holds; the first one also measures the device working set and counts the step's
        FLOPs (for the throughput report)."""
        rows, owned = self._local(chunk)
        if len(rows) == 0:
            return  # this rank holds none of the batch; it sends zero gradients
        scale = self._scale(chunk)  # cos_mse: the whole batch's, not this rank's part's
        share = 1.0
        if owned is not None:  # the loss is a mean over this rank's rows: weigh it by their share
            mix = mix[owned] if mix is not None else None
            share = len(rows) / len(chunk)
        batch = self._batch(rows, mix)
        if self.working_set is not None:
            scaler.scale(self._loss(*batch, scale) * share / self.cfg.grad_accum).backward()
            return
        def first() -> int:
            with count_saved(self.resident) as meter:
                loss = self._loss(*batch, scale)
            scaler.scale(loss * share / self.cfg.grad_accum).backward()
            return meter.bytes

        saved, counted = flops.counted(first, self.params)
        self.sample_flops = counted / len(rows) if counted is not None else None
        self.working_set = working_set(self.resident, self.params, saved, [b for b in batch if b is not None])

    @torch.no_grad()
    def _pull_to_anchor(self, lr: float) -> None:
        """Decoupled decay of the update towards the pruned starting weights: w -= lr * decay * (w - w0).
        Unlike weight decay (which pulls towards zero) it limits how far the layer drifts from
        what pruning left, a regularizer against fitting the calibration domain too closely."""
        pull = min(1.0, lr * self.cfg.anchor_decay)  # > 1 would overshoot past the anchor
        for p, w0 in zip(self.params, self.anchor):
            p.sub_(p - w0, alpha=pull)

    def _epoch(self, order: torch.Tensor, opt, scaler, step: int, total: int, warmup: int,
               gen: torch.Generator, base_lr: float | None = None) -> int:
        """One pass over the training samples in `order` at peak rate `base_lr` (default self.lr);
        returns the updated step count."""
        cfg = self.cfg
        chunks = list(order.split(cfg.batch_size))
        mixes = [torch.rand(len(c), generator=gen) < cfg.dense_input_mix if cfg.dense_input_mix > 0 else None
                 for c in chunks]
        for k, chunk in enumerate(chunks):
            self._backward(chunk, mixes[k], scaler)
            self.samples_seen += len(chunk)
            if (k + 1) % cfg.grad_accum == 0 or k == len(chunks) - 1:
                lr = (self.lr if base_lr is None else base_lr) * cosine_lr(step, total, warmup)
                for group in opt.param_groups:
                    group["lr"] = lr
                distributed.all_reduce_grads(self.params)
                self.mask_factors.zero_grads()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if self.anchor is not None:
                    self._pull_to_anchor(lr)
                self.mask_factors.apply()
                step += 1
        return step

    def fit(self, progress: Callable[[str], None] = lambda _s: None) -> dict[str, Any]:
        """Train with early stopping on the held-out samples; keep the best state (start included).
        A first epoch that ends no better than the start means the step is too large for this layer
        (Gemma 3's small linears: every layer rose at 3e-3): it restarts from its starting weights at
        lr * lr_backoff, up to lr_retries times; the last try keeps whatever is best."""
        cfg, d = self.cfg, self.data
        torch.manual_seed(self.seed)
        gen = torch.Generator().manual_seed(self.seed)
        watch = d.val_idx if len(d.val_idx) else d.train_idx
        before = self.evaluate(watch)
        start, t0, tried = self._snapshot(), time.perf_counter(), []
        for attempt in range(cfg.lr_retries + 1):
            tried.append(self.lr * cfg.lr_backoff ** attempt)
            run = self._attempt(tried[-1], watch, before, start, gen, progress, last=attempt == cfg.lr_retries)
            if run.best_epoch > 0:
                break
        self._restore(run.best_state)
        self.layer.requires_grad_(False)
        after = run.best_eval  # the kept state was evaluated when it was chosen
        if self.corrections is not None:
            self.corrections.merge()  # the layer is plain again; `after` measures the merged weights
            after = self.evaluate(watch)
        train_s = time.perf_counter() - t0
        return {
            "loss_before": before["loss"], "loss_after": after["loss"],
            "nmse_before": before["nmse"], "nmse_after": after["nmse"],
            "mse_before": before["mse"], "mse_after": after["mse"],
            "measured_on": "validation" if len(d.val_idx) else "training",
            "epochs_run": len(run.history), "best_epoch": run.best_epoch, "steps": run.steps, "lr": tried[-1],
            "lr_tried": [float(f"{x:.6g}") for x in tried], "val_history": run.history, "train_s": round(train_s, 3),
            "step_s": round(self.step_s, 3),
            "train_gflop": (round(self.sample_flops * self.samples_seen / 1e9, 3) if self.sample_flops is not None
                            else "not counted"),
            "device_working_set": self.working_set or {},
        }

    def _attempt(self, lr: float, watch: torch.Tensor, before: dict[str, float], start, gen: torch.Generator,
                 progress: Callable[[str], None], last: bool) -> _Run:
        """Up to cfg.epochs epochs at `lr` from the starting weights `start` (a snapshot); stops after
        the first epoch when it is no better than `before` and another try follows (not `last`)."""
        cfg, d = self.cfg, self.data
        self._restore(start)
        run = _Run(best_state=start, best_eval=before)
        self.anchor = [p.detach().clone() for p in self.params] if cfg.anchor_decay > 0 else None
        self.layer.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        opt = make_adamw(self.params, lr, cfg.weight_decay, self.device)
        scaler = torch.amp.GradScaler(self.device.type, enabled=amp_dtype(self.device, cfg.precision) is torch.float16)
        total = max(1, math.ceil(math.ceil(len(d.train_idx) / cfg.batch_size) / cfg.grad_accum)) * cfg.epochs
        bad = 0
        for epoch in range(1, cfg.epochs + 1):
            order = d.train_idx[torch.randperm(len(d.train_idx), generator=gen)]
            t_steps = time.perf_counter()
            run.steps = self._epoch(order, opt, scaler, run.steps, total, int(total * cfg.warmup_fraction), gen, lr)
            devices.synchronize(self.device)  # once an epoch: the steps' own time, for the throughput
            self.step_s += time.perf_counter() - t_steps
            current = self.evaluate(watch)
            val = current["loss"]
            run.history.append(round(val, 6))
            progress(f"lr {lr:.2g} epoch {epoch} val {val:.4g} (start {before['loss']:.4g})")
            if val < run.best_eval["loss"]:
                run.best_state, run.best_epoch, bad, run.best_eval = self._snapshot(), epoch, 0, current
            elif not run.best_epoch and not last:
                break  # the step is too large here: the next try starts over at a smaller one
            else:
                bad += 1
                if len(d.val_idx) and bad >= cfg.patience:
                    break
        self.anchor = None
        return run


@dataclass
class _Run:
    """One try of LayerTrainer.fit at one learning rate: the best state seen (the start until an
    epoch beats it), its epoch (0: the start) and evaluation, the held-out loss after each epoch."""

    best_state: Any
    best_eval: dict[str, float]
    best_epoch: int = 0
    steps: int = 0
    history: list[float] = field(default_factory=list)
