"""Regression compare of two suite results: per-metric tolerances, times as same-run ratios.

A result file (written by benchmarks/run_suite.py) holds
    {"suite": ..., "metrics": {NAME: {"value": x, "better": "lower"|"higher", "rel": r, "abs": a}}}
Times are stored as ratios against a reference measured in the same run (a fixed matmul
workload, or the dense model's speed), so a slower machine does not look like a regression.
A metric regresses when it moves in the worse direction by more than its tolerance
(`abs` in the metric's units, or `rel` as a share of the baseline value; either one suffices).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laco_deploy.errors import ConfigError


@dataclass(frozen=True)
class Row:
    name: str
    baseline: float | None
    current: float | None
    change: float | None  # relative change, current/baseline - 1
    allowed: str
    status: str  # "ok" | "improved" | "REGRESSED" | "missing" | "new"


def load_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"benchmark result {path} not found; run the suite first (python benchmarks/run_suite.py NAME --out FILE)") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); regenerate it") from e
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
        raise ConfigError(f"{path} has no 'metrics' mapping; it is not a laco-deploy suite result")
    return data


def _regressed(spec: dict[str, Any], base: float, cur: float) -> bool:
    worse = cur - base if spec.get("better", "lower") == "lower" else base - cur
    if spec.get("better") == "equal":
        worse = abs(cur - base)
    if worse <= 0:
        return False
    limits = []
    if "abs" in spec:
        limits.append(float(spec["abs"]))
    if "rel" in spec:
        limits.append(float(spec["rel"]) * abs(base))
    return worse > (max(limits) if limits else 0.0)


def compare(baseline: dict[str, Any], current: dict[str, Any], overrides: dict[str, dict[str, float]] | None = None) -> list[Row]:
    """One row per metric of the baseline (and new ones of the current). Tolerances: baseline's, then overrides."""
    rows = []
    bm, cm = baseline["metrics"], current["metrics"]
    for name, bspec in bm.items():
        spec = {**bspec, **(overrides or {}).get(name, {})}
        allowed = ", ".join(f"{k} {spec[k]}" for k in ("abs", "rel") if k in spec) or "exact"
        base = bspec.get("value")
        cur = (cm.get(name) or {}).get("value")
        if cur is None or (isinstance(cur, float) and math.isnan(cur)):
            rows.append(Row(name, base, None, None, allowed, "missing"))
            continue
        change = (cur / base - 1.0) if base not in (None, 0) else None
        if _regressed(spec, float(base), float(cur)):
            status = "REGRESSED"
        else:
            better = spec.get("better", "lower")
            status = "improved" if (better == "lower" and cur < base) or (better == "higher" and cur > base) else "ok"
        rows.append(Row(name, base, cur, change, allowed, status))
    for name in cm.keys() - bm.keys():
        rows.append(Row(name, None, cm[name].get("value"), None, "-", "new"))
    return rows


def failed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status in ("REGRESSED", "missing")]


TABLE_HEAD = "| metric | baseline | current | change | tolerance | status |"


def is_table_file(path: Path) -> bool:
    """Whether `path` holds a table `render` wrote (a rerun may replace it with --force)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\n") == TABLE_HEAD
    except (OSError, UnicodeDecodeError):
        return False


def render(rows: list[Row]) -> str:
    """A Markdown table (reads well in a terminal and as a pull-request comment)."""
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    lines = [TABLE_HEAD, "|---|---:|---:|---:|---|---|"]
    for r in rows:
        change = "-" if r.change is None else f"{r.change:+.1%}"
        lines.append(f"| {r.name} | {fmt(r.baseline)} | {fmt(r.current)} | {change} | {r.allowed} | {r.status} |")
    return "\n".join(lines)


def parse_tolerances(specs: list[str]) -> dict[str, dict[str, float]]:
    """`NAME=rel:0.1` or `NAME=abs:0.5` -> {NAME: {"rel": 0.1}}."""
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        name, _, tol = spec.partition("=")
        kind, _, value = tol.partition(":")
        try:
            if kind not in ("abs", "rel"):
                raise ValueError
            out.setdefault(name, {})[kind] = float(value)
        except ValueError as e:
            raise ConfigError(f"bench.tolerance {spec!r} must look like METRIC=rel:0.1 or METRIC=abs:0.5") from e
    return out
