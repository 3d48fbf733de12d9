"""Typed, JSON-serialisable records passed between stages and written into manifests.

Each stage's `run(...)` returns one of these (or a subclass defined next to the stage);
`pipeline.py` stores `to_dict()` of each in `manifest.json`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPARSITY_FILE = "sparsity.json"  # written beside a pruned or compensated model: per-matrix sparsity
SOURCE_FILE = "laco_source.json"  # {"gguf": path} in a model folder: the GGUF it came from (the GGUF exporter reuses its tokenizer)


def record_gguf_source(folder: Path, gguf: Path) -> None:
    """Name `gguf` in folder's SOURCE_FILE unless it already does: a conversion cache (keyed by name,
    size and time) made from a copy since moved or deleted then points at the copy at hand, and the
    GGUF exporter keeps reusing that file's tokenizer instead of rebuilding one from the HF files."""
    marker, text = Path(folder) / SOURCE_FILE, json.dumps({"gguf": str(Path(gguf).resolve())})
    if not marker.is_file() or marker.read_text() != text:
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(marker)


def with_provenance(source_dir: str | Path | None, extra_files: dict[str, str] | None) -> dict[str, str]:
    """`extra_files` plus the source's laco_source.json, so provenance follows the weights from stage to stage."""
    files = dict(extra_files or {})
    src = Path(source_dir) / SOURCE_FILE if source_dir else None
    if src is not None and src.is_file() and SOURCE_FILE not in files:
        files[SOURCE_FILE] = src.read_text()
    return files


def checkpoint_dir(out_dir: Path) -> Path:
    """Sibling folder of a stage's output holding per-layer checkpoints while the run is in progress."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".ckpt")


def pattern_label(pattern: str | None, ratio: float | None = None, *, owl: bool = False) -> str:
    """How a sparsity pattern is named in results and reports: "unstructured 50%", "2:4",
    "structured 30%" (" (OWL)" with outlier-weighted layer ratios). pattern: config.json's
    `laco_deploy.pattern` ("unstructured" | "N:M" | "structured"); ratio: the asked-for share."""
    if pattern in ("unstructured", "structured") and ratio is not None:
        return f"{pattern} {float(ratio):.0%}" + (" (OWL)" if owl else "")
    return str(pattern or "unknown")


@dataclass(frozen=True)
class Artifact:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def written_at(cls, path: Path) -> bool:
        """Whether `path` holds a record of this kind as laco-deploy writes it (JSON with every required
        field), so that a rerun may replace it with --force; any other file is never replaced."""
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(doc, dict) and required <= doc.keys()


@dataclass(frozen=True)
class ModelDirResult(Artifact):
    """A Hugging Face directory written by prune or compensate, with how it was made."""

    model_dir: str
    stage: str  # "prune" | "compensate"
    sparsity: float  # realised share of zeros over the pruned matrices (structured: removed share)
    pattern: str  # "unstructured 50%", "2:4", "structured 30%"
    settings: dict[str, Any] = field(default_factory=dict)
    per_layer: list[dict[str, Any]] = field(default_factory=list)  # per-layer records (time, memory, errors)
    wall_s: float = 0.0
    peak_mib: float = 0.0
    memory_kind: str = "rss"  # "rss" (CPU peak resident set) | "cuda_max_allocated"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExportResult(Artifact):
    target: str  # "gguf" | "onnx"
    quant: str  # e.g. "q8_0", "fp32"
    path: str  # the .gguf file, or the ONNX folder holding model.onnx
    size_bytes: int
    checks: dict[str, Any] = field(default_factory=dict)  # parity numbers measured right after export
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass(frozen=True)
class BenchResult(Artifact):
    runtime: str  # "llama.cpp" | "onnxruntime"
    environment: dict[str, Any]  # threads, provider, versions, cpu
    protocol: dict[str, Any]  # how perplexity and speed were measured, in words and numbers
    models: dict[str, dict[str, Any]]  # label -> metrics (ppl, pp_tps, tg_tps, ttft_s, load_s, size, rss)
    notes: list[str] = field(default_factory=list)
