"""Speed/quality frontier on the default model (SmolLM2-135M-Instruct), issue 12.4.

Rows: dense; structured-pruned models (--ratios x --targets-sets: FFN channels only, or FFN + KV
head groups) and unstructured ones (--unstructured: Wanda 50%, 2:4), each as pruned, pruned + LaCo
and pruned + QA-LaCo (--variants, --qa-quants). Columns, per weight type on its runtime (--quants:
GGUF types on llama.cpp, ONNX types on onnxruntime): perplexity on the runtime (llama-perplexity
protocol, builtin text), KL and top-1 agreement against the dense fp32 PyTorch model and the
perplexity of each evaluation domain (fidelity stage, same windows for every cell), decode and
prompt tok/s, file size, peak RSS. A QA-LaCo model is measured at the type it was trained for
only; dense also at --dense-quants (the equal-file-size comparison) and, as `dense-imatrix`, at
--imatrix-quants: llama.cpp's k-quants weighted by an importance matrix of the calibration text
(laco_deploy.imatrix, computed once into WORK/imatrix/; --imatrix FILE takes an existing one).

Everything is cached in --work (models, exports, one JSON per measured cell), so an interrupted
run resumes where it stopped; --reuse LABEL=DIR (a model) or LABEL@TYPE=FILE (an export) takes
existing results instead of building them. `--stage build` and `--stage measure` split the run in
two processes over the same --work: one builds the models while the other measures the cells of
those finished (rerun it until the build is done; a last plain run adds the speed rounds and the
report). The full grid takes hours on 2 cores; --quick is the reduced profile (dense + structured 30% of FFN channels, 30% of FFN channels and KV head groups, and
Wanda 50%, each pruned / +LaCo / +QA-LaCo q4_k_m, at F16, Q8_0, Q4_K_M on llama.cpp and fp32, int8 on
onnxruntime; 3 speed rounds; explicit flags override it): 85 minutes on 2 cores.

    OMP_NUM_THREADS=1 python benchmarks/frontier_bench.py --quick --work /tmp/frontier
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laco_deploy.bench import frontier as F  # noqa: E402
from laco_deploy.config import BenchConfig, CompensateConfig, DataConfig, FidelityConfig, ModelConfig  # noqa: E402
from laco_deploy.fsutil import write_json, write_text  # noqa: E402
from laco_deploy.targets import GGUF  # noqa: E402

log = logging.getLogger("frontier_bench")
PROFILES = {
    "full": {"ratios": "0.2,0.3,0.5", "targets_sets": "ffn,all", "variants": "pruned,laco,qa", "unstructured": "wanda50,2:4",
             "qa_quants": "q4_k_m,int8", "quants": "f16,q8_0,q4_k_m,fp32,int8", "dense_quants": "q6_k,q5_k_m,q5_k_s,q4_k_s,q3_k_m,q3_k_s,q2_k",
             "imatrix_quants": "q6_k,q5_k_m,q5_k_s,q4_k_m,q4_k_s,q3_k_m,q3_k_s,q2_k", "repetitions": 3, "speed_rounds": 0, "n_prompt": 512, "n_gen": 128, "ppl_ctx": 512, "ppl_windows": 8, "fid_windows": 8},
    "quick": {"ratios": "0.3", "targets_sets": "ffn,all", "variants": "pruned,laco,qa", "unstructured": "wanda50",
              "qa_quants": "q4_k_m", "quants": "f16,q8_0,q4_k_m,fp32,int8", "dense_quants": "q6_k,q5_k_m,q3_k_m,q2_k",
              "imatrix_quants": "q4_k_m,q3_k_m,q2_k", "repetitions": 2, "speed_rounds": 3, "n_prompt": 128, "n_gen": 32, "ppl_ctx": 256, "ppl_windows": 4, "fid_windows": 2},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("benchmarks/results/frontier-work"), help="cache of models, exports and cells")
    p.add_argument("--out", type=Path, help="JSON results (default: WORK/frontier.json; .md and .html beside it)")
    p.add_argument("--quick", action="store_true", help="the reduced profile (see the module docstring)")
    lists = {"ratios": "structured ratios, e.g. 0.2,0.3,0.5", "targets_sets": "ffn (FFN channels) and/or all (FFN + heads)",
             "variants": "pruned,laco,qa", "unstructured": "wanda50 and/or 2:4, or none",
             "qa_quants": "types QA-LaCo trains for (config.QUANT_AWARE: GGUF q8_0, q6_k ... q2_k; ONNX int8)",
             "quants": "weight types: GGUF f16,q8_0,q4_k_m,... (llama.cpp); ONNX fp32,int8 (onnxruntime)",
             "dense_quants": "extra types for the dense model only (equal-size comparison)",
             "imatrix_quants": "GGUF k-quants of the dense model with an importance matrix (issue 32's rival), or none"}
    for name, text in lists.items():
        p.add_argument("--" + name.replace("_", "-"), help=text)
    for name in ("repetitions", "n_prompt", "n_gen", "ppl_ctx", "ppl_windows"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"runtime benchmark {name} (BenchConfig)")
    p.add_argument("--fid-windows", type=int, help="fidelity windows per evaluation domain (KL, top-1, domain ppl)")
    p.add_argument("--fid-seqlen", type=int, default=256, help="tokens per fidelity window")
    p.add_argument("--eval", default="domains", help="fidelity evaluation texts (default: domains)")
    p.add_argument("--speed-rounds", type=int, help="extra speed-only passes over all cells, round robin; each cell keeps "
                   "its best tok/s (a shared machine's load slows some runs, never speeds one up)")
    p.add_argument("--threads", type=int, default=1, help="runtime threads (default 1: least disturbed on a shared machine)")
    p.add_argument("--samples", type=int, default=DataConfig.samples, help="pruning (and importance-matrix) calibration samples")
    p.add_argument("--imatrix", type=Path, help="importance-matrix file of the dense model for --imatrix-quants "
                   "(default: computed on the calibration text into WORK/imatrix/)")
    p.add_argument("--comp-samples", type=int, help="LaCo calibration samples (default: the compensate stage's CPU budget)")
    p.add_argument("--epochs", type=int, default=CompensateConfig.epochs, help="LaCo epochs")
    p.add_argument("--skip", action="append", default=[], metavar="LABEL@TYPE", help="leave a cell of the grid out (repeatable)")
    p.add_argument("--reuse", action="append", default=[], metavar="LABEL=DIR|LABEL@TYPE=FILE",
                   help="an existing model folder or export for a row (repeatable)")
    p.add_argument("--stage", choices=("all", "build", "measure"), default="all",
                   help="build: build the models and stop; measure: measure the cells whose models are built, leave "
                   "the rest out (run it beside a `build` process on the same --work, then once more at the end)")
    args = p.parse_args(argv)
    profile = PROFILES["quick" if args.quick else "full"]
    for key, value in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out or args.work / "frontier.json"
    return args


def _split(text: str) -> list[str]:
    return [] if text in ("", "none") else [x.strip() for x in text.split(",")]


def parse_reuse(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        key, sep, path = item.partition("=")
        if not sep or not Path(path).exists():
            raise SystemExit(f"--reuse {item}: expected LABEL=DIR or LABEL@TYPE=FILE with an existing path")
        out[key] = Path(path)
    return out


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def build_models(specs: list[F.Spec], args, reuse: dict[str, Path], dense: Path, build: bool = True) -> dict[str, Path]:
    """HF folder per model label; built with the project's stages into WORK/models (resumable).
    With build=False only the models already complete are returned."""
    from laco_deploy import compensate, prune

    model_cfg, data_cfg = ModelConfig(device="cpu"), DataConfig(samples=args.samples)
    dirs = {F.DENSE: dense}
    for spec in specs[1:]:
        dest = reuse.get(spec.label, args.work / "models" / F.slug(spec.label))
        complete = _complete(dest)
        if complete or build:
            dirs[spec.label] = dest
        if complete or not build:
            continue
        t0 = time.perf_counter()
        if spec.prune is not None:
            prune.run(model_cfg, data_cfg, spec.prune, dest, resume=True)
        else:
            comp = CompensateConfig(epochs=args.epochs, samples=args.comp_samples, quant_aware=spec.quant_aware)
            compensate.run(model_cfg, data_cfg, comp, dirs[spec.base], dest, resume=True)
        log.info("built %s in %.0f s -> %s", spec.label, time.perf_counter() - t0, dest)
    return dirs


def dense_imatrix(args, dense: Path) -> Path:
    """The dense model's importance matrix on the pruning calibration samples (computed once)."""
    if args.imatrix is not None:
        return args.imatrix
    from laco_deploy.imatrix import compute

    path = args.work / "imatrix" / "dense.imatrix.gguf"
    if not path.is_file():
        res = compute(dense, DataConfig(samples=args.samples), path)
        log.info("importance matrix of the dense model: %d weights, %d x %d tokens, %.0f s -> %s",
                 res.entries, res.samples, res.seqlen, res.wall_s, path)
    return path


