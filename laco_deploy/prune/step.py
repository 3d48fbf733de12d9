"""The engine step that prunes one decoder layer in place (unstructured ratio or N:M).

The layer sees the sparse path's inputs (outputs of its already pruned predecessors), as in the
Wanda and SparseGPT reference implementations: one pass gathers the input statistics of all its
target linears, then each linear is pruned, then the engine propagates through the pruned layer.
"""

from __future__ import annotations

import time

import torch

from laco_deploy.config import PruneConfig
from laco_deploy.models import linear_modules
from laco_deploy.prune import scoring
from laco_deploy.prune.stats import InputStats, collect_input_stats


def parse_pattern(pattern: str | None) -> tuple[int, int]:
    """"2:4" -> (2, 4); None -> (0, 0) (unstructured). The config validated the text already."""
    if pattern is None:
        return 0, 0
    n, m = (int(x) for x in pattern.split(":"))
    return n, m


# prune.method -> the input statistics it needs per linear: none, squared input norms (Wanda) or
# the Hessian X^T X (SparseGPT); prune_matrix below implements each method
STATISTICS = {"magnitude": None, "wanda": "norms", "sparsegpt": "hessian"}


def prune_matrix(weight: torch.Tensor, method: str, stats: InputStats | None, *, ratio: float, n: int, m: int,
                 cfg: PruneConfig) -> torch.Tensor:
    """Prune one weight [out, in] in place by `method`; return the bool mask (True = pruned)."""
    with torch.no_grad():
        if method == "sparsegpt":
            assert stats is not None
            new, mask = scoring.sparsegpt_prune(weight, stats.hessian(), ratio=ratio, n=n, m=m,
                                                blocksize=cfg.sparsegpt_blocksize, damp=cfg.sparsegpt_damp)
            weight.copy_(new)
            return mask
        if method == "wanda":
            assert stats is not None
            scores = scoring.wanda_scores(weight, stats.sq_sum)
        elif method == "magnitude":
            scores = scoring.magnitude_scores(weight)
        else:
            raise ValueError(f"prune.method {method!r} has no implementation in prune_matrix")
        mask = scoring.nm_mask(scores, n, m) if n else scoring.row_mask(scores, ratio)
        scoring.apply_mask(weight, mask)
        return mask


def matrix_record(weight: torch.Tensor) -> dict:
    zeros = int((weight == 0).sum())
    return {"shape": list(weight.shape), "zeros": zeros, "numel": weight.numel(), "sparsity": round(zeros / weight.numel(), 6)}


def prune_layer(ctx, cfg: PruneConfig, ratio: float) -> dict:
    """Prune the target linears of `ctx.layer` (an engine LayerContext) at `ratio` or cfg.pattern.

    Returns the layer's record: its ratio, seconds, and per matrix its shape and realised zeros.
    """
    t0 = time.perf_counter()
    n, m = parse_pattern(cfg.pattern)
    modules = linear_modules(ctx.layer, cfg.targets)
    stats: dict[str, InputStats] = {}
    if STATISTICS[cfg.method] and modules:
        ctx.progress("statistics")
        stats = collect_input_stats(ctx, modules, hessian=STATISTICS[cfg.method] == "hessian")
    matrices = {}
    for name, lin in modules.items():
        ctx.progress(f"{cfg.method} {name.rsplit('.', 1)[-1]}")
        prune_matrix(lin.weight.data, cfg.method, stats.get(name), ratio=ratio, n=n, m=m, cfg=cfg)
        matrices[f"model.layers.{ctx.index}.{name}"] = matrix_record(lin.weight.data)
    stats.clear()
    return {"layer": ctx.index, "ratio": ratio if not n else (m - n) / m, "seconds": round(time.perf_counter() - t0, 3),
            "matrices": matrices}
