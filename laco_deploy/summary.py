"""The end-of-build summary: key numbers pulled from the manifest's stage records."""

from __future__ import annotations

from typing import Any

from laco_deploy.budget import explain
from laco_deploy.fidelity.gates import verdict
from laco_deploy.fidelity.verdicts import gaps_withheld, worse_domains, worse_than_pruned


def _median(v: Any) -> Any:
    return v.get("median") if isinstance(v, dict) else v


def summarize(manifest: dict[str, Any]) -> dict[str, Any]:
    """A flat, JSON-ready digest: what was built, where, and the key metrics."""
    stages = manifest.get("stages", {})
    res = lambda name: (stages.get(name) or {}).get("result") or {}  # noqa: E731
    prune, comp, export, fid, bench = (res(s) for s in ("prune", "compensate", "export", "fidelity", "bench"))
    out: dict[str, Any] = {
        "sparsity": (comp or prune).get("sparsity"),
        "pattern": prune.get("pattern"),
        "recovered_with": manifest.get("config", {}).get("compensate", {}).get("method"),
        "exported": (export.get("model") or {}).get("path"),
        "export_size_mib": round((export.get("model") or {}).get("size_bytes", 0) / 2**20, 1),
        "stage_wall_s": {k: v.get("wall_s") for k, v in stages.items()},
        "stage_peak_mib": {k: v.get("peak_mib") for k, v in stages.items()},
        "memory_kind": next((v.get("memory_kind") for v in stages.values() if v.get("memory_kind")), None),
        "stage_reused": [k for k, v in stages.items() if v.get("reused")],
    }
    if manifest.get("size_budget"):
        out["size_budget"] = size_digest(manifest["size_budget"], (export.get("model") or {}).get("size_bytes"))
    cands = {label: c.get("metrics", {}) for label, c in fid.get("candidates", {}).items()}
    if fid:
        out["ppl_pytorch"] = {"dense": fid.get("dense", {}).get("ppl")}
        for label, m in cands.items():
            out["ppl_pytorch"][label] = m.get("ppl")
        out["kl_mean"] = {label: m.get("kl", {}).get("mean") for label, m in cands.items()}
        out["top1"] = {label: m.get("top1") for label, m in cands.items()}
        out["worse_than_pruned"] = worse_than_pruned(fid.get("candidates", {}))
        out["runtime_agreement"] = fid.get("runtime_agreement")
        out.update(_domain_summary(fid))
        out["gates"] = fid.get("gates", [])
        out["gates_passed"] = verdict(fid)
        if fid.get("zeroshot"):
            out["zeroshot"] = zeroshot_digest(fid["zeroshot"])
    if bench:
        models = bench.get("models", {})
        out["bench_child_peak_mib"] = max((m.get("peak_rss_mib") or 0 for m in models.values()), default=None)
        out["runtime"] = bench.get("runtime")
        out["ppl_runtime"] = {label: _median(m.get("ppl")) for label, m in models.items()}
        out["tg_tps"] = {label: _median(m.get("tg_tps")) for label, m in models.items()}
        out["pp_tps"] = {label: _median(m.get("pp_tps")) for label, m in models.items()}
    return out


def size_digest(rec: dict[str, Any], file_bytes: int | None) -> dict[str, Any]:
    """The size-budget choice (budget.Choice.record) and whether the exported file kept to the budget
    (the estimate carries bits per weight measured on the default model over to this one)."""
    within = None if file_bytes is None else file_bytes <= rec["budget_bytes"]
    return {**rec, "file_mib": None if file_bytes is None else round(file_bytes / 2**20, 2), "within": within}


def size_lines(digest: dict[str, Any]) -> list[str]:
    """The summary's lines on the size budget: the choice and why, then the file against the budget."""
    lines = explain(digest)
    if digest.get("within") is not None:
        verdict = "within the budget" if digest["within"] else (
            "OVER the budget: the size measured on the default model did not carry over; give a smaller size budget")
        lines.append(f"file             {digest['file_mib']:.1f} MiB (estimated {digest['chosen']['est_mib']:.1f}): {verdict}")
    return lines + [""]


