"""Build presets: a goal a user can name (`build --preset NAME`) -> pruning pattern, ratio,
recovery and export type, chosen from the speed/quality frontier (benchmarks/frontier_bench.py,
numbers in benchmarks/RESULTS.md "Speed/quality frontier").

A preset is applied like a config file underneath the real one: preset < --config file < flags.
The pruning pattern is one choice: when the file or a flag names any of sparsity / pattern /
structured, the preset's pattern is dropped as a whole (a flag's --pattern 2:4 must not collide
with a preset's structured ratio). Likewise a preset's quant-aware type belongs to its export type:
when the file or a flag picks another target or type, it is dropped too (and the build's own
default for that type applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laco_deploy.config import FFN_LINEARS
from laco_deploy.errors import ConfigError

PATTERN_KEYS = ("sparsity", "pattern", "structured", "targets")  # prune fields that together pick the pattern


@dataclass(frozen=True)
class Preset:
    name: str
    goal: str  # one line for --help
    settings: dict[str, dict[str, Any]]  # config-file sections (prune, compensate, export, ...)
    # its numbers, from building it (build's own benchmark; benchmarks/RESULTS.md "Presets rebuilt")
    measured: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    # Wanda 50% + LaCo had the lowest runtime perplexity of the pruned rows; unstructured zeros make
    # llama.cpp neither faster nor smaller, so these are the default build's settings under a name
    Preset("quality", "closest to the dense model; same speed and size as dense at the same type",
           {"prune": {"sparsity": 0.5}, "compensate": {"method": "laco"}, "export": {"target": "gguf", "quant": "q8_0"}},
           measured="Q8_0: ppl 28.62 (dense 21.14), top-1 0.688, 138.1 MiB (dense 138.1), decode 0.97x"),
    # 30% of the FFN channels: 1.2x decode at 83% of the file, the best perplexity of the faster rows
    Preset("balanced", "faster and smaller: 30% of the FFN channels removed, 8-bit weights",
           {"prune": {"structured": 0.3, "targets": FFN_LINEARS}, "compensate": {"method": "laco"},
            "export": {"target": "gguf", "quant": "q8_0"}},
           measured="Q8_0: ppl 30.56 (dense 21.14), top-1 0.677, 114.6 MiB (dense 138.1), decode 1.26x"),
    # FFN channels and KV head groups: the fastest and smallest row, at about twice the dense perplexity
    Preset("speed", "fastest and smallest: 30% of the FFN channels and KV head groups removed, 4-bit K-quants",
           {"prune": {"structured": 0.3}, "compensate": {"method": "laco"}, "export": {"target": "gguf", "quant": "q4_k_m"}},
           measured="Q4_K_M: ppl 42.33 (dense 21.98), top-1 0.567, 82.6 MiB (dense 100.6), decode 1.33x"),
)}


def preset_values(name: str) -> dict[str, dict[str, Any]]:
    """The config-file sections of preset `name` (copies); an unknown name lists the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} is not one of {', '.join(PRESETS)}")
    return {section: dict(values) for section, values in PRESETS[name].settings.items()}


def layer(preset: dict[str, dict[str, Any]], file_values: dict[str, Any], flag_keys: set[str]) -> dict[str, Any]:
    """Preset sections under the config file's values (field by field); `flag_keys` ("section.field")
    are the flags the user set, which merge() applies on top."""
    given = set(flag_keys)
    for section, values in file_values.items():
        if isinstance(values, dict):
            given |= {f"{section}.{k}" for k in values}
    out: dict[str, Any] = {section: dict(values) for section, values in preset.items()}
    if given & {f"prune.{k}" for k in PATTERN_KEYS}:
        out["prune"] = {k: v for k, v in out.get("prune", {}).items() if k not in PATTERN_KEYS}
    if given & {"export.quant", "export.target"}:
        out["compensate"] = {k: v for k, v in out.get("compensate", {}).items() if k != "quant_aware"}
    for key, value in file_values.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def help_text() -> str:
    """'quality (...), balanced (...), speed (...)' for --help."""
    return "; ".join(f"{p.name}: {p.goal} ({describe(p)})" for p in PRESETS.values())


def describe(p: Preset) -> str:
    prune, comp, export = p.settings.get("prune", {}), p.settings.get("compensate", {}), p.settings.get("export", {})
    pattern = f"structured {prune['structured']:.0%}" if "structured" in prune else prune.get("pattern") or \
        f"{prune.get('sparsity', 0.5):.0%} unstructured"
    if "structured" in prune:
        pattern += " of FFN channels" if tuple(prune.get("targets", ())) == FFN_LINEARS else " of FFN channels and KV head groups"
    recover = comp.get("method", "laco") + (f" quant-aware {comp['quant_aware']}" if comp.get("quant_aware") else "")
    return f"{pattern}, {recover}, {export.get('target', 'gguf')} {export.get('quant', 'default type')}"
