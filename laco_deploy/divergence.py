"""KL(p_dense || p_cand) per token between two models' next-token logits, in float64 row chunks:
one implementation for fidelity's metrics (fidelity/metrics.py) and the parity check an export runs
(runtimes/parity.py). Pure tensor functions; `ROW_CHUNK` also sizes memplan's estimate."""

from __future__ import annotations

import torch

ROW_CHUNK = 16  # rows per float64 chunk: [16, vocab] float64 is 6 MiB at vocab 49152 (64 rows: +150 MiB peak)


def token_kl(dense: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL(p_dense || p_cand) per token, in nats. [tokens, vocab] x2 -> [tokens] float64.

    Computed in float64 in row chunks so that small divergences are not lost to rounding and
    memory stays bounded; tiny negative rounding residues are clamped to 0 (KL >= 0).
    """
    check_pair(dense, cand)
    out = torch.empty(dense.shape[0], dtype=torch.float64)
    for s in range(0, dense.shape[0], ROW_CHUNK):
        logp = torch.log_softmax(dense[s : s + ROW_CHUNK].double(), dim=-1)
        logq = torch.log_softmax(cand[s : s + ROW_CHUNK].double(), dim=-1)
        out[s : s + ROW_CHUNK] = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)
    return out


def check_pair(dense: torch.Tensor, cand: torch.Tensor) -> None:
    if dense.dim() != 2 or dense.shape != cand.shape:
        raise ValueError(f"dense logits {tuple(dense.shape)} and candidate logits {tuple(cand.shape)} must both be [tokens, vocab]")
