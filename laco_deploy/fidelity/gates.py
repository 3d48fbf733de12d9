"""Quality gates: thresholds from FidelityConfig checked against each candidate's metrics."""

from __future__ import annotations

from typing import Any, Mapping

from laco_deploy.config import FidelityConfig
from laco_deploy.errors import GateFailed

# gate name -> (config field, metric path in the candidate's metrics, "max" or "min", words)
GATES = {
    "max_kl": ("max_kl", ("kl", "mean"), "max", "mean KL(dense||candidate)"),
    "min_top1": ("min_top1", ("top1",), "min", "top-1 agreement"),
    "max_ppl_ratio": ("max_ppl_ratio", ("ppl_ratio",), "max", "perplexity ratio"),
}


def _metric(metrics: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = metrics
    for key in path:
        value = value[key]
    return float(value)


def evaluate_gates(cfg: FidelityConfig, candidates: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (set gate, candidate): name, candidate, metric, threshold, value, passed and
    `miss` (how far the value is on the wrong side of the threshold; 0 when passed).
    A NaN value fails its gate."""
    out = []
    for name, (attr, path, kind, words) in GATES.items():
        threshold = getattr(cfg, attr)
        if threshold is None:
            continue
        for label, metrics in candidates.items():
            value = _metric(metrics, path)
            ok = value <= threshold if kind == "max" else value >= threshold
            miss = 0.0 if ok else abs(value - threshold)
            out.append({"name": name, "candidate": label, "metric": ".".join(path), "description": words,
                        "threshold": float(threshold), "value": value, "passed": bool(ok), "miss": miss})
    return out


def gate_message(gate: dict[str, Any]) -> str:
    """One line saying which gate, for which candidate, and by how much."""
    op = "<=" if gate["name"].startswith("max") else ">="
    status = "passed" if gate["passed"] else f"FAILED by {gate['miss']:.4g}"
    return (f"gate {gate['name']} {status} for {gate['candidate']}: {gate['description']} = {gate['value']:.4g}, "
            f"required {op} {gate['threshold']:.4g}")


def verdict(result: Mapping[str, Any]) -> bool:
    """The `passed` field of a fidelity result (FidelityResult.to_dict()). A result without one is an
    error, never a pass: the gates cannot be said to hold when nobody checked them."""
    passed = result.get("passed")
    if not isinstance(passed, bool):
        raise GateFailed(f"the fidelity result has no gate verdict ('passed' is {passed!r}); its gates were not "
                         "checked: rerun the fidelity stage (delete fidelity.json or the build folder)")
    return passed
