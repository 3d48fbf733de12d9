"""Fidelity metrics as pure tensor functions (no models, no files), tested against their formulas.

Conventions: `dense` and `cand` logits are [tokens, vocab] for the same token positions; the
distributions are softmax(logits). Per-token results are 1-D tensors of length `tokens`.

- KL(dense || candidate) per token (divergence.token_kl): sum_v p_d(v) * (log p_d(v) - log p_c(v)), in nats.
- top-1 agreement: argmax p_d == argmax p_c.
- dense-top-token probability delta: p_c(t*) - p_d(t*), t* = argmax p_d (negative: the candidate
  is less sure of the dense model's choice).
- perplexity: exp(mean negative log-likelihood of the next token).
- hidden-state relative error ||h_c - h_d|| / ||h_d|| and cosine(h_c, h_d), per token.
"""

from __future__ import annotations

import math

import torch

from laco_deploy.divergence import ROW_CHUNK, check_pair


def compare_logits(dense: torch.Tensor, cand: torch.Tensor, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every per-token comparison of one window from a single float64 log-softmax per model.

    dense, cand [seq, vocab]; input_ids [seq]. Returns kl [seq], top1 [seq] bool, p_top_delta [seq]
    and the candidate's next-token nll [seq - 1]: the same values as divergence.token_kl, top1_agreement,
    top_token_prob_delta and next_token_nll, at about a third of their combined cost (the
    full-vocabulary passes dominate evaluation time on CPU at vocab 49152).
    """
    check_pair(dense, cand)
    if input_ids.shape != dense.shape[:1]:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} must be [seq] for logits {tuple(dense.shape)}")
    seq = dense.shape[0]
    kl, delta = torch.empty(seq, dtype=torch.float64), torch.empty(seq, dtype=torch.float64)
    nll = torch.empty(seq - 1, dtype=torch.float64)
    top = dense.argmax(-1)
    targets = input_ids.to(dense.device)
    for s in range(0, seq, ROW_CHUNK):
        e = min(s + ROW_CHUNK, seq)
        logp = torch.log_softmax(dense[s:e].double(), dim=-1)
        logq = torch.log_softmax(cand[s:e].double(), dim=-1)
        p = logp.exp()
        kl[s:e] = (p * (logp - logq)).sum(-1).clamp_min(0.0)
        t = top[s:e].view(-1, 1)
        delta[s:e] = (logq.gather(-1, t).exp() - p.gather(-1, t)).squeeze(-1)
        rows = min(e, seq - 1) - s  # the last position has no next token
        if rows > 0:
            nll[s : s + rows] = -logq[:rows].gather(-1, targets[s + 1 : s + 1 + rows].view(-1, 1)).squeeze(-1)
    return {"kl": kl, "top1": top == cand.argmax(-1), "p_top_delta": delta, "nll": nll}


def top1_agreement(dense: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Whether both models pick the same most likely next token. [tokens, vocab] x2 -> [tokens] bool."""
    check_pair(dense, cand)
    return dense.argmax(-1) == cand.argmax(-1)


def top_token_prob_delta(dense: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """p_cand(t*) - p_dense(t*) with t* = argmax p_dense. [tokens, vocab] x2 -> [tokens] float64."""
    check_pair(dense, cand)
    top = dense.argmax(-1, keepdim=True)  # [tokens, 1]
    p_d = torch.softmax(dense.double(), -1).gather(-1, top).squeeze(-1)
    p_c = torch.softmax(cand.double(), -1).gather(-1, top).squeeze(-1)
    return p_c - p_d


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each next token. logits [seq, vocab], input_ids [seq] -> [seq - 1].

    Position i predicts token i + 1, so the last position has no target and the first token is
    never scored (the usual causal-LM protocol).
    """
    if logits.dim() != 2 or input_ids.dim() != 1 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} must be [seq, vocab] and [seq]")
    targets = input_ids[1:].view(-1, 1).to(logits.device)
    out = torch.empty(targets.shape[0], dtype=torch.float64, device=logits.device)
    for s in range(0, targets.shape[0], ROW_CHUNK):  # float64 in row chunks, as in compare_logits
        logp = torch.log_softmax(logits[s : s + ROW_CHUNK].double(), dim=-1)
        out[s : s + ROW_CHUNK] = -logp.gather(-1, targets[s : s + ROW_CHUNK]).squeeze(-1)
    return out


def perplexity(nll_sum: float, count: int) -> float:
    """exp(mean NLL) from a running sum and count of per-token NLLs."""
    if count < 1:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(nll_sum / count)


def relative_error(hidden: torch.Tensor, ref: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """||h - h_ref|| / ||h_ref|| per token over the hidden dimension. [..., hidden] x2 -> [...] float64."""
    if hidden.shape != ref.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and {tuple(ref.shape)} differ in shape")
    h, r = hidden.double(), ref.double()
    return (h - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(eps)


def cosine(hidden: torch.Tensor, ref: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Cosine similarity per token over the hidden dimension. [..., hidden] x2 -> [...] float64."""
    if hidden.shape != ref.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and {tuple(ref.shape)} differ in shape")
    h, r = hidden.double(), ref.double()
    return (h * r).sum(-1) / (h.norm(dim=-1) * r.norm(dim=-1)).clamp_min(eps)


def summarize(values: torch.Tensor) -> dict[str, float]:
    """mean, median, p99 and max of a 1-D tensor (quantiles with linear interpolation)."""
    v = values.double().flatten()
    if v.numel() == 0:
        raise ValueError("cannot summarize an empty tensor")
    q = torch.quantile(v, torch.tensor([0.5, 0.99], dtype=torch.float64))
    return {"mean": v.mean().item(), "median": q[0].item(), "p99": q[1].item(), "max": v.max().item()}


def log_histogram(values: torch.Tensor, bins: int = 40, floor: float = 1e-6) -> dict[str, list]:
    """Counts of `values` in log-spaced bins from `floor` to the max; values below `floor` go in
    an extra first bin [0, floor). Returns {"edges": [bins + 2], "counts": [bins + 1]}."""
    v = values.double().flatten()
    top = max(float(v.max().item()) if v.numel() else floor, floor * 10)
    edges = torch.cat([torch.zeros(1, dtype=torch.float64),
                       torch.logspace(math.log10(floor), math.log10(top), bins + 1, dtype=torch.float64)])
    idx = torch.bucketize(v, edges[1:-1], right=True)  # 0 = below floor, bins = the top bin (max included)
    counts = torch.bincount(idx, minlength=bins + 1)
    return {"edges": edges.tolist(), "counts": counts.tolist()}
