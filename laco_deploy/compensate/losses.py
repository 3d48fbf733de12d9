"""Reconstruction losses for LaCo: pure tensor functions of predicted and target hidden states.

All take `pred`, `target` of shape [batch, seq, hidden] and return a scalar, computed in fp32.

Why more than plain MSE: the residual stream of LLMs carries a few massive outlier channels
(hundreds of times the typical magnitude, on a few tokens), so the squared error is dominated by
them. The next layer sees the stream only through RMSNorm, i.e. per token scaled by 1/rms, so
what matters downstream is each token's error relative to its own norm.

- `mse`:     mean((p - t)^2)
- `nmse`:    mean over tokens of ||p - t||^2 / ||t||^2 (per-token normalized MSE)
- `cos_mse`: mean over tokens of (1 - cos(p, t)) + mse(p, t) / mean(t^2)
- `channel_nmse`: mean over channels of each channel's squared error over its mean square in the
              targets (per-channel standardized); see `channel_nmse`.
- `subblock`: nmse of the attention sub-block output (the residual stream after attention)
              plus nmse of the layer output; see `subblock_loss`.
"""

from __future__ import annotations

from typing import Callable

import torch

EPS = 1e-8

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Plain mean squared error over all elements. [b, s, h] x2 -> scalar."""
    return (pred.float() - target.float()).pow(2).mean()


def nmse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token normalized MSE: mean_tokens ||p - t||^2 / ||t||^2. [b, s, h] x2 -> scalar.

    Scale-free per token, so tokens with massive activations weigh as much as the others.
    """
    p, t = pred.float(), target.float()
    err = (p - t).pow(2).sum(-1)  # [b, s]
    ref = t.pow(2).sum(-1).clamp_min(EPS)  # [b, s]
    return (err / ref).mean()


def cos_mse(pred: torch.Tensor, target: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Per-token cosine distance plus MSE scaled by the target's mean square. [b, s, h] x2 -> scalar.

    The cosine term fixes each token's direction (what RMSNorm passes on); the MSE term, divided
    by mean(t^2) so both terms are O(1), pins the magnitude. `scale` is that mean square when the
    caller knows it for a larger batch than `target` (a torchrun rank holds part of each batch;
    see `mean_square`); by default it is `target`'s own.
    """
    p, t = pred.float(), target.float()
    cos = torch.nn.functional.cosine_similarity(p, t, dim=-1, eps=EPS)  # [b, s]
    denom = t.pow(2).mean().clamp_min(EPS).detach() if scale is None else max(scale, EPS)
    return (1.0 - cos).mean() + (p - t).pow(2).mean() / denom


def channel_nmse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-channel standardized MSE: mean over tokens and channels of (p - t)^2 / mean_tokens(t^2) of
    that channel (over the batch's tokens). [b, s, h] x2 -> scalar.

    Why (issue 31): Gemma 3's residual stream keeps a few channels hundreds of times larger than the
    median at every token, so a per-token nmse is their error alone; the next layers read the stream
    through RMSNorm scales (1 + w) of up to ~60, which amplify the small channels nmse cannot see. On
    Gemma 3 270M (Wanda 50%, 64 x 128 builtin:mixed samples, benchmarks/walk_kl_probe.py) the nmse
    walk lowered every layer's held-out nmse yet raised the model's held-out KL to dense 0.86 -> 3.27;
    this loss, same settings, lowered it to 0.33. Under torchrun each rank's scale comes from the
    rows it holds (cos_mse passes the whole batch's; this one does not yet).
    """
    p, t = pred.float(), target.float()
    scale = t.pow(2).flatten(0, -2).mean(0).clamp_min(EPS).detach()  # [h]
    return ((p - t).pow(2) / scale).mean()


def sample_energy(target: torch.Tensor) -> torch.Tensor:
    """Sum of squares of each sample, in fp64. [b, s, h] -> [b]. Summed over a batch's samples and
    divided by its element count it gives cos_mse's scale, whichever process holds the samples."""
    return target.double().pow(2).sum((1, 2))


def mean_square(energy: torch.Tensor, elements_per_sample: int) -> float:
    """cos_mse's scale of a batch from its samples' `sample_energy` values [b]."""
    return float(energy.sum()) / (len(energy) * elements_per_sample)


def subblock_loss(pred_mid: torch.Tensor, target_mid: torch.Tensor, pred_out: torch.Tensor,
                  target_out: torch.Tensor) -> torch.Tensor:
    """Attention and MLP sub-blocks reconstructed separately: nmse(mid) + nmse(out).

    `*_mid` is the residual stream after the attention sub-block (input of the post-attention
    norm), `*_out` the layer output; all [b, s, h]. Matching the middle gives the attention
    projections their own target instead of leaving the MLP to absorb their error.
    """
    return nmse(pred_mid, target_mid) + nmse(pred_out, target_out)


# compensate.loss (config.LOSSES) -> its output-only loss; `subblock` adds the attention sub-block term in train.py
LOSS_FUNCTIONS: dict[str, LossFn] = {"mse": mse, "nmse": nmse, "cos_mse": cos_mse, "channel_nmse": channel_nmse,
                                     "subblock": nmse}


def get_loss(name: str) -> LossFn:
    """The output-only loss for `name`; `subblock` returns nmse (its output term)."""
    return LOSS_FUNCTIONS[name]
