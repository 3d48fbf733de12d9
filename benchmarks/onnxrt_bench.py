"""onnxruntime benchmark on the default model (SmolLM2-135M): dense vs Wanda 50% vs LaCo vs
structured 50% FFN, side by side at fp32 (and int8), plus export parity for fp32/fp16/int8 and
the sparse-storage size of the pruned model.

Models are made with the project's own stages (laco_deploy.prune.run, laco_deploy.compensate.run)
at lean CPU settings, exported with exporters.onnx, then measured by
laco_deploy.bench.onnxrt_bench.run_benchmark (a fresh process per model). Work folders are reused
when they exist, so a rerun only measures.

    python benchmarks/onnxrt_bench.py --out benchmarks/results/onnxrt.json
    python benchmarks/onnxrt_bench.py --no-laco --no-int8      # faster
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from laco_deploy.config import (
    BenchConfig,
    DEFAULT_MODEL,
    CompensateConfig,
    DataConfig,
    ModelConfig,
    PruneConfig,
)
from laco_deploy.fsutil import write_json

log = logging.getLogger("onnxrt_bench")
FFN = ("gate_proj", "up_proj", "down_proj")
INT8_MODELS = ("dense", "structured FFN 50%")  # int8 exports benchmarked (each export re-traces the model)


def _model(path: Path, make) -> Path:
    """Reuse a finished model folder, else build it with `make(path)`."""
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        make(path)
        log.info("built %s in %.0f s", path, time.perf_counter() - t0)
    return path


def make_models(work: Path, args) -> dict[str, Path]:
    from laco_deploy import compensate, prune
    from laco_deploy.models import ensure_default_converted

    model_cfg = ModelConfig(model=args.model, device="cpu")
    data_cfg = DataConfig(samples=args.samples, seqlen=args.seqlen)
    models = {"dense": ensure_default_converted() if args.model == DEFAULT_MODEL else Path(args.model)}
    models["wanda 50%"] = _model(work / "wanda50", lambda p: prune.run(
        model_cfg, data_cfg, PruneConfig(method="wanda", sparsity=0.5), p))
    if args.laco:
        comp_cfg = CompensateConfig(method="laco", epochs=args.epochs)
        models["wanda 50% + LaCo"] = _model(work / "laco50", lambda p: compensate.run(
            model_cfg, data_cfg, comp_cfg, models["wanda 50%"], p))
    models["structured FFN 50%"] = _model(work / "ffn50", lambda p: prune.run(
        model_cfg, data_cfg, PruneConfig(method="wanda", structured=0.5, targets=FFN), p))
    return models


def export_all(models: dict[str, Path], work: Path, quants: list[str]) -> tuple[dict, dict]:
    """-> ({(label, quant): export folder}, {(label, quant): ExportResult dict})."""
    from exporters.onnx import export

    folders, results = {}, {}
    for quant in quants:
        for label, src in models.items():
            if (quant == "fp16" and label != "dense") or (quant == "int8" and label not in INT8_MODELS):
                continue
            dest = work / "onnx" / f"{src.name}-{quant}"
            t0 = time.perf_counter()
            results[(label, quant)] = export(src, dest, quant).to_dict()
            folders[(label, quant)] = dest
            log.info("exported %s %s in %.0f s", label, quant, time.perf_counter() - t0)
    for quant in ("fp32", "int8") if "int8" in quants else ("fp32",):
        dest = work / "onnx" / f"wanda50-{quant}-sparse"
        results[("wanda 50%", f"{quant} sparse storage")] = export(models["wanda 50%"], dest, quant, sparse_storage=True).to_dict()
    return folders, results


def parity_table(results: dict) -> str:
    lines = ["| model | type | max |diff| prefill | max |diff| decode | top-1 | greedy 16 tok | size MiB | export s |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for (label, quant), r in results.items():
        p, g = r["checks"]["parity"], r["checks"]["greedy"]
        greedy = "identical" if g["identical"] else f"first {g['matching_prefix']} match"
        lines.append(f"| {label} | {quant} | {p['max_abs_diff_prefill']:.2e} | {p['max_abs_diff_decode']:.2e} | "
                     f"{p['top1_agreement'] * 100:.2f}% | {greedy} | {r['size_bytes'] / 2**20:.1f} | {r['wall_s']:.0f} |")
    p = next(iter(results.values()))["checks"]["parity"]
    lines.append(f"\nparity: {p['prefill_tokens']} evaluation tokens prefilled from an empty past, then "
                 f"{p['decode_steps']} decoded one at a time from the KV cache, against the fp32 PyTorch model")
    return "\n".join(lines)


def storage_table(results: dict) -> str:
    lines = ["| export | dense files MiB | sparse storage MiB | ratio | weights compressed | zero share |",
             "|---|---:|---:|---:|---:|---:|"]
    for (label, kind), r in results.items():
        if kind.endswith("sparse storage"):
            s = r["checks"]["storage"]
            lines.append(f"| {label} {kind.split()[0]} | {s['dense_bytes'] / 2**20:.1f} | {s['sparse_bytes'] / 2**20:.1f} | "
                         f"{s['ratio']:.3f} | {s['tensors_compressed']} | {s['zero_fraction']} |")
    lines.append("\nmeasured file sizes (graph + weights); loading densifies: same speed as the dense export")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("benchmarks/results/onnxrt-work"), help="model and export folders (reused)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/onnxrt.json"), help="JSON results")
    ap.add_argument("--samples", type=int, default=32, help="calibration samples for pruning and LaCo")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sample")
    ap.add_argument("--epochs", type=int, default=2, help="LaCo epochs")
    ap.add_argument("--no-laco", dest="laco", action="store_false", help="skip the LaCo-compensated model")
    ap.add_argument("--no-int8", dest="int8", action="store_false", help="skip the int8 comparison")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="dense model: 'default' or a Hugging Face directory")
    ap.add_argument("--repetitions", type=int, default=BenchConfig.repetitions, help="timed repetitions")
    ap.add_argument("--n-prompt", type=int, default=BenchConfig.n_prompt, help="prompt tokens (pp, TTFT)")
    ap.add_argument("--n-gen", type=int, default=BenchConfig.n_gen, help="generated tokens (tg)")
    ap.add_argument("--ppl-ctx", type=int, default=BenchConfig.ppl_ctx, help="perplexity window")
    ap.add_argument("--ppl-windows", type=int, default=BenchConfig.ppl_windows, help="perplexity windows")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from laco_deploy.bench.onnxrt_bench import run_benchmark
    from laco_deploy.bench.report import bench_table

    models = make_models(args.work, args)
    quants = ["fp32", "fp16"] + (["int8"] if args.int8 else [])
    folders, exports = export_all(models, args.work, quants)
    print("## Export parity (onnxruntime vs PyTorch fp32)\n\n" + parity_table(exports) + "\n", flush=True)
    print("## Sparse storage\n\n" + storage_table(exports) + "\n", flush=True)
    cfg = BenchConfig(repetitions=args.repetitions, n_prompt=args.n_prompt, n_gen=args.n_gen, ppl_ctx=args.ppl_ctx,
                      ppl_windows=args.ppl_windows)
    load_before = os.getloadavg()
    benches = {}
    for quant in ["fp32"] + (["int8"] if args.int8 else []):
        group = {label: folders[(label, q)] for (label, q) in folders if q == quant}
        result = run_benchmark(group, eval_spec="builtin", cfg=cfg, device="cpu")
        benches[quant] = result.to_dict()
        print(f"## onnxruntime, {quant}\n\n" + bench_table(result) + "\n", flush=True)
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"machine load average (1, 5, 15 min) before the runtime benchmark {load['before']}, after {load['after']} "
          f"on {os.cpu_count()} CPUs: other processes share these cores, compare ratios within a table")
    write_json(args.out, {"exports": {f"{k[0]} | {k[1]}": v for k, v in exports.items()}, "bench": benches,
                          "load_average": load, "settings": vars(args) | {"work": str(args.work), "out": str(args.out)}})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
