"""Pick by budget: a file-size budget -> the measured configuration with the best measured quality whose
file fits, for the user's own model (`build --size`, `plan --size`).

The configurations are the frontier's rows (budget_table.py). A row's file on another model is
estimated before building from that model's config alone (sizing.py): its embedding at the bits per
weight of the export type, its other weights at the bits per weight the row's file spends on them on
the default model, its vocabulary at the default file's metadata per entry (budget_table.Row.file_bytes);
its quality is its perplexity over the dense model's in the same run, measured on the default model. The choice: the lowest perplexity ratio among
the rows that fit; ties (equal to 4 decimals) go to the smaller file, then to the table's order. The
settings a user gave that a row decides (pruning pattern, recovery, QA-LaCo type, export target and
type, importance matrix) narrow the rows to those that agree with them. The chosen row's settings are
applied like a preset's (presets.layer: under the config file and the flags).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from laco_deploy.budget_table import MEASURED_ON, ROWS, SOURCES, ModelShape, Row, settings
from laco_deploy.config import PruneConfig
from laco_deploy.errors import ConfigError

MIB = 2**20
# the settings a row decides, by section; a user's value for one of them narrows the rows
DECIDED = {"prune": ("method", "sparsity", "pattern", "structured", "targets"), "compensate": ("method", "quant_aware"),
           "export": ("target", "quant", "imatrix")}
PATTERN = ("sparsity", "pattern", "structured", "targets")  # together one pruning pattern
RULE = ("the lowest measured perplexity / dense perplexity among the configurations whose estimated file fits; "
        "ties (equal to 4 decimals): the smaller file, then the table's order")
# bare K/M/G are binary (as ls -h and llama.cpp print sizes), KB/MB/GB decimal
UNITS = {"b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": MIB, "mib": MIB, "mb": 10**6,
         "g": 2**30, "gib": 2**30, "gb": 10**9}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*")


def parse_size(text: str) -> int:
    """Bytes of a size budget such as 90MiB, 90M (binary), 90MB or 0.09GB (decimal), 1.5GiB."""
    m = _SIZE.fullmatch(str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(f"size budget {text!r} is not a file size: write a number and a unit, e.g. 90MiB or 90M "
                          "(2^20 bytes), 90MB or 0.09GB (10^6, 10^9 bytes), 1.5GiB")
    size = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if size < 1:
        raise ConfigError(f"size budget {text!r} is 0 bytes: give the largest file you can ship, e.g. 90MiB")
    return size


@dataclass(frozen=True)
class Candidate:
    """A measured row and its estimated file for the user's model."""

    row: Row
    est_bytes: int
    index: int  # in ROWS: the last tie-break

    @property
    def rank(self) -> tuple:
        return round(self.row.ppl_ratio, 4), self.est_bytes, self.index

    def record(self, budget_bytes: int, params: int, detail: bool = False) -> dict[str, Any]:
        """JSON-ready; `detail`: with its settings and measurement protocol (the chosen one)."""
        r, src = self.row, SOURCES[self.row.source]
        out = {"label": r.label, "quant": r.quant, "describe": describe(r), "est_mib": round(self.est_bytes / MIB, 2),
               "bits_per_weight": round(self.est_bytes * 8 / params, 3), "layer_bits": round(r.layer_bits, 3),
               "ppl_ratio": round(r.ppl_ratio, 4),
               "fits": self.est_bytes <= budget_bytes, "measured_mib": round(r.size_mib, 2), "measured_ppl": r.ppl,
               "dense_ppl": src.dense_ppl, "source": f'benchmarks/RESULTS.md "{src.section}"'}
        return {**out, "protocol": src.protocol, "settings": settings(r)} if detail else out


@dataclass(frozen=True)
class Choice:
    budget: str  # as the user wrote it
    budget_bytes: int
    shape: ModelShape  # the user's model
    chosen: Candidate
    candidates: tuple[Candidate, ...]  # every row that agrees with the given settings, best first
    given: dict[str, Any]

    @property
    def settings(self) -> dict[str, dict[str, Any]]:
        """The chosen row's config-file sections (for presets.layer)."""
        return settings(self.chosen.row)

    def record(self) -> dict[str, Any]:
        """JSON-ready: what was chosen, why, from which candidates (the manifest's `size_budget`)."""
        fits = [c for c in self.candidates if c.est_bytes <= self.budget_bytes]
        n = self.shape.params
        return {"budget": self.budget, "budget_bytes": self.budget_bytes, "budget_mib": round(self.budget_bytes / MIB, 2),
                "model": {"params": n, "embed": self.shape.embed, "vocab": self.shape.vocab},
                "measured_on": MEASURED_ON, "rule": RULE,
                "given": {k: list(v) if isinstance(v, tuple) else v for k, v in self.given.items()},
                "chosen": self.chosen.record(self.budget_bytes, n, detail=True), "fitting": len(fits),
                "candidates": [c.record(self.budget_bytes, n) for c in self.candidates]}


