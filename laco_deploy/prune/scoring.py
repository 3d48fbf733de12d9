"""Pure scoring and mask functions for pruning. Tensors in, tensors out; no modules, no I/O.

Conventions: a weight W is [out, in] (torch.nn.Linear layout); a mask is a bool tensor of the
same shape where True means "pruned" (set to zero). Scores rank weights: lower = pruned first.

Formulas:
- magnitude:  S_ij = |W_ij|
- Wanda (Sun et al. 2023):  S_ij = |W_ij| * ||X_j||_2, X = the layer's inputs over all calibration
  tokens [tokens, in]; weights are compared within each output row.
- N:M: in each group of M consecutive input weights of a row, the M-N lowest scores are pruned.
- SparseGPT (Frantar & Alistarh 2023): see `sparsegpt_prune`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


def prune_count(columns: int, ratio: float) -> int:
    """Weights pruned in a row of `columns` for `ratio` (rounded to nearest, never the whole row)."""
    k = int(math.floor(columns * ratio + 0.5))
    return min(max(k, 0), columns - 1) if columns > 1 else 0


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """|W|. weight [out, in] -> [out, in]."""
    return weight.abs()


def wanda_scores(weight: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2. weight [out, in]; sq_norms [in] = sum over tokens of X_tj^2 -> [out, in]."""
    return weight.abs() * sq_norms.to(weight.dtype).clamp_min(0).sqrt().unsqueeze(0)


def row_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Prune the `prune_count(in, ratio)` lowest scores of every row. scores [out, in] -> bool mask.

    Ties are broken by position (stable sort), so the mask is deterministic.
    """
    k = prune_count(scores.shape[1], ratio)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k == 0:
        return mask
    idx = torch.sort(scores, dim=1, stable=True).indices[:, :k]
    return mask.scatter_(1, idx, True)


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M mask: each group of M consecutive input weights keeps its N highest scores.

    scores [out, in] -> bool mask [out, in]. When `in` is not a multiple of M, the last, shorter
    group keeps at most N weights too.
    """
    if not 0 < n < m:
        raise ValueError(f"N:M needs 0 < N < M, got {n}:{m}")
    rows, cols = scores.shape
    pad = (-cols) % m
    s = scores.float()
    if pad:
        s = torch.cat([s, torch.full((rows, pad), -math.inf, dtype=s.dtype, device=s.device)], dim=1)
    groups = s.view(rows, -1, m)  # [out, in/M, M]
    keep_idx = torch.topk(groups, n, dim=2, largest=True, sorted=False).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, keep_idx, True)
    return (~keep).view(rows, -1)[:, :cols].contiguous()


def apply_mask(weight: torch.Tensor, mask: torch.Tensor) -> None:
    """Zero the pruned entries in place."""
    weight.masked_fill_(mask, 0.0)


# ---------------------------------------------------------------- SparseGPT (OBS)


