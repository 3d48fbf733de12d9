"""Build settings from a YAML file plus command-line overrides, validated all at once.

The file mirrors BuildConfig's sections:

    model: {model: default, device: auto}
    data: {samples: 64, seqlen: 256}
    prune: {method: wanda, sparsity: 0.5}
    compensate: {method: laco}
    export: {target: gguf, quant: q8_0}
    out: laco-build

Flags override the file; unknown keys are errors (a typo must not silently keep a default).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import yaml

from laco_deploy.config import IMATRIX_CALIB, BuildConfig
from laco_deploy.errors import ConfigError
from laco_deploy.targets import TARGETS

log = logging.getLogger(__name__)


def sparsity_conflicts(given: dict) -> list[str]:
    """prune.sparsity given together with prune.pattern or prune.structured, which set the share of
    zeros themselves (`given`: the prune settings the user set; None = not set)."""
    other = [f"prune.{k} {given[k]}" for k in ("pattern", "structured") if given.get(k) is not None]
    if given.get("sparsity") is None or not other:
        return []
    return [f"prune.sparsity {given['sparsity']} is not used with {' and '.join(other)}, which "
            f"{'set' if len(other) > 1 else 'sets'} the share of zeros (2:4 zeroes 50%); drop one of them"]


def _section_types() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(BuildConfig)}


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, data:, prune:, ...)")
    return data


def merge(file_values: dict[str, Any], overrides: dict[str, Any]) -> BuildConfig:
    """BuildConfig from file values, then `overrides` ("section.field" or top-level name -> value; None = unset).

    Raises ConfigError listing every unknown key and every invalid value together.
    """
    base = BuildConfig()
    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    errors: list[str] = []
    for key, value in file_values.items():
        current = getattr(base, key, None)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                errors.append(f"config section {key!r} must be a mapping")
                continue
            sections.setdefault(key, {}).update(value)
        elif key in ("out", "resume"):
            top[key] = value
        else:
            errors.append(f"unknown config key {key!r}")
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, name = dotted.rpartition(".")
        if section:
            sections.setdefault(section, {})[name] = value
        else:
            top[name] = value
    conflicts = sparsity_conflicts(sections.get("prune", {}))
    built: dict[str, Any] = {}
    for name, values in sections.items():
        cls = type(getattr(base, name))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        errors.extend(f"unknown key {name}.{k} (known: {', '.join(sorted(known))})" for k in unknown)
        types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        errors.extend(e for k, v in values.items() if k in known and (e := type_error(f"{name}.{k}", v, types[k])))
        clean = {k: _as_field(v, types[k]) for k, v in values.items() if k in known}
        built[name] = dataclasses.replace(getattr(base, name), **clean)
    errors.extend(e for k, v in top.items() if (e := type_error(k, v, "str" if k == "out" else "bool")))
    if errors:
        raise ConfigError("; ".join(errors))
    cfg = dataclasses.replace(base, **built, **top)
    problems = cfg.validate() + _cross_checks(cfg) + conflicts
    if problems:
        raise ConfigError("invalid settings: " + "; ".join(problems))
    return _quant_aware_default(cfg, "quant_aware" in sections.get("compensate", {}))


_KINDS = {"bool": (bool, "true or false"), "int": (int, "a whole number"), "float": ((int, float), "a number"),
          "str": (str, "text")}


def type_error(setting: str, value: Any, annotation: str) -> str | None:
    """Why `value` (from a YAML file) cannot be `setting`, whose field is annotated `annotation`, or None."""
    if value is None:
        return None if "None" in annotation else f"{setting} must be set (null is not allowed here)"
    if annotation.startswith("tuple[str"):
        if isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
            return None
        return f"{setting} {value!r} must be a list of names, e.g. [q_proj, down_proj]"
    kind = annotation.split("|")[0].strip()
    if kind not in _KINDS:
        return None
    allowed, words = _KINDS[kind]
    if isinstance(value, allowed) and (kind == "bool" or not isinstance(value, bool)):
        return None
    return f"{setting} {value!r} must be {words}" + (" or null" if "None" in annotation else "")


def _as_field(value: Any, annotation: str) -> Any:
    """A YAML value as its field holds it: lists (or "a, b" text) as tuples."""
    if annotation.startswith("tuple[") and isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value) if isinstance(value, list) else value


def _quant_aware_default(cfg: BuildConfig, given: bool) -> BuildConfig:
    """LaCo trains through the exported weights when the target registry says that helps for this
    export type (targets.Target.quant_aware_defaults), unless compensate.quant_aware was given.
    Measured on unstructured pruning only: on structured 30% it raised the Q4_K_M perplexity
    (47.8 -> 52.6, benchmarks/RESULTS.md frontier), so structured builds keep it off."""
    comp = cfg.compensate
    qa = TARGETS[cfg.export.target].quant_aware_default(cfg.export.resolved_quant)
    if cfg.export.imatrix is not None and (comp.quant_aware is not None or (qa is not None and not given)):
        # with an importance matrix llama.cpp searches other grids: QA-LaCo then trains through the weighted
        # quantizer with the importance its export will use (compensate.quant_imatrix, kept in its output)
        if given:
            if comp.quant_imatrix is None:
                log.info("compensate.quant_aware %s trains through llama.cpp's importance-weighted quantizer "
                         "(compensate.quant_imatrix %s), as export.imatrix quantizes", comp.quant_aware, IMATRIX_CALIB)
                cfg = dataclasses.replace(cfg, compensate=dataclasses.replace(comp, quant_imatrix=IMATRIX_CALIB))
            return cfg
        log.info("quantization-aware LaCo stays off: its default was measured without export.imatrix (set "
                 "compensate.quant_aware to train through the importance-weighted quantizer)")
        return cfg
    if given or qa is None or comp.method != "laco" or comp.trainable != "weights" or cfg.prune.structured:
        return cfg
    log.info("quantization-aware LaCo on (compensate.quant_aware %s, the default for %s %s builds: measured to lower the "
             "runtime perplexity); compensate.quant_aware: null turns it off", qa, cfg.export.target,
             cfg.export.resolved_quant)
    return dataclasses.replace(cfg, compensate=dataclasses.replace(comp, quant_aware=qa))


def _cross_checks(cfg: BuildConfig) -> list[str]:
    """Combinations that are invalid although each value alone is fine."""
    errs = []
    if cfg.compensate.method == "lora" and cfg.prune.structured is not None:
        errs.append("compensate.method lora with prune.structured: LoRA merges need the original shapes; use compensate.method laco")
    target = TARGETS.get(cfg.export.target)  # an unknown target is reported by ExportConfig.validate
    if cfg.export.sparse_storage and target is not None and not target.sparse_storage:
        able = " or ".join(t.name for t in TARGETS.values() if t.sparse_storage)
        errs.append(f"export.sparse_storage only applies to export.target {able}")
    if cfg.export.sparse_storage and cfg.prune.structured is not None:
        errs.append("export.sparse_storage has nothing to compress for prune.structured models (they are dense and smaller)")
    if cfg.export.imatrix not in (None, IMATRIX_CALIB):  # one file cannot fit the dense, pruned and recovered models
        errs.append(f"export.imatrix {cfg.export.imatrix!r}: a build computes each exported model's own importance matrix; "
                    f"set it to {IMATRIX_CALIB} (a file is for `laco-deploy export`)")
    return errs
