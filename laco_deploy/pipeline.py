"""`build(cfg)`: the only module that sequences stages.

prune -> compensate -> export -> fidelity -> bench, each writing into one build folder.
After each stage `manifest.json` is rewritten atomically with what the stage made (files with
hashes, settings, input hashes, wall time, peak memory). A stage whose settings and input hashes
match the manifest and whose outputs are intact is reused instead of rerun.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from laco_deploy import __version__
from laco_deploy.config import BuildConfig, to_dict
from laco_deploy.fsutil import sha256_tree, write_json
from laco_deploy.memory import measure
from laco_deploy.models import resolve_device
from laco_deploy.targets import TARGETS

log = logging.getLogger(__name__)
STAGES = ("prune", "compensate", "export", "fidelity", "bench")
_VERSIONED = ("torch", "transformers", "gguf", "onnx", "onnxruntime", "llama-cpp-python", "safetensors", "numpy")


def package_versions() -> dict[str, str]:
    out = {"laco-deploy": __version__, "python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def data_fingerprint(spec: str, role: str) -> str:
    from laco_deploy.data import builtin_path

    if spec == "builtin":
        return sha256_tree(builtin_path(role))
    path = Path(spec).expanduser()
    return sha256_tree(path) if path.exists() else f"spec:{spec}"


@dataclasses.dataclass
class Layout:
    """Where each artifact lives inside the build folder."""

    root: Path
    target: str
    quant: str

    @property
    def pruned(self) -> Path:
        return self.root / "pruned"

    @property
    def recovered(self) -> Path:
        return self.root / "recovered"

    def exported(self, label: str = "model") -> Path:
        """The exported model ("model") at the top, the dense/pruned references under reference/."""
        target = TARGETS[self.target]
        if label == "model":
            return self.root / target.build_artifact.format(quant=self.quant)
        return self.root / "reference" / target.artifact_name(label, self.quant)

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


class Builder:
    """Runs the stages of one build, reusing unchanged ones, and keeps the manifest current."""

    def __init__(self, cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None):
        self.cfg = cfg
        self.device = resolve_device(cfg.model.device)
        self.layout = Layout(Path(cfg.out), cfg.export.target, cfg.export.resolved_quant)
        self.on_stage = on_stage or (lambda _stage, _status: None)
        self.manifest = self._load_manifest()

    def _load_manifest(self) -> dict[str, Any]:
        previous: dict[str, Any] = {}
        if self.layout.manifest.is_file():
            try:
                previous = json.loads(self.layout.manifest.read_text())
            except json.JSONDecodeError:
                log.warning("%s is unreadable; every stage will rerun", self.layout.manifest)
        return {
            "tool": "laco-deploy",
            "version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": to_dict(self.cfg),
            "device": str(self.device),
            "seed": self.cfg.data.seed,
            "versions": package_versions(),
            "inputs": {},
            "stages": previous.get("stages", {}),
            "summary": {},
        }

    def save(self) -> None:
        write_json(self.layout.manifest, self.manifest)

    def stage(self, name: str, settings: dict, inputs: dict[str, str], outputs: dict[str, Path],
              fn: Callable[[], Any]) -> dict[str, Any]:
        """Run `fn` unless a previous run with the same key left intact outputs; record it either way."""
        key = hashlib.sha256(json.dumps({"settings": settings, "inputs": inputs, "version": __version__},
                                        sort_keys=True, default=str).encode()).hexdigest()
        old = self.manifest["stages"].get(name)
        if old and old.get("key") == key and self._outputs_intact(old):
            self.on_stage(name, "reused")
            old["reused"] = True
            self.save()
            return old
        self.on_stage(name, "running")
        with measure(self.device) as m:
            result = fn()
        files = {
            label: {"path": str(p.relative_to(self.layout.root)), "sha256": sha256_tree(p), "bytes": _size(p)}
            for label, p in outputs.items() if p.exists()
        }
        record = {
            "key": key, "settings": settings, "inputs": inputs, "files": files, "reused": False,
            "wall_s": round(m.wall_s, 2), "peak_mib": m.to_dict()["peak_mib"], "memory_kind": m.kind,
            "result": result.to_dict() if hasattr(result, "to_dict") else result,
        }
        self.manifest["stages"][name] = record
        self.save()
        self.on_stage(name, "done")
        return record

    def _outputs_intact(self, record: dict) -> bool:
        for info in record.get("files", {}).values():
            p = self.layout.root / info["path"]
            if not p.exists() or sha256_tree(p) != info["sha256"]:
                return False
        return bool(record.get("files"))


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def build(cfg: BuildConfig, on_stage: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Run the whole chain; return the manifest (also written to <out>/manifest.json)."""
    from laco_deploy.models import source_fingerprint

    b = Builder(cfg, on_stage)
    b.layout.root.mkdir(parents=True, exist_ok=True)
    b.manifest["inputs"] = {
        "model": source_fingerprint(cfg.model.model),
        "calib": data_fingerprint(cfg.data.calib, "calib"),
        "eval": data_fingerprint(cfg.data.eval, "eval"),
    }
    b.save()
    from laco_deploy.pipeline_stages import run_all

    run_all(b)
    from laco_deploy.summary import summarize

    b.manifest["summary"] = summarize(b.manifest)
    b.save()
    return b.manifest
