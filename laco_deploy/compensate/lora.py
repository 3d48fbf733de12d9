"""The LoRA baseline LaCo has to beat: PEFT LoRA on every pruned linear of the whole model.

The whole model sits on the device and backpropagates the language-modelling loss through all
layers, which is what makes it memory-hungry next to LaCo. After training the adapters are
merged back under each matrix's own mask (zeros stay zeros); the record states how many zeros
an ordinary unmasked merge would have filled in.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from laco_deploy import devices, families, flops, sizing
from laco_deploy.compensate.masks import masked_merge
from laco_deploy.compensate.steps import plan as plan_steps
from laco_deploy.compensate.train import amp_dtype, autocast_ctx, cosine_lr, make_adamw, split_indices
from laco_deploy.compensate.workingset import count_saved, working_set
from laco_deploy.config import CompensateConfig

log = logging.getLogger(__name__)
ADAPTER = "default"


def attach_lora(model, cfg: CompensateConfig, targets: tuple[str, ...], seed: int):
    """Wrap `model` with LoRA adapters on the `targets` linears; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    family = families.of_config(model.config) or families.TABLE[0]
    modules = sorted(set(targets) | set(family.module_names(targets)))  # fused linears (Phi-3) by their parts
    lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=modules)
    return get_peft_model(model, lcfg)


def lora_layers(peft_model) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merge_under_mask(peft_model) -> tuple[Any, dict[str, int]]:
    """Merge each adapter into its base weight under the weight's mask; unload the adapters.

    Returns (plain model, {"zeros": zeros before merge, "lost_unmasked": zeros an unmasked
    merge would have turned non-zero, "elements": elements of the merged matrices}).
    """
    stats = {"zeros": 0, "lost_unmasked": 0, "elements": 0}
    for _name, mod in lora_layers(peft_model).items():
        base = mod.get_base_layer()
        delta = mod.get_delta_weight(ADAPTER)  # [out, in]
        merged, lost = masked_merge(base.weight.data, delta)
        stats["zeros"] += int((base.weight == 0).sum())
        stats["lost_unmasked"] += lost
        stats["elements"] += base.weight.numel()
        base.weight.data.copy_(merged)
    return peft_model.unload(), stats


def _lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a batch. ids [b, seq]."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@torch.no_grad()
def _evaluate(model, ids: torch.Tensor, batch_size: int, device: torch.device, precision: str) -> float:
    total = torch.zeros((), dtype=torch.float64, device=device)  # summed on the device, read once
    for chunk in ids.split(batch_size):
        with autocast_ctx(device, precision):
            total += _lm_loss(model, devices.send(chunk, device)).double() * len(chunk)
    return float(total) / max(1, len(ids))


class _Steps:
    """AdamW + cosine schedule over the adapters; the first step also measures the working set."""

    def __init__(self, peft_model, params, resident, cfg: CompensateConfig, device: torch.device, n_train: int):
        self.model, self.params, self.resident, self.cfg, self.device = peft_model, params, resident, cfg, device
        self.opt = make_adamw(params, cfg.lora_lr, cfg.weight_decay, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype(device, cfg.precision) is torch.float16)
        self.total = max(1, math.ceil(math.ceil(n_train / cfg.batch_size) / cfg.grad_accum)) * cfg.epochs
        self.warmup, self.step, self.working_set = int(self.total * cfg.warmup_fraction), 0, None
        self.sample_flops, self.samples_seen = 0.0, 0  # training FLOPs per sample, counted on the first step

    def _backward(self, ids: torch.Tensor) -> None:
        """Loss and backward of one micro-batch; the first also measures the working set and FLOPs."""
        if self.working_set is not None:
            with autocast_ctx(self.device, self.cfg.precision):
                loss = _lm_loss(self.model, ids)
            self.scaler.scale(loss / self.cfg.grad_accum).backward()
            return
        def first() -> int:
            with count_saved(self.resident) as meter, autocast_ctx(self.device, self.cfg.precision):
                loss = _lm_loss(self.model, ids)
            self.scaler.scale(loss / self.cfg.grad_accum).backward()
            return meter.bytes

        saved, counted = flops.counted(first, self.params)
        self.sample_flops = counted / len(ids) if counted is not None else None
        self.working_set = working_set(self.resident, self.params, saved, [ids])

    def epoch(self, input_ids: torch.Tensor, order: torch.Tensor) -> None:
        chunks = list(order.split(self.cfg.batch_size))
        for k, chunk in enumerate(chunks):
            self._backward(devices.send(input_ids[chunk], self.device))
            self.samples_seen += len(chunk)
            if (k + 1) % self.cfg.grad_accum == 0 or k == len(chunks) - 1:
                for group in self.opt.param_groups:
                    group["lr"] = self.cfg.lora_lr * cosine_lr(self.step, self.total, self.warmup)
                self.scaler.step(self.opt)
                self.scaler.update()
                self.opt.zero_grad(set_to_none=True)
                self.step += 1


