"""The engine step that prunes one decoder layer in place (unstructured ratio or N:M).

The layer sees the sparse path's inputs (outputs of its already pruned predecessors), as in the
Wanda and SparseGPT reference implementations: one pass gathers the input statistics of all its
target linears, then each linear is pruned, then the engine propagates through the pruned layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MatrixRule:
    """What unstructured pruning reads from the settings: the method, the target projections, the
    N:M pattern (0, 0: a ratio per row instead) and SparseGPT's block size and damping."""

    method: str
    targets: tuple[str, ...]
    n: int
    m: int
    blocksize: int
    damp: float

    @classmethod
    def of(cls, cfg: PruneConfig) -> MatrixRule:
        n, m = parse_pattern(cfg.pattern)
        return cls(cfg.method, tuple(cfg.targets), n, m, cfg.sparsegpt_blocksize, cfg.sparsegpt_damp)


# prune.method -> the input statistics it needs per linear: none, squared input norms (Wanda) or
# the Hessian X^T X (SparseGPT); prune_matrix below implements each method
STATISTICS = {"magnitude": None, "wanda": "norms", "sparsegpt": "hessian"}


def prune_matrix(weight: torch.Tensor, rule: MatrixRule, stats: InputStats | None, ratio: float) -> torch.Tensor:
    """Prune one weight [out, in] in place by `rule.method`; return the bool mask (True = pruned)."""
    method, n, m = rule.method, rule.n, rule.m
    with torch.no_grad():
        if method == "sparsegpt":
            assert stats is not None
            new, mask = scoring.sparsegpt_prune(weight, stats.hessian(), ratio=ratio, n=n, m=m,
                                                blocksize=rule.blocksize, damp=rule.damp)
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


def prune_layer(ctx, rule: MatrixRule, ratio: float) -> dict:
    """Prune the target linears of `ctx.layer` (an engine LayerContext) at `ratio` or the rule's N:M.

    Returns the layer's record: its ratio, seconds, and per matrix its shape and realised zeros.
    """
    t0 = time.perf_counter()
    n, m = rule.n, rule.m
    modules = linear_modules(ctx.layer, rule.targets)
    stats: dict[str, InputStats] = {}
    if STATISTICS[rule.method] and modules:
        ctx.progress("statistics")
        stats = collect_input_stats(ctx, modules, hessian=STATISTICS[rule.method] == "hessian")
    matrices = {}
    for name, lin in modules.items():
        ctx.progress(f"{rule.method} {name.rsplit('.', 1)[-1]}")
        prune_matrix(lin.weight.data, rule, stats.get(name), ratio)
        matrices[f"model.layers.{ctx.index}.{name}"] = matrix_record(lin.weight.data)
    stats.clear()
    return {"layer": ctx.index, "ratio": ratio if not n else (m - n) / m, "seconds": round(time.perf_counter() - t0, 3),
            "matrices": matrices}
