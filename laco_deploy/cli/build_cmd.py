"""`laco-deploy build`: the whole chain in one command."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from laco_deploy import __version__
from laco_deploy.cli import flags, output
from laco_deploy.cli.app import app
from laco_deploy.cli.common import DeviceOpt, ResumeOpt, SeedOpt, TrustRemoteCodeOpt, console
from laco_deploy.config import IMATRIX_CALIB, PRUNE_METHODS, BuildConfig, DataConfig, ModelConfig, to_dict
from laco_deploy.errors import ConfigError, GateFailed
from laco_deploy.fsutil import check_output, mark_folder
from laco_deploy.presets import help_text as preset_help
from laco_deploy.targets import quant_help, target_help

log = logging.getLogger(__name__)
_B = BuildConfig()
Opt = typer.Option
BUILD_LOG = "build.log"  # in the build folder: the full detail of every run, appended


@app.command("build")
def build_command(
    target: Annotated[Optional[str], Opt("--target", "-t", help=f"{target_help()}. (default: {_B.export.target})", show_default=False)] = None,
    model: Annotated[Optional[str], Opt("--model", "-m", help="Dense model: HF directory, .gguf file, hub id (online) or 'default' (SmolLM2-135M-Instruct). (default: default)", show_default=False)] = None,
    method: Annotated[Optional[str], Opt("--method", help=f"Pruning method: {', '.join(PRUNE_METHODS)}. (default: {_B.prune.method})", show_default=False)] = None,
    sparsity: Annotated[Optional[float], Opt("--sparsity", help=f"Unstructured sparsity per row, in [0, 1). (default: {_B.prune.sparsity})", show_default=False)] = None,
    pattern: Annotated[Optional[str], Opt("--pattern", help="N:M semi-structured sparsity, e.g. 2:4 (replaces --sparsity).", show_default=False)] = None,
    structured: Annotated[Optional[float], Opt("--structured", help="Share of FFN channels and head groups removed physically, e.g. 0.3 (smaller, faster model).", show_default=False)] = None,
    recover: Annotated[Optional[str], Opt("--recover", help=f"Recovery after pruning: laco, lora or none. (default: {_B.compensate.method})", show_default=False)] = None,
    calib: Annotated[Optional[str], Opt("--calib", help=f"Calibration text: builtin:mixed (Wikipedia + Python source), builtin (Wikipedia only), a .txt/.jsonl file, or hf:NAME[:CONFIG][:SPLIT]; use your deployment's kind of text where you have it. (default: {DataConfig.calib})", show_default=False)] = None,
    eval_: Annotated[Optional[str], Opt("--eval", help="Evaluation texts, never used for calibration, comma-separated; each reported as its own domain. (default: domains = builtin Wikipedia + shipped fiction, techdoc, code, dialogue)", show_default=False)] = None,
    samples: Annotated[Optional[int], Opt("--samples", help=f"Calibration samples. (default: {_B.data.samples})", show_default=False)] = None,
    seqlen: Annotated[Optional[int], Opt("--seqlen", help=f"Tokens per sample / evaluation window. (default: {_B.data.seqlen})", show_default=False)] = None,
    eval_samples: Annotated[Optional[int], Opt("--eval-samples", help=f"Evaluation windows per domain. (default: {_B.data.eval_samples})", show_default=False)] = None,
    seed: SeedOpt = None,
    quant: Annotated[Optional[str], Opt("--quant", help=f"Export type. {quant_help()}.", show_default=False)] = None,
    imatrix: Annotated[bool, Opt("--imatrix", help="GGUF k-quants: weight each column's rounding error by the model's importance matrix on the calibration samples (as llama-imatrix + llama-quantize --imatrix do), computed for every exported model.")] = False,
    device: DeviceOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    out: Annotated[Optional[Path], Opt("--out", "-o", help=f"Build folder. (default: {_B.out})", show_default=False)] = None,
    preset: Annotated[Optional[str], Opt("--preset", "-p", help=f"Settings chosen by goal, measured on the default model (benchmarks/RESULTS.md, speed/quality frontier); --config and flags override them. {preset_help()}.", show_default=False)] = None,
    size: Annotated[Optional[str], Opt("--size", help="File-size budget, e.g. 90MiB, 90M (= MiB), 90MB or 0.09GB (10^6 / 10^9 bytes): builds the measured configuration (pruning, weight type, LaCo or QA-LaCo, importance matrix) with the best measured quality (perplexity / dense, measured on SmolLM2-135M: benchmarks/RESULTS.md, speed/quality frontier; ties: the smaller file) whose file, estimated for this model from its config (embedding, other weights, vocabulary), fits; the choice and why are in build.log, the summary and manifest.json (`laco-deploy plan --size` shows it without building). --target, --quant, --recover, --imatrix, --method, --sparsity, --pattern, --structured (and the same keys in --config) narrow the choice instead of overriding it; not with --preset.", show_default=False)] = None,
    config: Annotated[Optional[Path], Opt("--config", "-c", help="YAML file with any of these settings by section (model, data, prune, compensate, fidelity, export, bench); flags override it.", show_default=False)] = None,
    resume: ResumeOpt = False,
    max_kl: Annotated[Optional[float], Opt("--max-kl", help="Gate: fail if mean KL(dense||exported) exceeds this.", show_default=False)] = None,
    min_top1: Annotated[Optional[float], Opt("--min-top1", help="Gate: fail if top-1 agreement with the dense model is below this.", show_default=False)] = None,
    max_ppl_ratio: Annotated[Optional[float], Opt("--max-ppl-ratio", help="Gate: fail if perplexity / dense perplexity exceeds this.", show_default=False)] = None,
    tasks: Annotated[Optional[list[str]], Opt("--tasks", help="Zero-shot accuracy in the fidelity report (lm-evaluation-harness, offline), comma-separated or repeated: laco_lastword, laco_sample_mc, arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, or a task .yaml file. Dense, pruned and recovered models are scored. (default: laco_lastword_quick, 90 passages: ~30 s of CPU per model on the default model)", show_default=False)] = None,
    no_tasks: Annotated[bool, Opt("--no-tasks", help="No zero-shot row in the reports (saves its ~90 s of CPU on the default model).")] = False,
    task_limit: Annotated[Optional[int], Opt("--task-limit", help="Score only the first N documents of each zero-shot task. (default: all)", show_default=False)] = None,
    as_json: Annotated[bool, Opt("--json", help="Print the summary as JSON on stdout (for scripts); progress stays on stderr.")] = False,
) -> None:
    """Prune, recover (LaCo), export, check fidelity and benchmark, into one build folder.

    With no options: the embedded SmolLM2-135M-Instruct, builtin text (Wikipedia + Python source), Wanda 50%, LaCo with a small CPU budget (256 x 128 tokens, 2 epochs; the paper's 2,048 samples on a GPU), fidelity reports, GGUF Q8_0 (or ONNX fp32) export and a runtime benchmark.

    Unchanged stages are reused on a rerun; --resume continues a killed one. Exits 1 when a gate fails (the reports are still written).
    """
    from laco_deploy.fidelity.tasks import parse_task_list

    overrides = {
        "export.target": target, "model.model": model, "prune.method": method, "prune.sparsity": sparsity,
        "prune.pattern": pattern, "prune.structured": structured, "compensate.method": recover,
        "data.calib": calib, "data.eval": eval_, "data.samples": samples, "data.seqlen": seqlen,
        "data.eval_samples": eval_samples, "data.seed": seed, "export.quant": quant, "model.device": device,
        "export.imatrix": IMATRIX_CALIB if imatrix else None,
        "model.trust_remote_code": trust_remote_code or None,
        "out": str(out) if out else None, "resume": resume or None, "fidelity.max_kl": max_kl,
        "fidelity.min_top1": min_top1, "fidelity.max_ppl_ratio": max_ppl_ratio,
        "fidelity.tasks": () if no_tasks else (parse_task_list(tasks) or None), "fidelity.task_limit": task_limit,
    }
    _build(*_settings(config, preset, overrides, size), preset, as_json)


def _settings(config: Path | None, preset: str | None, overrides: dict[str, Any],
              size: str | None = None) -> tuple[BuildConfig, Any, dict | None]:
    """The build's settings (preset or size choice < config file < flags), its boundary
    (pipeline.check_inputs), passed before the build folder and its log exist: a bad input leaves
    nothing behind, and the size choice's record (None without --size)."""
    from laco_deploy.buildconfig import merge, read_config_file
    from laco_deploy.pipeline import check_inputs
    from laco_deploy.presets import layer, preset_values
    from laco_deploy.stagecache import is_build_folder

    file_values = read_config_file(config) if config else {}
    choice = None
    if size is not None:
        if preset is not None:
            raise ConfigError("--size and --preset both choose the pruning, weight type and recovery: pass one of them "
                              "(flags such as --quant narrow what --size chooses from)")
        file_values, overrides, choice = _by_size(size, file_values, overrides)
    elif preset is not None:  # under the file and the flags, like a config file of its own
        file_values = layer(preset_values(preset), file_values, {k for k, v in overrides.items() if v is not None})
    cfg = merge(file_values, overrides)
    check_output(Path(cfg.out), "--out", kind="into", made_here=is_build_folder)
    return cfg, check_inputs(cfg), choice


def _by_size(size: str, file_values: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The measured configuration that fits `size` for the build's model, layered like a preset: the
    settings it decides that the file or flags gave agree with it (budget.disagrees) and are left to it."""
    from laco_deploy import budget
    from laco_deploy.presets import layer

    budget.parse_size(size)  # a nonsense budget fails before the model is read
    given = budget.given_settings(file_values, overrides)
    model_file = file_values.get("model") if isinstance(file_values.get("model"), dict) else {}
    model = overrides.get("model.model") or model_file.get("model") or ModelConfig().model
    remote = bool(overrides.get("model.trust_remote_code") or model_file.get("trust_remote_code"))
    choice = budget.choose(size, budget.model_shape(str(model), remote), given)
    flags = {k for k, v in overrides.items() if v is not None} - set(given)
    file_values = layer(choice.settings, budget.without(file_values, set(given)), flags)
    return file_values, {k: (None if k in given else v) for k, v in overrides.items()}, choice.record()


def _build(cfg: BuildConfig, checked, choice: dict | None, preset: str | None, as_json: bool) -> None:
    """Run the build into its folder, logging to build.log; print the summary; a failed gate exits 1."""
    from laco_deploy.budget import explain
    from laco_deploy.pipeline import build
    from laco_deploy.summary import summary_lines

    mark_folder(Path(cfg.out))
    with output.log_file(Path(cfg.out) / BUILD_LOG) as log_path:
        log.debug("laco-deploy %s build; settings: %s", __version__, to_dict(cfg))
        for line in explain(choice, full=True) if choice else ():
            log.info(line, extra=output.FILE_ONLY)
        chosen = f"size {choice['budget']} -> {choice['chosen']['label']} {choice['chosen']['quant']}, " if choice else ""
        output.say(f"building into {cfg.out} ({'preset ' + preset + ', ' if preset else ''}{chosen}target {cfg.export.target} {cfg.export.resolved_quant}, "
                   f"{cfg.prune.method} {cfg.prune.pattern or cfg.prune.structured or cfg.prune.sparsity}, "
                   f"recover {cfg.compensate.method}; full log in {log_path})")
        status_words = {"running": "[cyan]running[/]", "reused": "[green]reused (inputs and settings unchanged)[/]", "done": "[green]done[/]"}
        manifest = build(cfg, lambda s, st: output.say(f"stage {s:<10} {st}", f"stage {s:<10} {status_words.get(st, st)}"), checked,
                         size_budget=choice)
        summary = manifest["summary"]
        lines = summary_lines(summary, cfg.out)
        for line in lines:
            log.info(line, extra=output.FILE_ONLY)
    if as_json:
        typer.echo(json.dumps({"build_folder": str(cfg.out), "build_log": str(log_path), **summary}, indent=2, default=str))
    else:
        console.print()
        for line in lines:
            console.print(flags.user_text(line), highlight=False, soft_wrap=True)  # tables stay intact in narrow terminals and logs
    if not manifest["gates_passed"]:
        failed = [g for g in summary["gates"] if not g["passed"]]
        raise GateFailed("gate failed: " + "; ".join(f"{g['name']} {g.get('value')} vs limit {g.get('threshold')}" for g in failed))
