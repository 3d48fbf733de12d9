"""llama.cpp benchmark on the default model (SmolLM2-135M-Instruct): export round trip and runtime.

1. Round trip: the dense model exported as F32, F16, Q8_0 and Q4_K_M, each run by llama.cpp and
   compared with PyTorch on the same evaluation tokens (top-1 agreement, mean KL).
2. Side by side, for F16 and Q4_K_M: dense vs Wanda 50% (unstructured) vs Wanda 50% + LaCo vs
   structured 50% of FFN channels removed; perplexity (llama-perplexity protocol), prompt and
   generation speed, TTFT, load time, size, peak RSS. Goal: structured generation >= 1.3x dense.

Pruned/compensated models come from `laco_deploy.prune.run` / `laco_deploy.compensate.run`
(lean settings, cached in --work), or from existing directories (--pruned, --laco, --structured).

    python benchmarks/llamacpp_bench.py --out benchmarks/results/llamacpp.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laco_deploy.bench.report import bench_table  # noqa: E402
from laco_deploy.config import BenchConfig, CompensateConfig, DataConfig, ModelConfig, PruneConfig  # noqa: E402
from laco_deploy.fsutil import write_json  # noqa: E402

log = logging.getLogger("llamacpp_bench")
FFN = ("gate_proj", "up_proj", "down_proj")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("benchmarks/results/llamacpp-work"), help="cache of models and GGUF files")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp.json"))
    p.add_argument("--pruned", type=Path, help="existing Wanda 50%% directory (else pruned here)")
    p.add_argument("--laco", type=Path, help="existing LaCo-compensated directory (else compensated here)")
    p.add_argument("--structured", type=Path, help="existing structured-pruned directory (else pruned here)")
    p.add_argument("--samples", type=int, default=32, help="calibration samples for prune/compensate (default 32)")
    p.add_argument("--seqlen", type=int, default=256, help="calibration sample length (default 256)")
    p.add_argument("--epochs", type=int, default=2, help="LaCo epochs (default 2)")
    p.add_argument("--types", default="f16,q4_k_m", help="GGUF types benchmarked side by side")
    p.add_argument("--parity-types", default="f32,f16,q8_0,q4_k_m", help="types compared with PyTorch")
    p.add_argument("--parity-windows", type=int, default=4, help="evaluation windows for the round trip (default 4)")
    p.add_argument("--parity-ctx", type=int, default=256, help="tokens per round-trip window (default 256)")
    b = BenchConfig()
    p.add_argument("--repetitions", type=int, default=b.repetitions)
    p.add_argument("--threads", type=int, default=b.threads)
    p.add_argument("--n-prompt", type=int, default=b.n_prompt)
    p.add_argument("--n-gen", type=int, default=b.n_gen)
    p.add_argument("--ppl-ctx", type=int, default=b.ppl_ctx)
    p.add_argument("--ppl-windows", type=int, default=b.ppl_windows)
    return p.parse_args()


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def make_models(args, dense: Path) -> dict[str, Path]:
    """dense, Wanda 50%, Wanda 50% + LaCo, structured 50% FFN: HF directories (cached in --work)."""
    from laco_deploy import compensate, prune

    for given in (args.pruned, args.laco, args.structured):
        if given is not None and not _complete(given):
            raise SystemExit(f"{given} is not a complete model directory (config.json + *.safetensors)")
    data = DataConfig(samples=args.samples, seqlen=args.seqlen)
    model = ModelConfig(device="cpu")
    pruned = args.pruned or args.work / "wanda50"
    if not _complete(pruned):
        log.info("pruning: Wanda 50%% unstructured -> %s", pruned)
        prune.run(model, data, PruneConfig(method="wanda", sparsity=0.5), pruned)
    laco = args.laco or args.work / "wanda50-laco"
    if not _complete(laco):
        log.info("compensating: LaCo, %d epochs -> %s", args.epochs, laco)
        compensate.run(model, data, CompensateConfig(method="laco", epochs=args.epochs), pruned, laco)
    structured = args.structured or args.work / "structured50-ffn"
    if not _complete(structured):
        log.info("pruning: structured, 50%% of FFN channels -> %s", structured)
        prune.run(model, data, PruneConfig(method="wanda", structured=0.5, targets=FFN), structured)
    return {"dense": dense, "wanda50": pruned, "wanda50+laco": laco, "structured50-ffn": structured}


def export_all(dirs: dict[str, Path], types: list[str], work: Path) -> tuple[dict[str, dict[str, Path]], dict]:
    """GGUF files per type and label; reuses files newer than their source. Returns (paths, export records)."""
    from exporters.gguf import export

    paths: dict[str, dict[str, Path]] = {t: {} for t in types}
    records = {}
    for quant in types:
        for label, src in dirs.items():
            dest = work / "gguf" / f"{label}.{quant}.gguf"
            stamp = max(p.stat().st_mtime for p in src.glob("*.safetensors"))
            if not (dest.is_file() and dest.stat().st_mtime > stamp):
                res = export(src, dest, quant)
                records[f"{label}.{quant}"] = res.to_dict()
                log.info("exported %s %s: %.1f MiB in %.0f s, checks %s", label, quant, res.size_bytes / 2**20, res.wall_s, res.checks)
            paths[quant][label] = dest
    return paths, records


@torch.no_grad()
def round_trip(dense: Path, files: dict[str, Path], windows: int, ctx: int) -> dict[str, dict]:
    """llama.cpp vs PyTorch on the same evaluation tokens, per GGUF type."""
    from laco_deploy.runtimes.parity import logit_agreement
    from laco_deploy.runtimes.llamacpp import LlamaCppRunner
    from laco_deploy.runtimes.runner import TorchRunner
    from laco_deploy.data import evaluation_windows
    from laco_deploy.models import load_model

    loaded = load_model(str(dense))
    ids = evaluation_windows(loaded.tokenizer, "builtin", windows, ctx)
    ref = [TorchRunner(loaded.model).logits(w) for w in ids]
    out = {}
    for quant, path in files.items():
        runner = LlamaCppRunner(path, threads=1, n_ctx=ctx)
        cand = [runner.logits(w) for w in ids]
        runner.close()
        out[quant] = logit_agreement(torch.cat(ref), torch.cat(cand))
        out[quant].update(tokens=int(ids.numel()), size_mib=round(path.stat().st_size / 2**20, 1))
    return out


def round_trip_table(rt: dict[str, dict]) -> str:
    lines = ["| type | size MiB | top-1 agreement | mean KL (nats) | max KL |", "|---|---:|---:|---:|---:|"]
    for quant, m in rt.items():
        lines.append(f"| {quant} | {m['size_mib']:.1f} | {m['top1']:.4f} | {m['mean_kl']:.3g} | {m['max_kl']:.3g} |")
    tokens = next(iter(rt.values()))["tokens"]
    return "\n".join(lines + [f"\n{tokens} evaluation tokens, same ids fed to PyTorch (fp32) and llama.cpp; KL(PyTorch || llama.cpp)"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    from laco_deploy.bench.llamacpp_bench import run_benchmark
    from laco_deploy.models import ensure_default_converted

    t0 = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    dense = ensure_default_converted()
    types, parity_types = args.types.split(","), args.parity_types.split(",")
    parity_files, parity_exports = export_all({"dense": dense}, parity_types, args.work)
    rt = round_trip(dense, {q: parity_files[q]["dense"] for q in parity_types}, args.parity_windows, args.parity_ctx)
    print("## Round trip: llama.cpp vs PyTorch, default model\n\n" + round_trip_table(rt) + "\n", flush=True)
    dirs = make_models(args, dense)
    files, exports = export_all(dirs, types, args.work)
    cfg = BenchConfig(repetitions=args.repetitions, threads=args.threads, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      ppl_ctx=args.ppl_ctx, ppl_windows=args.ppl_windows)
    results = {}
    for quant in types:
        res = run_benchmark(files[quant], eval_spec="builtin", cfg=cfg)
        results[quant] = res.to_dict()
        s = res.models["structured50-ffn"]["tg_speedup"]
        print(f"## llama.cpp, {quant.upper()}\n\n{bench_table(res)}\n\ngoal: structured 50% FFN generation >= 1.3x dense "
              f"{quant.upper()}: {s:.2f}x -> {'met' if s >= 1.3 else 'NOT met'}\n", flush=True)
    write_json(args.out, {"round_trip": rt, "bench": results, "exports": {**parity_exports, **exports},
                          "models": {k: str(v) for k, v in dirs.items()}, "settings": vars(args) | {"work": str(args.work)},
                          "load_avg_end": os.getloadavg(), "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
