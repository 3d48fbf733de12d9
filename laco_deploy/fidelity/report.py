"""Render a fidelity result as fidelity.json, fidelity.md (a pull-request comment) and
fidelity.html (one self-contained page: tables plus figures embedded as base64 PNG).

Renderers take the result as a plain dict (what fidelity.json holds), so a report can be
re-rendered from a saved JSON file. Every write is atomic.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from pathlib import Path
from typing import Any

from laco_deploy.fidelity.gates import gate_message
from laco_deploy.fidelity.plots import kl_distribution_png, layer_curves_png
from laco_deploy.fidelity.verdicts import worse_than_pruned
from laco_deploy.fsutil import is_marked, mark_folder, write_json, write_text

_HEAD = ("candidate", "runtime", "KL mean", "KL median", "KL p99", "KL max", "top-1", "Δp(top)", "ppl", "ppl ratio", "gates")


def write_reports(result, report_dir: Path) -> dict[str, Path]:
    """Write the three reports into `report_dir` (created and marked as laco-deploy's if needed); return kind -> path."""
    data = result.to_dict() if hasattr(result, "to_dict") else result
    report_dir = mark_folder(Path(report_dir))  # so a rerun may rewrite its reports, and nothing else replaces it
    paths = {"json": report_dir / "fidelity.json", "md": report_dir / "fidelity.md", "html": report_dir / "fidelity.html"}
    write_json(paths["json"], _json_safe(data))
    write_text(paths["md"], markdown(data))
    write_text(paths["html"], html_page(data))
    for path in paths.values():  # temp files are created 0600; reports are meant to be shared
        os.chmod(path, 0o644)
    return paths


def is_report_folder(path: Path) -> bool:
    """Whether laco-deploy wrote the folder `path` (a report or build folder, marked when made; a report
    folder of an older version: only the three reports, fidelity.json ours). Fidelity writes into such a
    folder again; into any other non-empty folder it does not (fsutil.check_output, kind "into")."""
    path = Path(path)
    if is_marked(path):
        return True
    names = {f.name for f in path.iterdir()} if path.is_dir() else set()
    if not names or not names <= {"fidelity.json", "fidelity.md", "fidelity.html"} or "fidelity.json" not in names:
        return False
    try:
        doc = json.loads((path / "fidelity.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "laco_deploy" in (doc.get("versions") or {}) and "schema_version" in doc


def _json_safe(obj: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN or Infinity."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def _gate_status(data: dict[str, Any], label: str) -> str:
    gates = [g for g in data["gates"] if g["candidate"] == label]
    if not gates:
        return "no gates"
    failed = [g["name"] for g in gates if not g["passed"]]
    return "pass" if not failed else "FAIL: " + ", ".join(failed)


def table_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """The summary table as text cells: the dense model first, then one row per candidate."""
    dense = data["dense"]
    rows = [("dense", "pytorch", "0", "0", "0", "0", "100.0%", "0", _f(dense["ppl"], ".3f"), "1.000", "")]
    worse = worse_than_pruned(data["candidates"])
    for label, c in data["candidates"].items():
        m = c["metrics"]
        kl = m["kl"]
        rows.append((label + (" (WORSE than pruned)" if label in worse else ""), c["runtime"], _f(kl["mean"], ".3g"), _f(kl["median"], ".3g"), _f(kl["p99"], ".3g"),
                     _f(kl["max"], ".3g"), _f(100 * m["top1"], ".1f") + "%", _f(m["p_top_delta"], "+.3g"),
                     _f(m["ppl"], ".3f"), _f(m["ppl_ratio"], ".3f"), _gate_status(data, label)))
    return rows


def domain_rows(data: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Perplexity, KL mean and top-1 per evaluation domain: (header, rows), the dense model first.
    Empty when only one domain was evaluated (the main table says it all)."""
    domains = list(data["dense"].get("domains") or {})
    if len(domains) < 2:
        return (), []
    inside = {d["label"] for d in data["settings"].get("domains", []) if d.get("in_domain")}
    names = [f"{d} ({'in-domain' if d in inside else 'out-of-domain'})" for d in domains]
    head = ("model",) + tuple(f"{n} {m}" for n in names for m in ("ppl", "KL", "top-1"))
    rows = [("dense",) + tuple(c for d in domains for c in (_f(data["dense"]["domains"][d]["ppl"], ".2f"), "0", "100.0%"))]
    for label, c in data["candidates"].items():
        per = c.get("domains") or {}
        cells = []
        for d in domains:
            m = per.get(d)
            cells += ([_f(m["ppl"], ".2f"), _f(m["kl_mean"], ".3g"), _f(100 * m["top1"], ".1f") + "%"] if m else ["-"] * 3)
        rows.append((label,) + tuple(cells))
    return head, rows


def _domain_markdown(data: dict[str, Any]) -> list[str]:
    head, rows = domain_rows(data)
    if not rows:
        return []
    return ["", "Per evaluation domain (in-domain: a genre the calibration text covers, never the same documents; out-of-domain: a genre calibration never saw):", "",
            "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)] + ["| " + " | ".join(r) + " |" for r in rows]


def _setting_line(data: dict[str, Any]) -> str:
    s = data["settings"]
    return (f"dense `{data['dense']['model']}` · eval `{s['eval']}`: {s['windows']} windows × {s['seqlen']} tokens "
            f"(tokens sha256 {s['tokens_sha256'][:12]}) · device {s['device']} · KL in nats, per token; "
            "Δp(top) = mean change of the dense top token's probability")


def markdown(data: dict[str, Any]) -> str:
    """A compact Markdown summary: one table row per model, the gate verdicts, per-layer highlights."""
    verdict = "passed" if data["passed"] else "FAILED"
    lines = [f"### Fidelity vs dense model: {verdict if data['gates'] else 'no gates set'}", "",
             "| " + " | ".join(_HEAD) + " |", "|---|---|" + "---:|" * 8 + "---|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    verdicts = verdict_lines(data)
    if verdicts:
        lines += [""] + [f"- **{v}**" if loud else f"- {v}" for v, loud in verdicts]
    lines += _domain_markdown(data)
    lines += ["", _setting_line(data)]
    lines += _zeroshot_markdown(data)
    if data["gates"]:
        lines += [""] + _gate_lines(data["gates"])
    layer_lines = _layer_highlights(data)
    if layer_lines:
        lines += ["", "Per-layer hidden states (PyTorch candidates):"] + [f"- {x}" for x in layer_lines]
    lines += [f"- note: {n}" for n in data.get("notes", [])]
    return "\n".join(lines) + "\n"


def verdict_lines(data: dict[str, Any]) -> list[tuple[str, bool]]:
    """(line, loud): the dense PyTorch vs runtime check, then every candidate worse than the pruned model."""
    out = []
    rec = data.get("runtime_agreement")
    if rec:
        out.append((rec["message"], not rec["agree"]))
    out += [(f"{label}: {why}", True) for label, why in worse_than_pruned(data["candidates"]).items()]
    return out


def _gate_lines(gates: list[dict[str, Any]]) -> list[str]:
    """Each failed gate in full (which, by how much); the passed ones folded into one line."""
    lines = [f"- **{gate_message(g)}**" for g in gates if not g["passed"]]
    passed: dict[str, list[str]] = {}
    for g in gates:
        if g["passed"]:
            passed.setdefault(f"{g['name']} {'<=' if g['name'].startswith('max') else '>='} {g['threshold']:g}", []).append(g["candidate"])
    if passed:
        lines.append("- passed: " + "; ".join(f"{name} ({', '.join(labels)})" for name, labels in passed.items()))
    return lines


def _layer_highlights(data: dict[str, Any]) -> list[str]:
    out = []
    for label, c in data["candidates"].items():
        rows = c.get("per_layer")
        if not rows:
            continue
        worst = max(rows, key=lambda r: r["rel_error"])
        out.append(f"{label}: last layer rel. error {rows[-1]['rel_error']:.3f}, cosine {rows[-1]['cosine']:.4f}; "
                   f"worst rel. error {worst['rel_error']:.3f} at layer {worst['layer'] + 1}")
    return out


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 16px}th,td{border:1px solid #ccc;padding:4px 8px;font-size:14px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}.pass{color:#17702a;font-weight:600}
.fail{color:#b00020;font-weight:600}img{max-width:100%;border:1px solid #eee}code{font-size:13px}
h2{margin-top:28px;border-bottom:1px solid #ddd}"""


def img_tag(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def html_table(head, rows: list[tuple[str, ...]], numeric_cols: range = range(0)) -> str:
    """An HTML table of text cells; `numeric_cols` are right-aligned; pass/FAIL cells coloured."""
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            cls = "n" if i in numeric_cols else ""
            if cell.startswith("FAIL"):
                cls = "fail"
            elif cell == "pass":
                cls = "pass"
            cells.append(f'<td class="{cls}">{html.escape(cell)}</td>' if cls else f"<td>{html.escape(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def html_page(data: dict[str, Any]) -> str:
    """One self-contained HTML page: no scripts, no external fonts, styles or images."""
    esc = html.escape
    verdict = ("<span class='pass'>all gates passed</span>" if data["passed"] else "<span class='fail'>a gate failed</span>") \
        if data["gates"] else "no gates set"
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Fidelity report</title><style>{CSS}</style></head><body>",
             f"<h1>Fidelity vs dense model</h1><p>{verdict}</p><p>{esc(_setting_line(data).replace('`', ''))}</p>",
             html_table(_HEAD, table_rows(data), range(2, 10))]
    if verdict_lines(data):
        parts.append("<ul>" + "".join(f"<li class='{'fail' if loud else 'pass'}'>{esc(v)}</li>" for v, loud in verdict_lines(data))
                     + "</ul>")
    d_head, d_rows = domain_rows(data)
    if d_rows:
        parts += ["<h2>Per evaluation domain</h2><p>In-domain: a genre the calibration text covers (never the same documents); out-of-domain: a genre calibration never saw.</p>",
                  html_table(d_head, d_rows, range(1, len(d_head)))]
    if data["gates"]:
        parts.append("<ul>" + "".join(f"<li class='{'pass' if g['passed'] else 'fail'}'>{esc(gate_message(g))}</li>"
                                      for g in data["gates"]) + "</ul>")
    parts += _zeroshot_html(data)
    curves = layer_curves_png(data["candidates"])
    parts.append("<h2>Per-layer hidden-state error</h2>")
    parts.append(img_tag(curves, "relative error and cosine per decoder layer") if curves is not None
                 else "<p>No PyTorch candidate with the dense model's depth and width: no per-layer curves.</p>")
    parts += [f"<p>{esc(x)}</p>" for x in _layer_highlights(data)]
    parts += ["<h2>Per-token KL distribution</h2>", img_tag(kl_distribution_png(data["candidates"]), "per-token KL histogram and CDF")]
    parts += _details_html(data)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _details_html(data: dict[str, Any]) -> list[str]:
    rows = [("dense", "pytorch (reference)", data["dense"]["path"], data["dense"]["sha256"] or "-")]
    rows += [(label, c["runtime"], c["path"], c["sha256"] or "-") for label, c in data["candidates"].items()]
    out = ["<h2>Inputs</h2>", html_table(("label", "runtime / source", "path", "sha256"), rows)]
    out += ["<h2>Versions</h2>", html_table(("package", "version"), sorted(data["versions"].items()))]
    settings = [(k, str(v)) for k, v in data["settings"].items()]
    out += ["<h2>Settings</h2>", html_table(("setting", "value"), settings)]
    if data.get("notes"):
        out.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in data["notes"]) + "</ul>")
    out.append(f"<p>wall time {data['wall_s']:.1f} s · schema version {data['schema_version']}</p>")
    return out


_ZS_TITLE = "Zero-shot accuracy (lm-evaluation-harness, 0-shot; % ± standard error)"


def _zeroshot_markdown(data: dict[str, Any]) -> list[str]:
    """The dense vs candidates accuracy table per task, the means over tasks, then what it was measured on."""
    from laco_deploy.fidelity import zeroshot

    zs = data.get("zeroshot")
    if not zs:
        return []
    head, rows = zeroshot.table(zs)
    lines = ["", f"{_ZS_TITLE}:", "", "| " + " | ".join(head) + " |", "|---|---|---:|" + "---:|" * (len(head) - 3)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""] + [f"- {n}" for n in zeroshot.notes(zs)]


def _zeroshot_html(data: dict[str, Any]) -> list[str]:
    from laco_deploy.fidelity import zeroshot

    zs = data.get("zeroshot")
    if not zs:
        return []
    head, rows = zeroshot.table(zs)
    return [f"<h2>{html.escape(_ZS_TITLE)}</h2>", html_table(head, rows, range(2, len(head))),
            "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in zeroshot.notes(zs)) + "</ul>"]