def export_cell(label: str, quant: str, src: Path, args, reuse: dict[str, Path], imatrix: Path | None = None) -> Path:
    """The export of one cell (weighted by `imatrix` when given), reused when newer than its inputs."""
    if f"{label}@{quant}" in reuse:
        return reuse[f"{label}@{quant}"]
    target = F.target_of(quant)
    dest = args.work / target.name / target.artifact_name(F.slug(label), quant)
    stamp = max(p.stat().st_mtime for p in [*src.glob("*.safetensors"), *([imatrix] if imatrix else [])])
    if not (dest.exists() and dest.stat().st_mtime > stamp):
        res = target.export(src, dest, quant, imatrix=imatrix)
        log.info("exported %s %s: %.1f MiB in %.0f s", label, quant, res.size_bytes / 2**20, res.wall_s)
    return dest


def measure_cell(label: str, quant: str, path: Path, dense: Path, args, settings: dict) -> dict:
    """Runtime benchmark + fidelity for one cell; cached in WORK/cells as JSON with its settings."""
    import json

    from laco_deploy import fidelity

    cache = args.work / "cells" / f"{F.slug(label)}.{quant}.json"
    if cache.is_file():
        cell = json.loads(cache.read_text())
        if cell.get("settings") == settings and cell.get("path") == str(path):
            return cell
    target = F.target_of(quant)
    bench_cfg = BenchConfig(repetitions=args.repetitions, threads=args.threads, n_prompt=args.n_prompt,
                            n_gen=args.n_gen, ppl_ctx=args.ppl_ctx, ppl_windows=args.ppl_windows)
    load_before = os.getloadavg()[0]
    m = target.run_benchmark({label: path}, eval_spec="builtin", cfg=bench_cfg, device="cpu").models[label]
    fid = fidelity.run(ModelConfig(model=str(dense), device="cpu"),
                       DataConfig(eval=args.eval, eval_samples=args.fid_windows, seqlen=args.fid_seqlen),
                       FidelityConfig(layerwise=False, threads=args.threads), {label: path},
                       args.work / "fidelity" / f"{F.slug(label)}.{quant}")
    c = fid.candidates[label]
    cell = {"model": label, "quant": quant, "runtime": target.runtime, "path": str(path), "settings": settings,
            "size_mib": m["size_mib"], "ppl": m["ppl"], "tg_tps": m["tg_tps"]["median"], "tg_spread": m["tg_tps"]["spread"],
            "pp_tps": m["pp_tps"]["median"], "pp_spread": m["pp_tps"]["spread"], "peak_rss_mib": m["peak_rss_mib"],
            "load_s": m["load_s"]["median"], "kl_mean": c["metrics"]["kl"]["mean"], "top1": c["metrics"]["top1"],
            "domains": {d: v["ppl"] for d, v in c["domains"].items()},
            "dense_torch_domains": {d: v["ppl"] for d, v in fid.dense["domains"].items()},
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    write_json(cache, cell)
    return cell


def speed_rounds(cells: list[dict], args) -> None:
    """Re-time every cell `--speed-rounds` times, cell after cell in turn (perplexity on one 16-token
    window only), each round saved to its cell's JSON; then decode / prompt speed = best of all runs."""
    cfg = BenchConfig(repetitions=args.repetitions, threads=args.threads, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      ppl_ctx=16, ppl_windows=1)
    for r in range(args.speed_rounds):
        for cell in cells:
            runs = cell.setdefault("speed_runs", [])
            if len(runs) > r:
                continue
            m = F.target_of(cell["quant"]).run_benchmark({cell["model"]: Path(cell["path"])}, eval_spec="builtin",
                                                         cfg=cfg).models[cell["model"]]
            runs.append({"tg_tps": m["tg_tps"]["median"], "pp_tps": m["pp_tps"]["median"], "load_avg_1m": os.getloadavg()[0]})
            write_json(args.work / "cells" / f"{F.slug(cell['model'])}.{cell['quant']}.json", cell)
        log.info("speed round %d/%d done", r + 1, args.speed_rounds)
    for cell in cells:
        runs = cell.get("speed_runs", [])[: args.speed_rounds]
        cell["tg_first"], cell["pp_first"] = cell["tg_tps"], cell["pp_tps"]
        cell["tg_tps"] = max([cell["tg_tps"]] + [x["tg_tps"] for x in runs])
        cell["pp_tps"] = max([cell["pp_tps"]] + [x["pp_tps"] for x in runs])


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    from laco_deploy.models import ensure_default_converted

    t0 = time.perf_counter()
    reuse = parse_reuse(args.reuse)
    specs = F.plan_models([float(r) for r in _split(args.ratios)], _split(args.targets_sets), _split(args.variants),
                          _split(args.unstructured), _split(args.qa_quants))
    cells_plan = F.plan_cells(specs, _split(args.quants), _split(args.dense_quants), _split(args.imatrix_quants))
    unknown = set(args.skip) - {f"{m}@{q}" for m, q in cells_plan}
    if unknown:
        raise SystemExit(f"--skip {', '.join(sorted(unknown))}: not a cell of this grid (LABEL@TYPE, e.g. wanda50@q8_0)")
    cells_plan = [(m, q) for m, q in cells_plan if f"{m}@{q}" not in args.skip]
    measured = {m for m, _ in cells_plan}  # a model whose cells are all skipped is not built (unless a base)
    specs = [s for s in specs if s.label in measured or any(t.base == s.label and t.label in measured for t in specs)]
    log.info("%d models, %d cells: %s", len(specs), len(cells_plan), ", ".join(f"{m}@{q}" for m, q in cells_plan))
    args.work.mkdir(parents=True, exist_ok=True)
    dense = ensure_default_converted()
    dirs = build_models(specs, args, reuse, dense, build=args.stage != "measure")
    dirs[F.DENSE_IMATRIX] = dense
    if args.stage == "build":
        log.info("built %d models in %.0f s", len(dirs), time.perf_counter() - t0)
        return 0
    missing = [f"{m}@{q}" for m, q in cells_plan if m not in dirs]
    if missing:
        log.info("not built yet, left out: %s", ", ".join(missing))
        cells_plan = [(m, q) for m, q in cells_plan if m in dirs]
    settings = {k: getattr(args, k) for k in ("repetitions", "n_prompt", "n_gen", "ppl_ctx", "ppl_windows", "fid_windows",
                                              "fid_seqlen", "eval", "threads")}
    imatrix = dense_imatrix(args, dense) if any(m == F.DENSE_IMATRIX for m, _ in cells_plan) else None
    cells = []
    for label, quant in cells_plan:
        path = export_cell(label, quant, dirs[label], args, reuse, imatrix if label == F.DENSE_IMATRIX else None)
        cells.append(measure_cell(label, quant, path, dense, args, settings))
        log.info("measured %s %s (%d/%d)", label, quant, len(cells), len(cells_plan))
    speed_rounds(cells, args)
    first_gguf = next((q for q in _split(args.quants) if F.target_of(q) is GGUF), None)
    goals = (F.structured_goal(cells, first_gguf) if first_gguf else []) + F.equal_size_goal(cells) + F.qa_goal(cells)
    if imatrix is not None:
        goals += F.equal_size_goal(cells, rival=F.DENSE_IMATRIX)
    info = [f"date {date.today()}; default model SmolLM2-135M-Instruct; {os.cpu_count()} CPUs, {args.threads} runtime "
            f"thread(s); load average at the end {os.getloadavg()[0]:.2f}",
            f"runtime: {args.repetitions} repetitions, pp {args.n_prompt} tokens, tg {args.n_gen} tokens, ppl "
            f"{args.ppl_windows} x {args.ppl_ctx}-token windows of the builtin text (second half scored)",
            f"fidelity: {args.fid_windows} x {args.fid_seqlen}-token windows per domain of {args.eval}; KL(dense fp32 "
            "PyTorch || cell), top-1 agreement; domain ppl of the cell on its runtime",
            f"tok/s: best of {1 + args.speed_rounds} runs per cell (the first, then {args.speed_rounds} speed-only rounds "
            f"round robin over all cells), each the median of {args.repetitions} repetitions; tg x / pp x: against dense "
            "at the same type, measured in this run"]
    table = F.markdown(cells)
    print("\n".join(info) + "\n\n" + table + "\n\n" + "\n".join(F.goal_lines(goals)))
    write_text(args.out.with_suffix(".md"), "\n".join(f"- {s}" for s in info) + "\n\n" + table + "\n\n" +
                      "\n".join(f"- {g}" for g in F.goal_lines(goals)) + "\n")
    write_text(args.out.with_suffix(".html"), F.html_page(cells, goals, info))
    write_json(args.out, {"cells": cells, "goals": goals, "info": info, "models": {k: str(v) for k, v in dirs.items()},
                          "settings": vars(args) | {"work": str(args.work), "out": str(args.out)},
                          "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {args.out} and its .md, .html ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
