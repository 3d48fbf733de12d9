"""The calibration budget of a compensation run, resolved in one place and logged.

An explicit `CompensateConfig.samples` always wins. Otherwise the budget follows the device:
on CUDA the paper's 2,048 unlabeled samples; on CPU a small budget (32 samples of at most 128
tokens) that finishes in minutes on the default model (SmolLM2-135M, 30 layers), said so in the
log and in the result's notes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from laco_deploy import devices
from laco_deploy.config import CompensateConfig, DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Budget:
    samples: int  # calibration samples (train + validation)
    seqlen: int  # tokens per sample
    epochs: int
    source: str  # "explicit" | "paper (CUDA)" | "small CPU budget"
    note: str  # one sentence for logs, CLI and result notes
    kl_samples: int = 0  # more samples, unseen by the walk, for the final KL pass (0: no pass)


def resolve_budget(comp: CompensateConfig, data: DataConfig, device: torch.device) -> Budget:
    """Samples, sequence length and epochs this run will use, and why."""
    if comp.samples is not None:
        b = Budget(comp.samples, data.seqlen, comp.epochs, "explicit",
                   f"calibration budget {comp.samples} x {data.seqlen} tokens, {comp.epochs} epochs (explicit)")
    elif devices.traits(device).accelerator:
        b = Budget(comp.gpu_samples, data.seqlen, comp.epochs, "paper (CUDA)",
                   f"calibration budget {comp.gpu_samples} x {data.seqlen} tokens, {comp.epochs} epochs "
                   "(the paper's 2,048 unlabeled samples, on CUDA)")
    else:
        seqlen = min(data.seqlen, comp.cpu_seqlen)
        b = Budget(comp.cpu_samples, seqlen, comp.epochs, "small CPU budget",
                   f"using a small CPU budget: {comp.cpu_samples} x {seqlen} tokens, {comp.epochs} epochs "
                   f"(the paper uses {comp.gpu_samples} samples on a GPU; set compensate.samples N to choose, "
                   "then data.seqlen applies as given)")
    kl = final_kl_samples(comp, b.samples)
    if kl:
        b = dataclasses.replace(b, kl_samples=kl, note=f"{b.note}; then a final KL pass on {kl} more samples")
    log.info("%s", b.note)
    return b


def final_kl_samples(comp: CompensateConfig, walk_samples: int) -> int:
    """Samples of the final KL pass (distill.py): fresh ones, never trained on by the walk, because
    the walk fits its own samples far closer than any other text (measured: KL to dense 0.15 on its
    training samples, 0.44 on held-out ones), so a pass over them has little left to learn."""
    if comp.method != "laco" or comp.final_kl_epochs == 0:
        return 0
    return comp.final_kl_samples if comp.final_kl_samples is not None else walk_samples
