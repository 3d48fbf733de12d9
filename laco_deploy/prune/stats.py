"""Input statistics of a decoder layer's linears, gathered with forward hooks over calibration data.

Per linear, over all calibration tokens X [tokens, in]:
  sq_sum  [in]       sum_t X_tj^2           (Wanda: ||X_j||_2^2)
  lin_sum [in]       sum_t X_tj             (structured fluctuation: mean and variance)
  xtx     [in, in]   sum_t X_t^T X_t        (SparseGPT: H = 2 X^T X / tokens), only when asked

Linears fed by the same tensor (q/k/v, gate/up) get their statistics computed once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laco_deploy import distributed


@dataclass
class InputStats:
    tokens: int
    sq_sum: torch.Tensor  # [in]
    lin_sum: torch.Tensor  # [in]
    xtx: torch.Tensor | None = None  # [in, in]

    def hessian(self) -> torch.Tensor:
        """SparseGPT's layer Hessian 2 X^T X / tokens. [in, in]"""
        assert self.xtx is not None, "collect_input_stats(..., hessian=True) was not asked"
        return self.xtx * (2.0 / max(self.tokens, 1))

    def mean(self) -> torch.Tensor:
        return self.lin_sum / max(self.tokens, 1)

    def variance(self) -> torch.Tensor:
        """Per-feature variance over tokens (population). [in]"""
        mean = self.mean()
        return (self.sq_sum / max(self.tokens, 1) - mean.pow(2)).clamp_min(0)


def _batch_stats(x: torch.Tensor, hessian: bool) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)  # [tokens, in]
    xtx = flat.T @ flat if hessian else None
    return flat.shape[0], flat.pow(2).sum(0), flat.sum(0), xtx


@torch.no_grad()
def collect_input_stats(ctx, modules: dict[str, torch.nn.Linear], *, hessian: bool,
                        hessian_only: frozenset[str] | None = None) -> dict[str, InputStats]:
    """Run the layer in `ctx` over its calibration inputs and gather the inputs' statistics.

    ctx: an engine LayerContext (its layer, inputs, kwargs, device, batch size). `hessian_only`
    restricts the [in, in] accumulation to those names (None: all, when `hessian`).
    Returns {name: InputStats} with tensors on ctx.device.
    """
    stats: dict[str, InputStats] = {}
    memo: dict[tuple, tuple] = {}

    def hook_for(name: str):
        want_h = hessian and (hessian_only is None or name in hessian_only)

        def hook(_mod, args, _out):
            x = args[0]
            key = (x.data_ptr(), tuple(x.shape), x.stride(), want_h)
            if key not in memo:
                # the memo holds x, so its memory cannot be reused by another tensor in this batch
                memo[key] = (x, *_batch_stats(x, want_h))
            _x, n, sq, lin, xtx = memo[key]
            s = stats.get(name)
            if s is None:
                stats[name] = InputStats(n, sq.clone(), lin.clone(), xtx.clone() if xtx is not None else None)
            else:
                s.tokens += n
                s.sq_sum += sq
                s.lin_sum += lin
                if xtx is not None:
                    s.xtx += xtx

        return hook

    handles = [mod.register_forward_hook(hook_for(name)) for name, mod in modules.items()]
    try:
        for start in range(0, len(ctx.inputs), ctx.batch_size):
            stop = min(start + ctx.batch_size, len(ctx.inputs))
            memo.clear()
            ctx.forward(ctx.layer, ctx.inputs.batch(start, stop, ctx.device))
    finally:
        for h in handles:
            h.remove()
        memo.clear()
    _sum_over_ranks(stats, modules)
    return stats


def _sum_over_ranks(stats: dict[str, InputStats], modules: dict[str, torch.nn.Linear]) -> None:
    """Each rank saw its own shard of samples: sum the statistics so every rank chooses the same masks."""
    if distributed.world() == 1:
        return
    for name in modules:  # same order on every rank
        s = stats[name]
        s.tokens = int(distributed.all_reduce_floats([s.tokens])[0])
        for t in (s.sq_sum, s.lin_sum, s.xtx):
            if t is not None:
                distributed.all_reduce_(t)
