"""Running sums of one fidelity candidate over the evaluation windows, per domain and overall;
gathered across torchrun ranks (`absorb`) before the metrics are computed."""

from __future__ import annotations

from typing import Any

import torch

from laco_deploy.fidelity import metrics as M
from laco_deploy.fidelity.layerwise import LayerCurves


class DomainSums:
    """Sums of one candidate over the windows of one evaluation domain."""

    def __init__(self) -> None:
        self.kl_sum = self.nll_sum = 0.0
        self.top1 = self.tokens = self.nll_count = 0

    def add(self, kl: torch.Tensor, agree: torch.Tensor, nll: torch.Tensor) -> None:
        self.kl_sum += kl.sum().item()
        self.top1 += int(agree.sum())
        self.tokens += kl.numel()
        self.nll_sum += nll.sum().item()
        self.nll_count += nll.numel()

    def absorb(self, other: DomainSums) -> None:
        """Add the sums of windows scored elsewhere (another rank)."""
        self.kl_sum += other.kl_sum
        self.nll_sum += other.nll_sum
        self.top1 += other.top1
        self.tokens += other.tokens
        self.nll_count += other.nll_count

    def metrics(self, dense_ppl: float) -> dict[str, Any]:
        ppl = M.perplexity(self.nll_sum, self.nll_count)
        return {"ppl": ppl, "ppl_ratio": ppl / dense_ppl, "kl_mean": self.kl_sum / self.tokens,
                "top1": self.top1 / self.tokens, "tokens_scored": self.nll_count}


class Stats:
    """Running per-candidate sums over windows; only per-token KL (one float each) is kept."""

    def __init__(self, runtime: str, curves: LayerCurves | None):
        self.domains: dict[str, DomainSums] = {}
        self.runtime = runtime
        self.kl: list[torch.Tensor] = []
        self.top1 = 0
        self.delta_sum = 0.0
        self.tokens = 0
        self.nll_sum = 0.0
        self.nll_count = 0
        self.curves = curves
        self.per_window: list[dict[str, float]] = []

    def add(self, dense: torch.Tensor, cand: torch.Tensor, ids: torch.Tensor, domain: str) -> None:
        """One window of `domain`: dense and candidate logits [seq, vocab], ids [seq]."""
        cmp = M.compare_logits(dense, cand, ids)
        kl, agree, nll = cmp["kl"], cmp["top1"], cmp["nll"]
        self.domains.setdefault(domain, DomainSums()).add(kl, agree, nll)
        self.kl.append(kl.float())
        self.top1 += int(agree.sum())
        self.delta_sum += cmp["p_top_delta"].sum().item()
        self.tokens += kl.numel()
        self.nll_sum += nll.sum().item()
        self.nll_count += nll.numel()
        self.per_window.append({"domain": domain, "kl_mean": kl.mean().item(), "top1": agree.float().mean().item(),
                                "nll_mean": nll.mean().item()})

    def absorb(self, other: Stats) -> None:
        """Append the windows another rank scored (they follow this rank's in window order)."""
        for domain, sums in other.domains.items():
            self.domains.setdefault(domain, DomainSums()).absorb(sums)
        self.kl.extend(other.kl)
        self.per_window.extend(other.per_window)
        self.top1 += other.top1
        self.delta_sum += other.delta_sum
        self.tokens += other.tokens
        self.nll_sum += other.nll_sum
        self.nll_count += other.nll_count
        if self.curves is not None and other.curves is not None:
            self.curves.absorb(other.curves)

    def metrics(self, dense_ppl: float) -> dict[str, Any]:
        kl = torch.cat(self.kl)
        ppl = M.perplexity(self.nll_sum, self.nll_count)
        return {
            "kl": M.summarize(kl),
            "top1": self.top1 / self.tokens,
            "p_top_delta": self.delta_sum / self.tokens,
            "ppl": ppl,
            "ppl_ratio": ppl / dense_ppl,
            "nll_mean": self.nll_sum / self.nll_count,
            "tokens": self.tokens,
            "tokens_scored": self.nll_count,
        }