def zeroshot_digest(zs: dict[str, Any]) -> dict[str, Any]:
    """The zero-shot row: per model the accuracy (acc_norm where the tasks define it, else acc) of the one
    task, or its mean over the tasks, with its standard error; what was scored; what it cost."""
    models = zs.get("models") or {}
    if not models:
        return {}
    single = len(zs["tasks"]) == 1

    def score(m: dict[str, Any]) -> dict[str, Any]:
        return next(iter(m["tasks"].values()))["metrics"] if single else m["mean"]

    first = score(next(iter(models.values())))
    metric = "acc_norm" if "acc_norm" in first else "acc" if "acc" in first else next(iter(first), None)
    return {"tasks": list(zs["tasks"]), "metric": metric, "docs": sum(t["docs"] for t in zs["tasks"].values()),
            "limit": zs["settings"].get("limit"), "wall_s": round(sum(m.get("wall_s", 0.0) for m in models.values()), 1),
            "models": {label: (score(m).get(metric) or {}) for label, m in models.items()}}


def zeroshot_line(z: dict[str, Any]) -> str:
    """`zero-shot  TASK acc (N docs, S s): dense 50.0 ± 5.3  pruned ...` (percent)."""
    docs = f"first {z['limit']} docs each" if z.get("limit") else f"{z['docs']} docs"
    cells = "  ".join(f"{label} {100 * m['value']:.1f}" + (f" ± {100 * m['stderr']:.1f}" if m.get("stderr") is not None else "")
                      for label, m in z["models"].items() if m.get("value") is not None)
    return f"zero-shot        {', '.join(z['tasks'])} {z['metric']} ({docs}, {z['wall_s']:.0f} s): {cells}"


def _domain_summary(fid: dict[str, Any]) -> dict[str, Any]:
    """Perplexity per evaluation domain for every model, and the share of the pruned-to-dense gap
    each candidate closes there (in-domain and out-of-domain side by side)."""
    dense = (fid.get("dense") or {}).get("domains") or {}
    if not dense:
        return {}
    ppl = {"dense": {d: v.get("ppl") for d, v in dense.items()}}
    for label, c in (fid.get("candidates") or {}).items():
        ppl[label] = {d: v.get("ppl") for d, v in (c.get("domains") or {}).items()}
    gap: dict[str, dict[str, float]] = {}
    pruned = ppl.get("pruned", {})
    withheld = gaps_withheld(fid)
    worse = worse_than_pruned(fid.get("candidates") or {})
    worse_here = worse_domains(fid.get("candidates") or {})
    for label, row in ppl.items():
        if label in ("dense", "pruned") or withheld or label in worse:
            continue
        gap[label] = {d: (pruned[d] - p) / (pruned[d] - ppl["dense"][d]) for d, p in row.items()
                      if p is not None and pruned.get(d) is not None and pruned[d] != ppl["dense"][d]
                      and d not in worse_here.get(label, {})}
    in_domain = [d["label"] for d in (fid.get("settings") or {}).get("domains", []) if d.get("in_domain")]
    return {"ppl_by_domain": ppl, "gap_closed_by_domain": gap, "worse_by_domain": worse_here, "in_domain": in_domain,
            "gap_withheld": withheld}


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """The dense PyTorch vs runtime check: one line, shouted when they disagree."""
    rec = summary.get("runtime_agreement")
    if not rec:
        return []
    return [("WARNING: " if not rec.get("agree") else "") + rec.get("message", ""), ""]