def damped_hessian_inverse_chol(hessian: torch.Tensor, weight: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) after damping; zeroes dead input columns of W.

    hessian [in, in] = 2 X^T X / tokens; damping adds `damp` * mean(diag H) to the diagonal.
    Dead inputs (diag 0: never active) get H_ii = 1 and their weights set to 0, as in the paper's code.
    """
    h = hessian.clone().to(torch.float64)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    diag = torch.arange(h.shape[0], device=h.device)
    h[diag, diag] += damp * torch.mean(torch.diag(h))
    chol = torch.linalg.cholesky(h)
    hinv = torch.cholesky_inverse(chol)
    return torch.linalg.cholesky(hinv, upper=True)


def _block_mask(w1: torch.Tensor, d: torch.Tensor, target: int) -> torch.Tensor:
    """Per-row OBS mask for one block: prune `target` weights of each row with least w^2 / [H^-1]_jj^2."""
    mask = torch.zeros_like(w1, dtype=torch.bool)
    if target <= 0:
        return mask
    err = w1.pow(2) / d.pow(2).unsqueeze(0)
    idx = torch.sort(err, dim=1, stable=True).indices[:, :target]
    return mask.scatter_(1, idx, True)


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """SparseGPT runs thousands of tiny ops and small factorisations; on CPU, intra-op threads
    mostly add synchronisation (measured 5-50x slower on a busy 2-core machine), so use one."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, *, ratio: float = 0.5, n: int = 0, m: int = 0,
                    blocksize: int = 128, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT: prune W column by column, updating the not yet visited columns to compensate.

    weight [out, in]; hessian [in, in] = 2 X^T X / tokens. Returns (new weight [out, in] in the
    weight's dtype, bool mask [out, in]). With U = chol(H^-1) upper, for column j the OBS error of
    dropping w_ij is w_ij^2 / U_jj^2 and the update of the later columns is
    W[:, j:] -= ((w_j - q_j) / U_jj) U[j, j:].

    Mask selection is adaptive (made when the block is reached, on the already updated weights):
    unstructured prunes, in every row, the share of each block that keeps the row's cumulative
    ratio exact (so every row ends at `ratio`); N:M (n > 0) picks, for every group of M columns,
    the M-N lowest errors of each row.
    """
    w = weight.detach().clone().to(torch.float32)
    if n > 0:
        blocksize = max(m, blocksize - blocksize % m)  # N:M groups never straddle two blocks
    mask = torch.zeros(w.shape, dtype=torch.bool, device=w.device)
    with _one_cpu_thread(w.device):
        u = damped_hessian_inverse_chol(hessian, w, damp).to(torch.float32)
        _sparsegpt_blocks(w, u, mask, ratio=ratio, n=n, m=m, blocksize=blocksize)
    w.masked_fill_(mask, 0.0)
    return w.to(weight.dtype), mask


def _sparsegpt_blocks(w: torch.Tensor, u: torch.Tensor, mask: torch.Tensor, *, ratio: float, n: int, m: int,
                      blocksize: int) -> None:
    """The blockwise OBS sweep of `sparsegpt_prune`, updating w [out, in] and mask in place."""
    cols = w.shape[1]
    total = prune_count(cols, ratio) if n == 0 else 0
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        d = torch.diag(u1)
        err1 = torch.zeros_like(w1)
        if n == 0:
            # cumulative target keeps every row's final count exact despite per-block rounding
            target = _cum_target(total, cols, i2) - _cum_target(total, cols, i1)
            mask1 = _block_mask(w1, d, target)
        else:
            mask1 = torch.zeros_like(w1, dtype=torch.bool)
        for j in range(i2 - i1):
            if n > 0 and (i1 + j) % m == 0:
                g = min(m, i2 - i1 - j)
                score = w1[:, j : j + g].pow(2) / d[j : j + g].pow(2).unsqueeze(0)
                if g > n:
                    drop = torch.topk(score, g - n, dim=1, largest=False).indices
                    mask1[:, j : j + g].scatter_(1, drop, True)
            col = w1[:, j]
            q = col.masked_fill(mask1[:, j], 0.0)
            e = (col - q) / d[j]
            w1[:, j:] -= e.unsqueeze(1) * u1[j, j:].unsqueeze(0)
            w1[:, j] = q
            err1[:, j] = e
        w[:, i1:i2] = w1
        mask[:, i1:i2] = mask1
        w[:, i2:] -= err1 @ u[i1:i2, i2:]


def _cum_target(total: int, cols: int, upto: int) -> int:
    """Weights of a row pruned among its first `upto` columns so the whole row prunes `total`."""
    return int(math.floor(total * upto / cols + 0.5))


# ---------------------------------------------------------------- structured (channels, head groups)


def wanda_row_importance(weight: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """Sum of Wanda scores along each output row: sum_j |W_ij| ||X_j||. weight [out, in] -> [out]."""
    return wanda_scores(weight, sq_norms).sum(dim=1)


def wanda_column_importance(weight: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """Sum of Wanda scores down each input column: ||X_j|| sum_i |W_ij|. weight [out, in] -> [in]."""
    return wanda_scores(weight, sq_norms).sum(dim=0)


def fluctuation_importance(weight: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """FLAP's fluctuation metric of input column j: Var_t(X_tj) * ||W[:, j]||_2^2. weight [out, in] -> [in]."""
    return variance.to(weight.dtype) * weight.pow(2).sum(dim=0)


def group_sum(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum consecutive equal slices: [groups * k] -> [groups] (e.g. head_dim columns per head group)."""
    return scores.view(groups, -1).sum(dim=1)


def keep_indices(scores: torch.Tensor, remove: int) -> torch.Tensor:
    """Indices (ascending) of the entries kept after dropping the `remove` lowest scores. [n] -> [n - remove]."""
    order = torch.sort(scores, stable=True).indices
    return torch.sort(order[remove:]).values
