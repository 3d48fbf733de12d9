"""Plain-text tables of benchmark results (the same text goes to the terminal and to Markdown)."""

from __future__ import annotations

from laco_deploy.artifacts import BenchResult

_COLUMNS = [
    ("ppl", "ppl", "{:.2f}"),
    ("pp_tps", "pp tok/s", "{:.1f}"),
    ("tg_tps", "tg tok/s", "{:.1f}"),
    ("tg_speedup", "tg vs ref", "{:.2f}x"),
    ("ttft_s", "TTFT s", "{:.3f}"),
    ("load_s", "load s", "{:.2f}"),
    ("size_mib", "size MiB", "{:.1f}"),
    ("peak_rss_mib", "RSS MiB", "{:.0f}"),
]


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # {"median": x, "spread": y}
        med = value.get("median")
        return "-" if med is None else fmt.format(med) + (f" ±{value['spread']:.2g}" if value.get("spread") is not None else "")
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def bench_table(result: BenchResult) -> str:
    """A Markdown table: one row per model, the measured metrics as columns, then protocol and notes."""
    cols = [c for c in _COLUMNS if any(c[0] in m for m in result.models.values())]
    lines = ["| model | " + " | ".join(c[1] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, metrics in result.models.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(metrics.get(k), f) for k, _, f in cols) + " |")
    env = ", ".join(f"{k}={v}" for k, v in result.environment.items())
    lines += ["", f"runtime: {result.runtime} ({env})"]
    lines += [f"protocol: {k}: {v}" for k, v in result.protocol.items()]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
