"""Export targets and their runtimes: one frozen record per target, read everywhere a target matters.

A target couples an exporter (HF directory -> file or folder), the runtime that runs its output
(a CausalRunner for fidelity, a benchmark), the names its artifacts get and the weight types it
offers. Layout, export, bench, fidelity, the CLI and the config read these records; nothing else
compares target or runtime names. A new target is a new record here plus its exporter and runner.

Entry points are "module:attribute" strings, imported on first use, so that reading the registry
(config validation, `--help`) never imports torch, onnxruntime or llama.cpp.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _load(entry: str) -> Any:
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Target:
    name: str  # the --target value
    runtime: str  # the --runtime value of `bench run`, and BenchResult.runtime
    quant_types: tuple[str, ...]  # weight types the exporter writes
    default_quant: str
    exporter: str  # "module:function" (model_dir, dest, quant, check=, **options) -> ExportResult
    check: str  # "module:name" the runtime parity check the exporter runs on what it wrote (ONNX: two phases)
    runner: str  # "module:class" CausalRunner(path, device=..., threads=...)
    benchmark: str  # "module:function" (models, *, eval_spec, cfg, device) -> BenchResult
    artifact: str  # export name next to a model: format(stem=, quant=)
    build_artifact: str  # the exported model's name in a build folder: format(quant=)
    file_suffix: str = ""  # a single file with this suffix is this target's output
    folder_marker: str = ""  # a folder holding this file is this target's output
    written_here: str = ""  # "module:function" (path) -> whether a file output is one laco-deploy wrote
    sparse_storage: bool = False  # the exporter can store sparse weights compactly
    # a build runs each export in a child process: what the exporter imports and leaves in the heap
    # would otherwise stay in the build for the stages after it (laco_deploy/isolated.py says how much)
    export_in_child: bool = False
    # weight types the exporter makes with llama.cpp's quantizer, which an importance-matrix file steers
    imatrix_quants: tuple[str, ...] = ()
    follows_device: bool = False  # the runtime runs on the build's device (CUDA); else always on the CPU
    context_option: str = ""  # the runner's keyword for its context length, sized to the longest sequence
    description: str = ""  # words for help texts
    # (export type, --quant-aware type): a build exporting this type trains LaCo through its weights
    # unless compensate.quant_aware is set (null: off); only where measured to help
    quant_aware_defaults: tuple[tuple[str, str], ...] = ()

    def quant_aware_default(self, quant: str) -> str | None:
        """The --quant-aware type a build of export type `quant` uses by default, or None."""
        return dict(self.quant_aware_defaults).get(quant)

    def artifact_name(self, stem: str, quant: str) -> str:
        return self.artifact.format(stem=stem, quant=quant)

    def owns(self, path: Path) -> bool:
        """Whether `path` is an output of this target (a runtime can open it)."""
        path = Path(path)
        if self.file_suffix and path.suffix.lower() == self.file_suffix:
            return True
        return bool(self.folder_marker) and path.is_dir() and (path / self.folder_marker).is_file()

    def check_out(self, dest: Path, option: str, *, force: bool = False, force_option: str = "the force option") -> None:
        """Before any work: `dest` may be written (new, or an earlier export of ours with `force`)."""
        from laco_deploy.fsutil import check_output

        made_here = _load(self.written_here) if self.written_here else None
        check_output(dest, option, force=force, kind="file" if made_here else "folder", made_here=made_here,
                     force_option=force_option)

    def export(self, model_dir: Path, dest: Path, quant: str, *, sparse_storage: bool = False,
               imatrix: Path | None = None):
        """Run this target's exporter with its runtime parity check; -> ExportResult."""
        options: dict[str, Any] = {"sparse_storage": sparse_storage} if self.sparse_storage else {}
        if imatrix is not None:
            if not self.imatrix_quants:
                raise ValueError(f"target {self.name} takes no importance matrix")  # ExportConfig.validate refuses it first
            options["imatrix"] = Path(imatrix)
        return _load(self.exporter)(Path(model_dir), Path(dest), quant, check=_load(self.check), **options)

    def runtime_device(self, device: Any) -> str:
        """Where this target's runtime runs for a build on `device`: "cuda" or "cpu"."""
        return "cuda" if self.follows_device and str(device).startswith("cuda") else "cpu"

    def open_runner(self, path: Path, device: Any = "cpu", threads: int | None = None, max_tokens: int | None = None):
        """A CausalRunner over an export of this target (on `device` where the runtime follows it);
        `max_tokens`: the longest sequence it will get (runtimes with a context size their buffers to it)."""
        cls = _load(self.runner)
        options = {self.context_option: max_tokens} if self.context_option and max_tokens else {}
        if self.follows_device:
            return cls(Path(path), device=str(device), threads=threads, **options)
        return cls(Path(path), threads=threads, **options)

    def run_benchmark(self, models: dict[str, Path], *, eval_spec: str, cfg, device: str = "cpu"):
        return _load(self.benchmark)(models, eval_spec=eval_spec, cfg=cfg, device=device)


