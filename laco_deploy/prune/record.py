"""The sparsity record written beside a pruned model (`sparsity.json`) and its config.json summary."""

from __future__ import annotations

from typing import Any

from laco_deploy.artifacts import pattern_label
from laco_deploy.config import PruneConfig, to_dict


def pattern_kind(cfg: PruneConfig) -> str:
    """"unstructured" | "N:M" | "structured", as stored in config.json's `laco_deploy.pattern`."""
    if cfg.structured is not None:
        return "structured"
    return cfg.pattern or "unstructured"


def label(cfg: PruneConfig) -> str:
    """The human label of the pattern `cfg` asks for (artifacts.pattern_label)."""
    return pattern_label(pattern_kind(cfg), cfg.structured if cfg.structured is not None else cfg.sparsity, owl=cfg.owl)


def summarize(records: list[dict], dense_params: dict[str, int] | None = None) -> dict[str, Any]:
    """Overall realised sparsity from per-layer records.

    Unstructured/N:M: zeros / elements over all pruned matrices. Structured: the share of the
    pruned matrices' original elements that were removed (`dense_params` = original numel per
    matrix), counting zeros inside the kept parts too.
    """
    zeros = numel = original = 0
    for rec in records:
        for name, mat in rec["matrices"].items():
            zeros += mat["zeros"]
            numel += mat["numel"]
            original += (dense_params or {}).get(name, mat["numel"])
    removed = original - numel
    overall = (zeros + removed) / original if original else 0.0
    return {"pruned_matrices": sum(len(r["matrices"]) for r in records), "elements": original,
            "zeros_or_removed": zeros + removed, "sparsity": round(overall, 6)}


def sparsity_document(cfg: PruneConfig, records: list[dict], overall: dict[str, Any], data: dict[str, Any],
                      wall_s: float) -> dict[str, Any]:
    """The full `sparsity.json`: settings, overall and per-matrix realised sparsity, per-layer time."""
    matrices = {name: mat for rec in records for name, mat in rec["matrices"].items()}
    per_layer = [{k: v for k, v in rec.items() if k != "matrices"} for rec in records]
    return {
        "stage": "prune",
        "method": cfg.method,
        "pattern": pattern_kind(cfg),
        "label": label(cfg),
        "settings": to_dict(cfg),
        "calibration": data,
        "overall": overall,
        "per_layer": per_layer,
        "matrices": matrices,
        "wall_s": round(wall_s, 3),
    }


def config_summary(cfg: PruneConfig, overall: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """What goes into config.json as `laco_deploy` (exporters copy it into GGUF/ONNX metadata)."""
    out: dict[str, Any] = {
        "stage": "prune",
        "method": cfg.method,
        "pattern": pattern_kind(cfg),
        "sparsity": overall["sparsity"],
        "target_sparsity": cfg.structured if cfg.structured is not None else (
            _nm_ratio(cfg.pattern) if cfg.pattern else cfg.sparsity),
        "targets": list(cfg.targets),
        "owl": cfg.owl,
        "calibration": data,
    }
    if cfg.method == "sparsegpt":
        out["sparsegpt"] = {"damp": cfg.sparsegpt_damp, "blocksize": cfg.sparsegpt_blocksize}
    return out


def _nm_ratio(pattern: str) -> float:
    n, m = (int(x) for x in pattern.split(":"))
    return (m - n) / m
