"""What a fidelity result may claim: whether PyTorch and the runtime score the dense model alike,
and which candidates are worse than the pruned model they were meant to repair.

Both are pure functions of plain dicts (what fidelity.json holds), shared by the reports and the
build summary, so no table calls a model recovered that the numbers say is worse, and no
"gap closed" share is computed from an evaluation that the runtime contradicts.
"""

from __future__ import annotations

import math
from typing import Any

PRUNED = "pruned"  # the candidate others are compared with when present


def runtime_agreement(runtime: str, path: str, torch_ppl: float, runtime_ppl: float, tolerance: float, *,
                      kl_mean: float, top1: float, domains: dict[str, tuple[float, float]],
                      windows: int) -> dict[str, Any]:
    """The dense model scored by PyTorch and by its runtime export on the same windows.

    `agree` when the perplexities differ by at most `tolerance` (relative). A larger difference
    means one side does not see the tokens the other does (a missing BOS, a wrong chat template,
    a broken export): then no recovery share is worth reporting. domains: label -> (torch, runtime) ppl."""
    ratio = runtime_ppl / torch_ppl if torch_ppl and math.isfinite(torch_ppl) else float("nan")
    agree = math.isfinite(ratio) and abs(ratio - 1.0) <= tolerance
    rec = {"runtime": runtime, "path": path, "ppl_pytorch": torch_ppl, "ppl_runtime": runtime_ppl, "ratio": ratio,
           "tolerance": tolerance, "agree": agree, "kl_mean": kl_mean, "top1": top1, "windows": windows,
           "domains": {d: {"ppl_pytorch": t, "ppl_runtime": r} for d, (t, r) in domains.items()}}
    rec["message"] = agreement_message(rec)
    return rec


def agreement_message(rec: dict[str, Any]) -> str:
    same = (f"dense model on the same {rec['windows']} windows: PyTorch ppl {rec['ppl_pytorch']:.4g}, "
            f"{rec['runtime']} ppl {rec['ppl_runtime']:.4g} (ratio {rec['ratio']:.3f}, tolerance ±{rec['tolerance']:.0%})")
    if rec["agree"]:
        return f"PyTorch and {rec['runtime']} agree: {same}"
    return (f"PyTorch and {rec['runtime']} DISAGREE: {same}; the two do not score the same model on the same "
            "tokens (tokenizer prefix/BOS, export or quantization), so no share of the pruning gap is reported")


def gaps_withheld(fid: dict[str, Any]) -> str | None:
    """Why "gap closed" shares must not be shown for this result (None: they may)."""
    rec = fid.get("runtime_agreement")
    return rec["message"] if rec and not rec.get("agree") else None


def worse_than_pruned(candidates: dict[str, dict[str, Any]]) -> dict[str, str]:
    """label -> what got worse, for each candidate whose KL to dense is higher or top-1 agreement
    lower than the pruned model's (the recovery made it worse). Empty without a pruned candidate."""
    base = (candidates.get(PRUNED) or {}).get("metrics")
    if not base:
        return {}
    out = {}
    for label, c in candidates.items():
        m = c.get("metrics") or {}
        if label == PRUNED or not m:
            continue
        worse = []
        kl, kl0 = _kl(m), _kl(base)
        if kl is not None and kl0 is not None and kl > kl0:
            worse.append(f"KL {kl0:.3g} -> {kl:.3g}")
        top, top0 = m.get("top1"), base.get("top1")
        if top is not None and top0 is not None and top < top0:
            worse.append(f"top-1 {100 * top0:.1f}% -> {100 * top:.1f}%")
        if worse:
            out[label] = "WORSE than pruned: " + ", ".join(worse)
    return out


def worse_domains(candidates: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """label -> {domain: "KL a -> b"} where a candidate's KL to dense on one evaluation domain is higher
    than the pruned model's there: a model better on the whole can still be damaged on one kind of text
    (Gemma 3 at 256 samples: dialogue 0.591 -> 0.611 while every other domain improved)."""
    base = (candidates.get(PRUNED) or {}).get("domains") or {}
    out: dict[str, dict[str, str]] = {}
    for label, c in candidates.items():
        if label == PRUNED:
            continue
        for d, m in (c.get("domains") or {}).items():
            kl, kl0 = m.get("kl_mean"), (base.get(d) or {}).get("kl_mean")
            if kl is not None and kl0 is not None and kl > kl0:
                out.setdefault(label, {})[d] = f"KL {kl0:.3g} -> {kl:.3g}"
    return out


def _kl(metrics: dict[str, Any]) -> float | None:
    kl = metrics.get("kl")
    return kl.get("mean") if isinstance(kl, dict) else kl