GGUF = Target(
    name="gguf",
    runtime="llama.cpp",
    quant_types=("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m", "q3_k_s", "q2_k"),  # = exporters.gguf_names.QUANTS
    default_quant="q8_0",
    exporter="exporters.gguf:export",
    check="laco_deploy.runtimes.parity:gguf_parity",
    runner="laco_deploy.runtimes.llamacpp:LlamaCppRunner",
    benchmark="laco_deploy.bench.llamacpp_bench:run_benchmark",
    artifact="{stem}.{quant}.gguf",
    build_artifact="model.{quant}.gguf",
    file_suffix=".gguf",
    imatrix_quants=("q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m", "q3_k_s", "q2_k"),  # = exporters.gguf_names.QUANTS without tensor_type
    written_here="exporters.gguf_check:written_here",
    description="llama.cpp",
    context_option="n_ctx",  # its logits buffers are n_ctx x vocab floats
    # Wanda 50% SmolLM2-135M, CPU budget: llama.cpp ppl 46.5 -> 45.0 (seed 0), lower on all four
    # evaluation domains (benchmarks/RESULTS.md, quantization-aware LaCo)
    quant_aware_defaults=(("q4_k_m", "q4_k_m"),),
)

ONNX = Target(
    name="onnx",
    runtime="onnxruntime",
    quant_types=("fp32", "fp16", "int8"),
    default_quant="fp32",
    exporter="exporters.onnx:export",
    check="laco_deploy.runtimes.parity:onnx_parity",
    runner="laco_deploy.runtimes.onnxrt:OrtRunner",
    benchmark="laco_deploy.bench.onnxrt_bench:run_benchmark",
    artifact="{stem}-onnx-{quant}",
    build_artifact="onnx-{quant}",
    file_suffix=".onnx",
    folder_marker="model.onnx",
    sparse_storage=True,
    export_in_child=True,
    follows_device=True,
    description="onnxruntime",
)

TARGETS: dict[str, Target] = {t.name: t for t in (GGUF, ONNX)}
RUNTIMES: dict[str, Target] = {t.runtime: t for t in TARGETS.values()}


def target_for_path(path: Path) -> Target | None:
    """The target whose output `path` is (a .gguf file, an ONNX folder or file), or None."""
    return next((t for t in TARGETS.values() if t.owns(Path(path))), None)


def quant_help() -> str:
    """'GGUF: f32 f16 ... (default q8_0); ONNX: fp32 ... (default fp32)' for --quant help texts."""
    return "; ".join(f"{t.name.upper()}: {' '.join(t.quant_types)} (default: {t.default_quant})" for t in TARGETS.values())


def target_help() -> str:
    """'gguf (llama.cpp) or onnx (onnxruntime)' for --target help texts."""
    return " or ".join(f"{t.name} ({t.runtime})" for t in TARGETS.values())
