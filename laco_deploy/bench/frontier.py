"""The speed/quality frontier (benchmarks/frontier_bench.py): which models and weight types are
measured, and what the measurements say.

Pure functions over plain dicts, so that the plan, the goal checks and the report are unit-tested
without running a model. A *cell* is one model at one weight type on its runtime:

    {"model": "s30-all+laco", "quant": "q8_0", "runtime": "llama.cpp", "size_mib": ..., "ppl": ...,
     "tg_tps": ..., "pp_tps": ..., "peak_rss_mib": ..., "kl_mean": ..., "top1": ...,
     "domains": {"wikipedia": ppl, "fiction": ppl, ...}}
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from laco_deploy.config import FFN_LINEARS, PRUNABLE_LINEARS, PruneConfig
from laco_deploy.errors import ConfigError
from laco_deploy.targets import TARGETS, Target

DENSE = "dense"
# the dense model quantized by llama.cpp with an importance matrix of the calibration text (issue 32's
# rival: what `llama-imatrix` + `llama-quantize --imatrix` make); not a "+" label, so not a recovered model
DENSE_IMATRIX = "dense-imatrix"
TARGET_SETS = {"ffn": FFN_LINEARS, "all": PRUNABLE_LINEARS}  # --targets-sets: FFN channels only, or FFN + KV head groups
UNSTRUCTURED = {"wanda50": PruneConfig(method="wanda", sparsity=0.5), "2:4": PruneConfig(method="wanda", pattern="2:4")}
VARIANTS = ("pruned", "laco", "qa")


@dataclass(frozen=True)
class Spec:
    """One model of the frontier: dense, a pruned one, or a compensated one (`base` = its pruned model)."""

    label: str
    prune: PruneConfig | None = None  # set for pruned models
    base: str | None = None  # set for compensated models
    quant_aware: str | None = None  # QA-LaCo type; the model is then measured at that type only
    measured: bool = True  # False: built only as the base of compensated models (--variants without pruned)

    @property
    def family(self) -> str:
        return self.label.split("+")[0]


def target_of(quant: str) -> Target:
    """The export target writing weight type `quant` (GGUF and ONNX type names do not overlap)."""
    for target in TARGETS.values():
        if quant in target.quant_types:
            return target
    known = ", ".join(q for t in TARGETS.values() for q in t.quant_types)
    raise ConfigError(f"weight type {quant!r} is not one of {known}")


def plan_models(ratios: list[float], target_sets: list[str], variants: list[str], unstructured: list[str],
                qa_quants: list[str]) -> list[Spec]:
    """Dense first, then each pruned family followed by its compensated variants."""
    bad = [v for v in variants if v not in VARIANTS] + [t for t in target_sets if t not in TARGET_SETS] + \
          [u for u in unstructured if u not in UNSTRUCTURED]
    if bad:
        raise ConfigError(f"unknown {', '.join(bad)}: variants are {', '.join(VARIANTS)}; target sets "
                          f"{', '.join(TARGET_SETS)}; unstructured methods {', '.join(UNSTRUCTURED)}")
    if any(not 0.0 < r < 1.0 for r in ratios):
        raise ConfigError(f"structured ratios {ratios}: each must be in (0, 1)")
    families = [(f"s{round(r * 100)}-{t}", PruneConfig(method="wanda", structured=r, targets=TARGET_SETS[t]))
                for r in ratios for t in target_sets] + [(u, UNSTRUCTURED[u]) for u in unstructured]
    specs = [Spec(DENSE)]
    for family, prune in families:
        specs.append(Spec(family, prune=prune, measured="pruned" in variants))
        if "laco" in variants:
            specs.append(Spec(f"{family}+laco", base=family))
        if "qa" in variants:
            specs += [Spec(f"{family}+qa-{q}", base=family, quant_aware=q) for q in qa_quants]
    return specs


def plan_cells(specs: list[Spec], quants: list[str], dense_quants: list[str],
               imatrix_quants: list[str] = ()) -> list[tuple[str, str]]:
    """(model, quant) pairs: every model at every type, dense also at `dense_quants` (the equal-size
    comparison) and, as DENSE_IMATRIX, at `imatrix_quants` (llama.cpp k-quants with an importance
    matrix), a QA-LaCo model only at the type it was trained for. Grouped by type, dense first."""
    for q in [*quants, *dense_quants, *imatrix_quants]:
        target_of(q)
    bad = [q for q in imatrix_quants if q not in target_of(q).imatrix_quants]
    if bad:
        raise ConfigError(f"imatrix types {', '.join(bad)}: an importance matrix applies to GGUF k-quants only")
    cells = []
    for quant in dict.fromkeys([*quants, *dense_quants, *imatrix_quants]):
        if quant in imatrix_quants:
            cells.append((DENSE_IMATRIX, quant))
        for spec in specs:
            if not spec.measured:
                keep = False
            elif spec.quant_aware is not None:
                keep = spec.quant_aware == quant
            else:
                keep = quant in quants or spec.label == DENSE
            if keep:
                cells.append((spec.label, quant))
    return cells


def slug(label: str) -> str:
    """A file-name-safe form of a model label."""
    return label.replace("+", "_").replace(":", "-")


# ---- what the measurements say -----------------------------------------------------------------


def _find(cells: list[dict], model: str, quant: str) -> dict | None:
    return next((c for c in cells if c["model"] == model and c["quant"] == quant), None)


def gap_closed(pruned: float, recovered: float, dense: float) -> float:
    """Share of the perplexity gap to dense that recovery closes (1 = back to dense, 0 = no gain)."""
    return (pruned - recovered) / (pruned - dense)


def structured_goal(cells: list[dict], quant: str, ratio: int = 30, in_min: float = 0.6, out_min: float = 0.4,
                    speed_min: float = 1.15) -> list[dict[str, Any]]:
    """Issue 12 goal 1 per structured family at `ratio`%: LaCo closes >= in_min of the in-domain gap
    and >= out_min on each other domain (domain perplexities of the fidelity windows, all at `quant`),
    and decodes >= speed_min x dense at `quant`."""
    out = []
    dense = _find(cells, DENSE, quant)
    for c in cells:
        family = c["model"].split("+")[0]
        if not (c["model"] == f"{family}+laco" and family.startswith(f"s{ratio}-") and c["quant"] == quant):
            continue
        pruned = _find(cells, family, quant)
        if dense is None or pruned is None:
            continue
        for i, (domain, ppl) in enumerate(c["domains"].items()):
            share = gap_closed(pruned["domains"][domain], ppl, dense["domains"][domain])
            need = in_min if i == 0 else out_min
            out.append({"goal": f"{c['model']} {quant}: gap closed on {domain} (pruned {pruned['domains'][domain]:.1f} -> "
                                f"{ppl:.1f}, dense {dense['domains'][domain]:.1f})", "value": share, "need": need,
                        "op": ">=", "hit": share >= need, "fmt": "{:.0%}"})
        speed = c["tg_tps"] / dense["tg_tps"]
        out.append({"goal": f"{c['model']} {quant}: decode speed vs dense", "value": speed, "need": speed_min,
                    "op": ">=", "hit": speed >= speed_min, "fmt": "{:.2f}x"})
    return out


def equal_size_goal(cells: list[dict], tolerance: float = 0.02, rival: str = DENSE) -> list[dict[str, Any]]:
    """Issue 12 goal 2: a pruned + LaCo cell beats a dense cell of the same runtime that is at least
    as large (within `tolerance`: files of the same type differ by a few metadata bytes). For each
    recovered cell, the smallest such cell of `rival` (DENSE, or DENSE_IMATRIX: issue 32); one line each."""
    out = []
    for c in cells:
        if "+" not in c["model"]:
            continue
        dense = sorted((d for d in cells if d["model"] == rival and d["runtime"] == c["runtime"]
                        and d["size_mib"] >= c["size_mib"] * (1 - tolerance)), key=lambda d: d["size_mib"])
        if not dense:
            continue
        d = dense[0]
        out.append({"goal": f"{c['model']} {c['quant']} ({c['size_mib']:.0f} MiB, ppl {c['ppl']:.2f}) vs {rival} {d['quant']} "
                            f"({d['size_mib']:.0f} MiB, ppl {d['ppl']:.2f}): ppl ratio", "value": c["ppl"] / d["ppl"],
                    "need": 1.0, "op": "<", "hit": c["ppl"] < d["ppl"], "fmt": "{:.2f}"})
    return out


def qa_goal(cells: list[dict]) -> list[dict[str, Any]]:
    """Issue 12 goal 3: QA-LaCo at type q has lower runtime perplexity than LaCo exported at q."""
    out = []
    for c in cells:
        model, _, qa = c["model"].partition("+qa-")
        if not qa:
            continue
        plain = _find(cells, f"{model}+laco", c["quant"])
        if plain is not None:
            out.append({"goal": f"{model} {c['quant']}: QA-LaCo ppl {c['ppl']:.2f} vs LaCo-then-quantize {plain['ppl']:.2f}",
                        "value": c["ppl"] / plain["ppl"], "need": 1.0, "op": "<", "hit": c["ppl"] < plain["ppl"], "fmt": "{:.3f}"})
    return out


def goal_lines(goals: list[dict[str, Any]]) -> list[str]:
    return [f"{'HIT ' if g['hit'] else 'MISS'} {g['goal']}: {g['fmt'].format(g['value'])} "
            f"(need {g['op']} {g['fmt'].format(g['need'])})" for g in goals]


# ---- tables and the HTML page --------------------------------------------------------------------

HEAD = ("model", "runtime", "type", "size MiB", "ppl", "KL", "top-1", "tg tok/s", "tg x", "pp tok/s", "pp x", "peak RSS MiB")


def rows(cells: list[dict]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The frontier table: one row per cell; speed ratios against dense at the same type, and the
    per-domain perplexities of the fidelity windows as extra columns."""
    domains = list(next((c["domains"] for c in cells if c.get("domains")), {}))
    out = []
    for c in cells:
        dense = _find(cells, DENSE, c["quant"])
        tg_x = f"{c['tg_tps'] / dense['tg_tps']:.2f}" if dense else ""
        pp_x = f"{c['pp_tps'] / dense['pp_tps']:.2f}" if dense else ""
        out.append((c["model"], c["runtime"], c["quant"], f"{c['size_mib']:.1f}", f"{c['ppl']:.2f}", f"{c['kl_mean']:.3f}",
                    f"{c['top1']:.3f}", f"{c['tg_tps']:.1f}", tg_x, f"{c['pp_tps']:.0f}", pp_x, f"{c['peak_rss_mib']:.0f}",
                    *(f"{c['domains'][d]:.1f}" for d in domains)))
    return HEAD + tuple(f"ppl {d}" for d in domains), out