def train_lora(peft_model, input_ids: torch.Tensor, cfg: CompensateConfig, device: torch.device,
               seed: int) -> dict[str, Any]:
    """Train the adapters, early stopping on held-out samples; keep the best adapters (start included)."""
    train_idx, val_idx = split_indices(input_ids.shape[0], cfg.val_fraction, seed)
    watch = input_ids[val_idx] if len(val_idx) else input_ids[train_idx]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    peft_model.to(device)
    peft_model.train()
    steps = _Steps(peft_model, params, list(peft_model.parameters()), cfg, device, len(train_idx))
    before = _evaluate(peft_model, watch, cfg.batch_size, device, cfg.precision)
    best, best_state, best_epoch, bad, history = before, [p.detach().cpu().clone() for p in params], 0, 0, []
    gen = torch.Generator().manual_seed(seed)
    t0, step_s = time.perf_counter(), 0.0
    for epoch in range(1, cfg.epochs + 1):
        t_steps = time.perf_counter()
        steps.epoch(input_ids, train_idx[torch.randperm(len(train_idx), generator=gen)])
        devices.synchronize(device)  # once an epoch: the steps' own time, for the throughput
        step_s += time.perf_counter() - t_steps
        val = _evaluate(peft_model, watch, cfg.batch_size, device, cfg.precision)
        history.append(round(val, 5))
        if val < best:
            best, best_state, best_epoch, bad = val, [p.detach().cpu().clone() for p in params], epoch, 0
        else:
            bad += 1
            if len(val_idx) and bad >= cfg.patience:
                break
    with torch.no_grad():
        for p, s in zip(params, best_state):
            p.copy_(s.to(p.device))
    peft_model.eval()
    return {"lm_loss_before": round(before, 5), "lm_loss_after": round(best, 5), "epochs_run": len(history),
            "best_epoch": best_epoch, "steps": steps.step, "val_history": history, "lr": cfg.lora_lr,
            "measured_on": "validation" if len(val_idx) else "training",
            "trainable_params": sum(p.numel() for p in params), "train_s": round(time.perf_counter() - t0, 3),
            "step_s": round(step_s, 3),
            "train_gflop": (round(steps.sample_flops * steps.samples_seen / 1e9, 3) if steps.sample_flops is not None
                            else "not counted"),
            "device_working_set": steps.working_set or {}}


def compensate(model, input_ids: torch.Tensor, cfg: CompensateConfig, targets: tuple[str, ...], *,
               device: torch.device, seed: int) -> tuple[Any, dict[str, Any]]:
    """LoRA-train `model` (sparse, on CPU) and merge under the mask. Returns (model on CPU, record)."""
    model.requires_grad_(False)
    if cfg.batch_size is None:  # a caller other than the stage: steps by device, as the stage sizes them
        n = input_ids.shape[0] - int(input_ids.shape[0] * cfg.val_fraction)
        cfg = plan_steps(cfg, input_ids.shape[1], n, sizing.weight_bytes(model), devices.traits(device)).apply(cfg)
    peft_model = attach_lora(model, cfg, targets, seed)
    record = train_lora(peft_model, input_ids, cfg, device, seed)
    merged, stats = merge_under_mask(peft_model)
    merged.to("cpu")
    merged.requires_grad_(False)
    zeros = max(1, stats["zeros"])
    record["merge"] = {**stats, "share_of_zeros_lost_unmasked": round(stats["lost_unmasked"] / zeros, 6),
                       "unmasked_merge_sparsity": round((stats["zeros"] - stats["lost_unmasked"]) / max(1, stats["elements"]), 6)}
    return merged, record
