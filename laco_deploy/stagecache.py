"""Stage reuse in one build folder, keyed on what each stage was given.

A stage declares its settings and its inputs as `Output`s: named outputs of earlier stages (files
or folders in the build folder, hashed when they were made) or the build's sources (fingerprints
of the model and the texts). The cache derives the stage's key from the settings, the inputs'
hashes and the laco-deploy version; a stage whose key matches its record in the manifest and whose
outputs are intact is reused instead of rerun. After each stage `manifest.json` is rewritten
atomically with what the stage made (files with hashes, settings, input hashes, wall time, peak
memory), so a killed build leaves a manifest of the stages that finished.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Union

from laco_deploy import distributed
from laco_deploy.fsutil import is_marked, reuse_key, sha256_tree, write_json
from laco_deploy.memory import measure, release_memory

log = logging.getLogger(__name__)

SOURCES = "inputs"  # the manifest section holding the build's own inputs (Output.stage of a source)
MANIFEST = "manifest.json"


def is_build_folder(path: Path) -> bool:
    """Whether `path` is a build folder laco-deploy made (marked when created; older ones by their manifest)."""
    if is_marked(path):
        return True
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("tool") == "laco-deploy" and "stages" in manifest


@dataclass(frozen=True)
class Output:
    """A named output of a stage, or a build source (stage SOURCES, no path)."""

    stage: str
    label: str
    path: Path | None = None


Inputs = Mapping[str, Union[Output, Mapping[str, Output]]]  # name -> output, or a named group of outputs


@dataclass(frozen=True)
class StageRun:
    """A stage's manifest record and handles on what it made."""

    record: dict[str, Any]
    outputs: dict[str, Output]

    @property
    def result(self) -> dict[str, Any]:
        return self.record["result"]


class StageCache:
    """Runs stages in one build folder, reusing unchanged ones, and keeps the manifest current."""

    def __init__(self, root: Path, header: dict[str, Any], device: Any = "cpu",
                 on_stage: Callable[[str, str], None] | None = None):
        """header: the manifest's fixed fields (tool, config, versions, ...); stages of a previous
        manifest in `root` are kept as candidates for reuse."""
        self.root = Path(root)
        self.device = device
        self.on_stage = on_stage or (lambda _stage, _status: None)
        self.manifest: dict[str, Any] = {**header, SOURCES: {}, "stages": self._previous_stages(), "summary": {}}

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def _previous_stages(self) -> dict[str, Any]:
        if not self.manifest_path.is_file():
            return {}
        try:
            return json.loads(self.manifest_path.read_text()).get("stages", {})
        except json.JSONDecodeError:
            log.warning("%s is unreadable; every stage will rerun", self.manifest_path)
            return {}

    def save(self) -> None:
        if distributed.is_main():  # torchrun: rank 0 keeps the manifest
            write_json(self.manifest_path, self.manifest)

    def source(self, label: str, fingerprint: str) -> Output:
        """Record a build input's fingerprint; -> the Output that stages name as their input."""
        self.manifest[SOURCES][label] = fingerprint
        return Output(SOURCES, label)

    def hash_of(self, output: Output) -> str:
        """The content hash of an earlier stage's output (or a source's fingerprint) from the manifest."""
        if output.stage == SOURCES:
            return self.manifest[SOURCES][output.label]
        try:
            return self.manifest["stages"][output.stage]["files"][output.label]["sha256"]
        except KeyError as e:
            raise KeyError(f"stage {output.stage!r} recorded no output {output.label!r}; "
                           "a stage can only use outputs of stages that ran before it") from e

    def _resolve(self, inputs: Inputs) -> dict[str, Any]:
        return {name: ({k: self.hash_of(o) for k, o in value.items()} if isinstance(value, Mapping) else self.hash_of(value))
                for name, value in inputs.items()}

    def run(self, name: str, settings: dict[str, Any], inputs: Inputs, outputs: dict[str, Path],
            fn: Callable[[], Any], *, main_only: bool = False) -> StageRun:
        """Run `fn` unless a previous run with the same key left intact outputs; record it either way.
        `main_only`: a stage that is not split over torchrun ranks (export, bench) runs on rank 0
        while the others wait; every rank then reads the same outputs."""
        hashes = self._resolve(inputs)
        key = reuse_key(settings, hashes)
        handles = {label: Output(name, label, Path(p)) for label, p in outputs.items()}
        old = self.manifest["stages"].get(name)
        if distributed.agree(bool(old and old.get("key") == key and self._outputs_intact(old))):
            self.on_stage(name, "reused")
            old["reused"] = True
            self.save()
            return StageRun(old, handles)
        self.on_stage(name, "running")
        release_memory()  # the stage's peak starts from what the build holds, not what earlier stages freed
        with measure(self.device) as m:
            result = fn() if distributed.is_main() or not main_only else None
        distributed.barrier()  # rank 0's outputs are complete before any rank hashes or reads them
        release_memory()
        files = {
            label: {"path": str(p.relative_to(self.root)), "sha256": sha256_tree(p), "bytes": _size(p)}
            for label, p in outputs.items() if p.exists()
        }
        record = {
            "key": key, "settings": settings, "inputs": hashes, "files": files, "reused": False,
            "wall_s": round(m.wall_s, 2), "peak_mib": m.to_dict()["peak_mib"], "memory_kind": m.kind,
            # what the process held as the stage began: a peak above a standalone run's is the earlier stages'
            "start_mib": round((m.peak_bytes - m.peak_delta_bytes) / 2**20, 1),
            "result": result.to_dict() if hasattr(result, "to_dict") else result,
        }
        self.manifest["stages"][name] = record
        self.save()
        self.on_stage(name, "done")
        return StageRun(record, handles)

    def _outputs_intact(self, record: dict) -> bool:
        for info in record.get("files", {}).values():
            p = self.root / info["path"]
            if not p.exists() or sha256_tree(p) != info["sha256"]:
                return False
        return bool(record.get("files"))


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
