"""`laco-deploy bench run` (runtime benchmarks) and `laco-deploy bench compare` (CI regression gate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import ForceOpt, check, console, parse_labeled_paths
from laco_deploy.config import BenchConfig
from laco_deploy.errors import ConfigError
from laco_deploy.fsutil import check_output
from laco_deploy.targets import GGUF, RUNTIMES

bench_app = typer.Typer(
    help="Benchmark exported models on their runtime (`bench run`), or compare two benchmark results (`bench compare`).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
_B = BenchConfig()


@bench_app.command("run")
def bench_run(
    models: Annotated[list[str], typer.Argument(help="Exported models as LABEL=PATH (.gguf files for llama.cpp; ONNX folders or .onnx files for onnxruntime). The first is the reference for speed ratios.")],
    runtime: Annotated[str, typer.Option("--runtime", "-r", help=" or ".join(RUNTIMES) + ".")] = GGUF.runtime,
    eval_: Annotated[str, typer.Option("--eval", help="Evaluation text for perplexity: builtin, builtin:fiction|techdoc|code|dialogue, a .txt/.jsonl file, or hf:NAME[:CONFIG][:SPLIT].")] = "builtin",
    repetitions: Annotated[int, typer.Option("--repetitions", help="Timed repetitions per measurement (median and spread reported).")] = _B.repetitions,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: all physical cores).")] = _B.threads,
    n_prompt: Annotated[int, typer.Option("--n-prompt", help="Prompt tokens for the prompt-processing speed.")] = _B.n_prompt,
    n_gen: Annotated[int, typer.Option("--n-gen", help="Generated tokens for the generation speed.")] = _B.n_gen,
    ppl_ctx: Annotated[int, typer.Option("--ppl-ctx", help="Perplexity window; the second half of each window is scored (llama-perplexity protocol).")] = _B.ppl_ctx,
    ppl_windows: Annotated[int, typer.Option("--ppl-windows", help="Windows of evaluation text scored for perplexity.")] = _B.ppl_windows,
    device: Annotated[str, typer.Option("--device", help="onnxruntime: cpu or cuda (CUDA provider, needs the gpu extra).")] = "cpu",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the result as JSON here.")] = None,
    force: ForceOpt = False,
) -> None:
    """Measure perplexity, prompt and generation speed, time to first token, load time, size and peak RSS."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"--runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    cfg = BenchConfig(repetitions=repetitions, threads=threads, n_prompt=n_prompt, n_gen=n_gen, ppl_ctx=ppl_ctx, ppl_windows=ppl_windows)
    check(cfg.validate())
    from laco_deploy.artifacts import BenchResult

    check_output(out, "--out", force=force, kind="file", made_here=BenchResult.written_at, force_option="--force")
    paths = parse_labeled_paths(models, "model", "an exported model (.gguf file for llama.cpp, ONNX folder or .onnx file for onnxruntime)")
    result = RUNTIMES[runtime].run_benchmark(paths, eval_spec=eval_, cfg=cfg, device=device)
    from laco_deploy.bench.report import bench_table

    console.print(bench_table(result))
    if out is not None:
        from laco_deploy.fsutil import write_json

        write_json(out, result.to_dict())
        console.print(f"wrote {out}")


@bench_app.command("compare")
def bench_compare(
    baseline: Annotated[Path, typer.Argument(help="Baseline suite result (JSON), e.g. benchmarks/baselines/ci.json.")],
    current: Annotated[Path, typer.Argument(help="Current suite result (JSON) from benchmarks/run_suite.py.")],
    tolerance: Annotated[Optional[list[str]], typer.Option("--tolerance", help="Override a metric's tolerance: METRIC=rel:0.1 or METRIC=abs:0.5 (repeatable).")] = None,
    markdown: Annotated[Optional[Path], typer.Option("--markdown", help="Also write the table to this Markdown file (for a PR comment).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --markdown when it is an earlier table of this command (never another file).")] = False,
) -> None:
    """Compare two benchmark results metric by metric; exit 1 on any regression, 0 otherwise.

    Tolerances come from the baseline (set per metric in the suite's config): relative for times, absolute or relative for quality. Times are ratios against a reference measured in the same run, so a noisy or slower machine does not raise false alarms.
    """
    from laco_deploy.bench.compare import compare, failed, is_table_file, load_result, parse_tolerances, render
    from laco_deploy.errors import GateFailed

    check_output(markdown, "--markdown", force=force, kind="file", made_here=is_table_file, force_option="--force")
    rows = compare(load_result(baseline), load_result(current), parse_tolerances(tolerance or []))
    table = render(rows)
    console.print(table, highlight=False)
    if markdown is not None:
        from laco_deploy.fsutil import write_text

        write_text(markdown, table + "\n")
    bad = failed(rows)
    if bad:
        raise GateFailed(f"{len(bad)} metric(s) regressed: " + ", ".join(f"{r.name} ({r.status.lower()})" for r in bad))
    console.print(f"no regression across {len(rows)} metrics")
