"""Options and helpers shared by the commands. Defaults come from laco_deploy.config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from laco_deploy.config import DataConfig, ModelConfig
from laco_deploy.errors import ConfigError

console = Console()
err_console = Console(stderr=True)


@dataclass
class _State:
    debug: bool = False


state = _State()
_M, _D = ModelConfig(), DataConfig()

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Dense model: a Hugging Face directory, a .gguf file, a hub id (online only) or 'default' (SmolLM2-135M-Instruct, embedded).")]
# Flags shared by several commands: declared here once, with one help text.
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="Where layers run: auto (CUDA when present), cpu, cuda or cuda:N.")]
AllowPickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow pickled *.bin weights (can run code on load; only for sources you trust).")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help=(
    "Allow a model folder's own Python code (auto_map in its config) to run on load; only for sources you trust. "
    "Default: such a folder is refused."))]
CalibOpt = Annotated[str, typer.Option("--calib", help="Calibration text: builtin (Wikipedia), builtin:mixed (Wikipedia + Python source), a .txt/.jsonl file, or hf:NAME[:CONFIG][:SPLIT].")]
EvalOpt = Annotated[str, typer.Option("--eval", help="Evaluation texts (never used for calibration), comma-separated: 'domains' (builtin Wikipedia plus the shipped fiction, techdoc, code and dialogue texts; in-domain where calibration covers the genre: builtin:mixed covers Wikipedia and code), builtin, builtin:fiction|techdoc|code|dialogue, a .txt/.jsonl file, or hf:NAME[:CONFIG][:SPLIT]. Each is reported as its own domain.")]
SamplesOpt = Annotated[int, typer.Option("--samples", help="Number of calibration samples.")]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample and evaluation window.")]
EvalSamplesOpt = Annotated[int, typer.Option("--eval-samples", help="Evaluation windows of --seqlen tokens, per evaluation domain.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for sampling calibration windows and training.")]
OffloadOpt = Annotated[str, typer.Option("--offload", help=(
    "cpu: the model and activations in RAM (compensation streams layers anyway, said in the log, when they would "
    "not fit); disk: activations memory-mapped and decoder layers streamed from the safetensors files one at a "
    "time, the result written shard by shard (models larger than RAM). The dense twin of compensation always "
    "streams one layer at a time."))]
ResumeOpt = Annotated[bool, typer.Option("--resume", help=(
    "Continue an interrupted run from its checkpoints (OUT.ckpt; build: the build folder's) with the same "
    "settings; the result equals an uninterrupted run. Default: off, start over."))]
ForceOpt = Annotated[bool, typer.Option("--force", help=(
    "Replace an output (--out, and the --json record where the command has one) that an earlier laco-deploy run "
    "wrote. A file or folder laco-deploy did not write is never replaced, with or without --force."))]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help=(
    "Calibration samples per layer call when pruning, per training step when compensating (memory grows with it)."))]
OptFloat = Optional[float]


def check(errors: list[str]) -> None:
    """Raise one ConfigError listing every invalid setting."""
    if errors:
        raise ConfigError("; ".join(errors))


def check_model_out(out, force: bool) -> None:
    """Before any work: `out` (a model folder) may be written, and its checkpoint folder is ours or new."""
    from laco_deploy.artifacts import checkpoint_dir
    from laco_deploy.fsutil import check_output, check_scratch

    check_output(out, "--out", force=force, force_option="--force")
    check_scratch(checkpoint_dir(out), "--out")


def section_from_flags(cls: type, flags: dict[str, Any]) -> Any:
    """A settings section from a command's flags that are named as its fields (`--lr` -> lr, the
    convention cli/flags.py records the exceptions of); the command's other flags are not its."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in flags.items() if k in names})


def model_config(model: str, device: str, allow_pickle: bool, trust_remote_code: bool = False) -> ModelConfig:
    cfg = ModelConfig(model=model, device=device, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    check(cfg.validate())
    return cfg


def data_config(calib: str, eval_: str, samples: int, seqlen: int, eval_samples: int, seed: int) -> DataConfig:
    cfg = DataConfig(calib=calib, eval=eval_, samples=samples, seqlen=seqlen, eval_samples=eval_samples, seed=seed)
    check(cfg.validate())
    return cfg


def parse_labeled_paths(specs: list[str], option: str = "--candidate",
                        what: str = "a Hugging Face directory, an ONNX export (folder or .onnx) or a .gguf file") -> dict:
    """`LABEL=PATH` or `PATH` (label: the file or folder name) -> {label: Path}, in order."""
    from pathlib import Path

    example = f"{option} pruned=out/pruned" if option.startswith("--") else "dense=out/dense.gguf"
    out: dict[str, Path] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec.rstrip("/")).name, spec
        if not label or not path:
            raise ConfigError(f"{option} {spec!r} is empty on one side; write LABEL=PATH, e.g. {example}")
        if label in out:
            raise ConfigError(f"{option} label {label!r} is used twice; give each its own LABEL=PATH")
        if not Path(path).exists():
            raise ConfigError(f"{option} {path} not found; pass {what}, optionally as LABEL=PATH")
        out[label] = Path(path)
    if not out:
        raise ConfigError(f"no {option} given; pass at least one, e.g. {example}")
    return out