def markdown(cells: list[dict]) -> str:
    head, body = rows(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def curves(cells: list[dict]) -> dict[str, list[tuple[float, float, str]]]:
    """runtime/type -> [(decode tok/s, ppl, model)] for the plot."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    for c in cells:
        out.setdefault(f"{c['runtime']} {c['quant']}", []).append((c["tg_tps"], c["ppl"], c["model"]))
    return out


def html_page(cells: list[dict], goals: list[dict[str, Any]], settings: list[str]) -> str:
    """One self-contained page: settings, goals, the frontier plot and the table."""
    from laco_deploy.fidelity.plots import frontier_png
    from laco_deploy.fidelity.report import CSS, html_table, img_tag

    esc = html.escape
    head, body = rows(cells)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Speed/quality frontier</title>"
             f"<style>{CSS}</style></head><body><h1>Speed/quality frontier</h1>",
             "<ul>" + "".join(f"<li>{esc(s)}</li>" for s in settings) + "</ul>",
             img_tag(frontier_png(curves(cells)), "perplexity vs decode tokens per second, one curve per runtime and type"),
             "<h2>Goals</h2><ul>" + "".join(f"<li class='{'pass' if g['hit'] else 'fail'}'>{esc(line)}</li>"
                                            for g, line in zip(goals, goal_lines(goals))) + "</ul>",
             "<h2>All cells</h2>", html_table(head, body, range(3, len(head))), "</body></html>"]
    return "\n".join(parts) + "\n"