def domain_lines(summary: dict[str, Any]) -> list[str]:
    """The per-domain perplexity table of the summary (empty with a single evaluation domain)."""
    ppl = summary.get("ppl_by_domain") or {}
    domains = list(ppl.get("dense") or {})
    if len(domains) < 2:
        return []
    inside = set(summary.get("in_domain") or [])
    domains.sort(key=lambda d: d not in inside)  # in-domain first
    gap, worse_here = summary.get("gap_closed_by_domain") or {}, summary.get("worse_by_domain") or {}
    rows = [["model"] + [d + (" (in)" if d in inside else " (out)") for d in domains]]
    for label, row in ppl.items():
        cells = []
        for d in domains:
            cell = _fmt(row.get(d))
            if d in gap.get(label, {}):
                cell += f" ({gap[label][d]:.0%})"
            elif d in worse_here.get(label, {}):
                cell += " (WORSE)"
            cells.append(cell)
        rows.append([label] + cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["perplexity by evaluation domain (PyTorch / exported model; % = share of the pruned-to-dense gap closed;",
             "in = a genre the calibration text covers, out = a genre calibration never saw)"]
    if summary.get("gap_withheld"):
        lines.append("no gap-closed shares: PyTorch and the runtime disagree on the dense model (above)")
    lines += [f"no gap-closed share for {label}: it is {why}" for label, why in (summary.get("worse_than_pruned") or {}).items()
              if label in ppl]
    lines += [f"{label} is WORSE than pruned on {d}: {why}" for label, per in worse_here.items() if label in ppl
              for d, why in per.items()]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines + [""]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_lines(summary: dict[str, Any], root: str) -> list[str]:
    """Human-readable summary: where things are, then one row per model with its key numbers."""
    lines = [f"build folder     {root}",
             f"exported model   {summary.get('exported')} ({summary.get('export_size_mib')} MiB)",
             f"sparsity         {_fmt(summary.get('sparsity'))} ({summary.get('pattern')}), recovered with {summary.get('recovered_with')}",
             ""]
    if summary.get("size_budget"):
        lines += size_lines(summary["size_budget"])
    runtime = summary.get("runtime", "runtime")
    cols = [("ppl_pytorch", "ppl torch"), ("ppl_runtime", f"ppl {runtime}"), ("kl_mean", "KL mean"),
            ("top1", "top-1"), ("tg_tps", "gen tok/s"), ("pp_tps", "prompt tok/s")]
    labels: list[str] = []
    for key, _ in cols:
        for label in summary.get(key) or {}:
            if label not in labels:
                labels.append(label)
    worse = summary.get("worse_than_pruned") or {}
    rows = [["model"] + [title for _, title in cols] + (["vs pruned"] if worse else [])]
    for label in labels:
        rows.append([label] + [_fmt((summary.get(key) or {}).get(label)) for key, _ in cols]
                    + ([worse.get(label, "")] if worse else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines += verdict_lines(summary)
    lines += domain_lines(summary)
    if summary.get("zeroshot"):
        lines.append(zeroshot_line(summary["zeroshot"]))
    gates = summary.get("gates") or []
    if gates:
        lines.append("gates            " + "  ".join(
            f"{g.get('name')}: {'pass' if g['passed'] else 'FAIL'} ({_fmt(g.get('value'))} vs {_fmt(g.get('threshold'))})" for g in gates))
    else:
        lines.append("gates            none set (fidelity.max_kl, fidelity.min_top1, fidelity.max_ppl_ratio)")
    walls = summary.get("stage_wall_s", {})
    reused = set(summary.get("stage_reused", []))
    ran = sum(v for k, v in walls.items() if k not in reused and v is not None)
    lines.append("stages           " + "  ".join(f"{k}={'reused' if k in reused else ('-' if v is None else _fmt(v) + 's')}" for k, v in walls.items())
                 + f"  (total {_fmt(ran)}s)")
    peaks = {k: v for k, v in (summary.get("stage_peak_mib") or {}).items() if v is not None and k not in reused}
    if peaks:
        kind = "peak RSS" if summary.get("memory_kind") == "rss" else "peak CUDA memory"
        child = summary.get("bench_child_peak_mib")
        lines.append(f"{kind:<17}" + "  ".join(f"{k}={v:.0f} MiB" for k, v in peaks.items())
                     + f"  (max {max(peaks.values()):.0f} MiB"
                     + (f"; benchmark processes {child:.0f} MiB)" if child else ")"))
    return lines
