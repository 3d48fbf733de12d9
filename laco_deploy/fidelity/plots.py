"""Figures for the HTML report, drawn from a fidelity result dict and returned as PNG bytes.

Uses matplotlib's object API (Figure + Agg canvas, no pyplot state), so rendering is thread-safe
and needs no display. Fonts are rasterised into the PNG: the report needs nothing external.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

KL_FLOOR = 1e-6  # log-scale plots start here; smaller KL values are counted as "below"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def colors(labels: list[str]) -> dict[str, str]:
    """A stable colour per candidate label, shared by every figure."""
    return {label: _COLORS[i % len(_COLORS)] for i, label in enumerate(labels)}


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def layer_curves_png(candidates: dict[str, dict[str, Any]]) -> bytes | None:
    """Relative error and cosine per decoder layer, one line per PyTorch candidate, side by side.
    None when no candidate has per-layer curves."""
    curves = {label: c["per_layer"] for label, c in candidates.items() if c.get("per_layer")}
    if not curves:
        return None
    col = colors(list(candidates))
    fig = Figure(figsize=(11, 4.2))
    ax_err, ax_cos = fig.subplots(1, 2)
    for label, rows in curves.items():
        x = [r["layer"] + 1 for r in rows]
        ax_err.plot(x, [r["rel_error"] for r in rows], marker="o", ms=3, color=col[label], label=label)
        ax_cos.plot(x, [r["cosine"] for r in rows], marker="o", ms=3, color=col[label], label=label)
    ax_err.set(title="Relative error of hidden states vs dense", xlabel="decoder layer (output of layer)",
               ylabel="||h_cand - h_dense|| / ||h_dense||  (mean over tokens)")
    ax_cos.set(title="Cosine similarity of hidden states vs dense", xlabel="decoder layer (output of layer)",
               ylabel="cos(h_cand, h_dense)  (mean over tokens)")
    ax_err.set_ylim(bottom=0)
    for ax in (ax_err, ax_cos):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(title="candidate")
    fig.suptitle("Per-layer fidelity (each candidate fed by its own previous layers)")
    return _png(fig)


def kl_distribution_png(candidates: dict[str, dict[str, Any]]) -> bytes:
    """Per-token KL(dense || candidate): histogram on log-spaced bins and the CDF, all candidates."""
    col = colors(list(candidates))
    fig = Figure(figsize=(11, 4.2))
    ax_hist, ax_cdf = fig.subplots(1, 2)
    for label, c in candidates.items():
        hist = c["kl_histogram"]
        total = max(sum(hist["counts"]), 1)
        below = hist["counts"][0] / total
        shares = [n / total for n in hist["counts"][1:]]
        ax_hist.stairs(shares, hist["edges"][1:], color=col[label], linewidth=1.5,
                       label=f"{label} ({below:.0%} below {KL_FLOOR:g})")
        q = c["kl_quantiles"]
        ax_cdf.plot([max(v, KL_FLOOR) for v in q["value"]], q["q"], color=col[label], label=label)
        mean = c["metrics"]["kl"]["mean"]
        ax_cdf.axvline(max(mean, KL_FLOOR), color=col[label], linestyle=":", linewidth=1)
    top = max((max(c["kl_quantiles"]["value"]) for c in candidates.values()), default=0.0)
    for ax in (ax_hist, ax_cdf):  # explicit limits: also readable when every KL is 0
        ax.set_xlim(KL_FLOOR / 2, max(top * 2, KL_FLOOR * 10))
    ax_hist.set(xscale="log", title="Distribution of per-token KL", xlabel="KL(dense || candidate) per token [nats]",
                ylabel="share of tokens per bin")
    ax_cdf.set(xscale="log", title="Cumulative distribution of per-token KL (dotted: mean)",
               xlabel="KL(dense || candidate) per token [nats]", ylabel="share of tokens with KL <= x")
    ax_cdf.set_ylim(0, 1.01)
    for ax in (ax_hist, ax_cdf):
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(title="candidate")
    return _png(fig)


def frontier_png(curves: dict[str, list[tuple[float, float, str]]]) -> bytes:
    """Perplexity against decode speed: one curve per runtime/type, points sorted by speed and
    labelled with their model. `curves`: name -> [(tok/s, ppl, model label)]."""
    col = colors(list(curves))
    fig = Figure(figsize=(11, 6))
    ax = fig.subplots()
    for name, points in curves.items():
        pts = sorted(points)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=col[name], label=name)
        for x, y, label in pts:
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", color=col[name])
    ax.set(yscale="log", title="Speed/quality frontier (lower right is better)", xlabel="decode speed [tokens/s]",
           ylabel="perplexity on the runtime (log scale)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(title="runtime and weight type")
    return _png(fig)