def describe(row: Row) -> str:
    """'structured 30% of FFN channels + LaCo, gguf q4_k_m' for a row."""
    family, _, recovery = row.label.partition("+")
    prune = settings(row)["prune"]
    if family in ("dense", "dense-imatrix"):
        what = "dense" + (" with an importance matrix" if family == "dense-imatrix" else "")
    elif "structured" in prune:
        what = f"structured {prune['structured']:.0%} of FFN channels" + ("" if family.endswith("ffn") else " and KV head groups")
    else:
        what = prune.get("pattern") or f"Wanda {prune['sparsity']:.0%} unstructured"
    kind, _, qa_type = recovery.partition("-")
    rec = {"": "", "laco": " + LaCo", "qa": f" + QA-LaCo {qa_type}",
           "qaw": f" + QA-LaCo {qa_type} through the importance matrix"}[kind]
    return f"{what}{rec}, {settings(row)['export']['target']} {row.quant}"


def given_settings(file_values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The decided settings ("section.field" -> value) the config file or the flags set (None = unset)."""
    out: dict[str, Any] = {}
    for section, fields in DECIDED.items():
        values = file_values.get(section)
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items() if k in fields})
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if value is not None and field in DECIDED.get(section, ()):
            out[key] = value
    return out


def _pattern(prune: dict[str, Any]) -> tuple:
    """One pruning pattern from prune settings (PruneConfig's defaults where unset; a value of the wrong
    type, e.g. from a YAML file, stays as it is and matches no row)."""
    base = PruneConfig()
    get = lambda k: prune.get(k, getattr(base, k))  # noqa: E731
    num = lambda v: round(float(v), 6) if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # noqa: E731
    targets = get("targets")
    targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else \
        tuple(targets) if isinstance(targets, (list, tuple)) else targets
    if get("structured") is not None:
        return "structured", num(get("structured")), targets
    if get("pattern") is not None:
        return "pattern", get("pattern"), targets
    return "unstructured", num(get("sparsity")), targets


def _norm(key: str, value: Any) -> Any:
    return value.lower() if key == "export.quant" and isinstance(value, str) else value


def disagrees(row: Row, given: dict[str, Any]) -> list[str]:
    """The given settings that `row` would change (empty: the row agrees with all of them)."""
    sections = settings(row)
    bad = [k for k, v in given.items() if k.partition(".")[2] not in PATTERN
           and _norm(k, sections[k.partition(".")[0]].get(k.partition(".")[2])) != _norm(k, v)]
    user_pattern = {k.partition(".")[2]: v for k, v in given.items() if k.startswith("prune.") and k[6:] in PATTERN}
    if user_pattern and _pattern(user_pattern) != _pattern(sections["prune"]):
        bad += [f"prune.{k}" for k in user_pattern]
    return bad


def candidates(shape: ModelShape, given: dict[str, Any]) -> list[Candidate]:
    """Every row that agrees with `given`, with its estimated file for a model of `shape`, best first."""
    rows = [Candidate(r, r.file_bytes(shape), i) for i, r in enumerate(ROWS) if not disagrees(r, given)]
    if not rows:
        measured = {k: sorted({str(settings(r)[k.partition('.')[0]].get(k.partition('.')[2])) for r in ROWS}) for k in given}
        raise ConfigError("no measured configuration has " + " and ".join(f"{k} {v!r}" for k, v in given.items())
                          + " (measured: " + "; ".join(f"{k} {', '.join(v)}" for k, v in measured.items())
                          + "): leave those settings to the size budget or build without one")
    return sorted(rows, key=lambda c: c.rank)


def choose(budget: str, shape: ModelShape, given: dict[str, Any] | None = None) -> Choice:
    """The best measured configuration whose estimated file for a model of `shape` fits `budget`
    (text, parse_size); ConfigError naming the smallest achievable size when none fits."""
    budget_bytes = parse_size(budget)
    given = dict(given or {})
    cands = candidates(shape, given)
    fits = [c for c in cands if c.est_bytes <= budget_bytes]
    if not fits:
        small = min(cands, key=lambda c: (c.est_bytes, c.rank))
        narrowed = " with " + ", ".join(f"{k} {v}" for k, v in given.items()) if given else ""
        raise ConfigError(f"no measured configuration{narrowed} fits the size budget {budget} ({budget_bytes / MIB:.1f} "
                          f"MiB) for this model ({shape.params / 1e6:.1f} M parameters): the smallest achievable is "
                          f"{math.ceil(small.est_bytes / MIB * 10) / 10:.1f} MiB ({describe(small.row)}); give a budget of at least that")
    return Choice(budget, budget_bytes, shape, fits[0], tuple(cands), given)


def shape_of(sizes: dict[str, int]) -> ModelShape:
    """ModelShape from sizing.weight_bytes (fp32 bytes; tied weights once, an untied head apart)."""
    from laco_deploy.sizing import FP32

    return ModelShape(sizes["total"] // FP32, (sizes["embed"] + sizes["head"]) // FP32, sizes["vocab"])


def model_shape(spec: str, trust_remote_code: bool = False) -> ModelShape:
    """The ModelShape of the model `spec` from its config alone (no weights read)."""
    from laco_deploy.models import check_source, local_model_dir
    from laco_deploy.sizing import model_bytes

    check_source(spec, allow_pickle=True, trust_remote_code=trust_remote_code)  # reads no weights: pickles are fine
    return shape_of(model_bytes(local_model_dir(spec), trust_remote_code))


def without(values: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """Config-file values less the "section.field" `keys` (a chosen row that agrees with them sets them)."""
    out = {}
    for section, v in values.items():
        out[section] = {k: x for k, x in v.items() if f"{section}.{k}" not in keys} if isinstance(v, dict) else v
    return out


def _row_line(c: dict[str, Any]) -> str:
    return (f"{c['label'] + ' ' + c['quant']:<26} {c['est_mib']:8.1f} {c['bits_per_weight']:6.2f} {c['ppl_ratio']:9.3f}  "
            f"{'yes' if c['fits'] else 'no':<4} {c['source'].removeprefix('benchmarks/RESULTS.md ').split(' (')[0]}\"")


def explain(rec: dict[str, Any], full: bool = False) -> list[str]:
    """Why the budget chose what it chose, from a Choice.record(): the choice, the rule, the measurement
    and the better configurations that did not fit; `full`: every candidate as a table."""
    c = rec["chosen"]
    better = [x for x in rec["candidates"] if not x["fits"] and x["ppl_ratio"] < c["ppl_ratio"]]
    model = rec["model"]
    lines = [f"size budget      {rec['budget']} = {rec['budget_mib']:.1f} MiB for a model of {model['params'] / 1e6:.1f} M "
             f"parameters ({model['embed'] / model['params']:.0%} embedding, vocabulary {model['vocab']})",
             f"chosen           {c['describe']} ({c['label']}): estimated {c['est_mib']:.1f} MiB "
             f"({c['bits_per_weight']:.2f} bits per weight; {c['layer_bits']:.2f} outside the embedding), "
             f"perplexity {c['ppl_ratio']:.3f} x dense",
             f"why              {rec['rule']}; {rec['fitting']} of {len(rec['candidates'])} measured configurations fit",
             f"measured         on {rec['measured_on']}: {c['measured_mib']:.1f} MiB, perplexity {c['measured_ppl']} vs dense "
             f"{c['dense_ppl']} ({c['protocol']}; {c['source']})"]
    if rec.get("given"):
        lines.append("narrowed by      " + ", ".join(f"{k} {v}" for k, v in rec["given"].items()))
    if better:
        lines.append("better, too big  " + "; ".join(f"{x['label']} {x['quant']} {x['est_mib']:.1f} MiB {x['ppl_ratio']:.3f} x"
                                                     for x in better[:3]))
    if full:
        lines.append(f"{'candidate':<26} {'est MiB':>8} {'bits/w':>6} {'ppl/dense':>9}  fits source (benchmarks/RESULTS.md)")
        lines += [_row_line(x) for x in rec["candidates"]]
    return lines
