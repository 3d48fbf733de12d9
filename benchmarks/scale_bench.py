"""Scale benchmark (issue 13): memory and time of every stage from 135M to 1.1B parameters.

For each size a random-init Llama model is built from a config and saved as safetensors
(SmolLM2-135M's shape, a 0.5B one, TinyLlama-1.1B's shape; all with SmolLM2's 49,152-token
vocabulary and tokenizer). Then, each stage in a fresh process through the CLI, with --offload disk:
prune (Wanda 50%), compensate (LaCo with a fixed small budget), GGUF q8_0 export, fidelity (pruned,
recovered and the GGUF file against the dense model). Per stage: wall time and peak RSS (the
process's ru_maxrss: the fixed process overhead is counted), their ratios to one decoder layer's
and to the whole model's fp32 size, and laco_deploy.memplan's estimate with its error.

    python benchmarks/scale_bench.py                      # 135m, 0.5b, 1.1b
    python benchmarks/scale_bench.py --sizes 135m,0.5b --threads 1 --out benchmarks/results/scale.json
    python benchmarks/scale_bench.py --sizes 1.1b --laco-samples 1.1b=4 --resume   # continue a stopped run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from laco_deploy.fsutil import write_json
from laco_deploy.memplan import Workload, estimate_build
from laco_deploy.sizing import MIB, model_bytes

log = logging.getLogger("scale_bench")

VOCAB = 49152  # SmolLM2's tokenizer, used by every size
SIZES = {  # name -> LlamaConfig fields
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": True},  # the fixed process overhead, in seconds
    "135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "tie_word_embeddings": True},  # SmolLM2-135M
    "0.5b": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 4, "tie_word_embeddings": True},
    "1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "tie_word_embeddings": False},  # TinyLlama-1.1B
}
# the fixed small budget: calibration and evaluation tokens do not grow with the model
JOB = Workload(calib_samples=16, seqlen=128, prune_batch=8, prune_offload="disk", compensate_samples=16,
               compensate_seqlen=128, compensate_batch=2, compensate_offload="disk", eval_windows=8,
               torch_candidates=2, runtime_candidates=1)
DATA = ["--samples", str(JOB.calib_samples), "--seqlen", str(JOB.seqlen)]
STAGES = ("prune", "compensate", "export", "fidelity")


def make_model(size: str, out: Path) -> None:
    """Random-init Llama of `size`, saved as safetensors with SmolLM2's tokenizer (run in a child)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from laco_deploy.models import local_model_dir

    tok = AutoTokenizer.from_pretrained(local_model_dir("default"))
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SIZES[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def run_measured(cmd: list[str], log_file: Path) -> dict:
    """Run `cmd` in a fresh process; -> wall time and its peak RSS (ru_maxrss, children included)."""
    t0 = time.perf_counter()
    with open(log_file, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}); see {log_file}:\n{log_file.read_text()[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_mib": round(usage.ru_maxrss * 1024 / MIB, 1)}


def stage_commands(dense: Path, work: Path, threads: int, job: Workload = JOB) -> dict[str, list[str]]:
    cli = [sys.executable, "-c", "from laco_deploy.cli import main; main()", "--threads", str(threads)]
    pruned, recovered, gguf = work / "pruned", work / "recovered", work / "recovered.q8_0.gguf"
    return {
        "prune": [*cli, "prune", "--model", str(dense), "--out", str(pruned), "--method", "wanda", "--sparsity", "0.5",
                  "--offload", "disk", "--force", *DATA],
        "compensate": [*cli, "compensate", "--dense", str(dense), "--sparse", str(pruned), "--out", str(recovered),
                       "--offload", "disk", "--epochs", "1", "--samples", str(job.compensate_samples),
                       "--seqlen", str(job.compensate_seqlen), "--json", str(work / "compensate.json"), "--force"],
        "export": [*cli, "export", "--model", str(recovered), "--target", "gguf", "--quant", "q8_0", "--out", str(gguf), "--force"],
        "fidelity": [*cli, "fidelity", "--dense", str(dense), "--candidate", f"pruned={pruned}",
                     "--candidate", f"laco={recovered}", "--candidate", f"gguf-q8_0={gguf}", "--eval", "builtin",
                     "--eval-samples", str(JOB.eval_windows), "--seqlen", str(JOB.seqlen), "--threads", str(threads),
                     "--report", str(work / "fidelity")],
    }


def bench_size(size: str, work: Path, threads: int, save, job: Workload = JOB, done: dict | None = None,
               only: tuple[str, ...] = STAGES) -> dict:
    """Build the model (kept from an earlier run when its folder is complete), run every stage
    measured; -> one row per stage plus the model's sizes. Stages in `done` (an earlier run's rows,
    whose outputs are still in `work`) are kept, not rerun. `save(row)` is called after each stage,
    so an interrupted run keeps what it measured."""
    work.mkdir(parents=True, exist_ok=True)
    dense = work / "dense"
    if (dense / "config.json").is_file() and any(dense.glob("*.safetensors")):
        log.info("%s: reusing the model in %s", size, dense)
    else:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--make", size, str(dense)], check=True)
        log.info("%s: model built in %.0f s", size, time.perf_counter() - t0)
    sizes = model_bytes(dense)
    estimates = {e.stage: e for e in estimate_build(sizes, job)}
    rows: dict[str, dict] = dict(done or {})
    row = {"params": sizes["total"] // 4, "model_fp32_mib": round(sizes["total"] / MIB, 1),
           "layer_fp32_mib": round(sizes["layer_max"] / MIB, 1), "num_layers": sizes["num_layers"],
           "config": SIZES[size], "compensate_samples": job.compensate_samples, "stages": rows}
    for stage, cmd in stage_commands(dense, work, threads, job).items():
        if stage in rows or stage not in only:
            log.info("%s %-10s %s", size, stage, "measured before (--resume)" if stage in rows else "skipped (--stages)")
            if stage in rows:  # the measurement is kept; the estimate is today's
                rows[stage].update(_compare(rows[stage], estimates[stage], sizes))
            continue
        m = run_measured(cmd, work / f"{stage}.log")
        m.update(_compare(m, estimates[stage], sizes))
        rows[stage] = m
        save(row)
        log.info("%s %-10s %7.1f s  peak %7.0f MiB  (estimate %7.0f MiB, %+.0f%%)", size, stage, m["wall_s"],
                 m["peak_rss_mib"], m["estimate_mib"], 100 * m["estimate_error"])
    return row


def _compare(m: dict, est, sizes: dict) -> dict:
    """The estimate for a measured stage `m`, its error, and the peak's ratios to one layer and to the model."""
    return {"estimate_mib": round(est.host_bytes / MIB, 1), "estimate_terms_mib": {k: round(v / MIB, 1) for k, v in est.terms.items()},
            "estimate_error": round(est.host_bytes / MIB / m["peak_rss_mib"] - 1, 3),
            "estimate_device_mib": round(est.device_bytes / MIB, 1),
            "peak_per_layer": round(m["peak_rss_mib"] * MIB / sizes["layer_max"], 2),
            "peak_per_model": round(m["peak_rss_mib"] * MIB / sizes["total"], 3)}


def table(results: dict) -> str:
    """Markdown: one row per size and stage; time ratios against the smallest size."""
    lines = ["| size | params | stage | wall s | wall / smallest (params ratio) | peak RSS MiB | / layer fp32 | "
             "/ model fp32 | estimate MiB | estimate error |", "|" + "---|" * 10]
    first = next(iter(results.values()))
    for size, r in results.items():
        scale = r["params"] / first["params"]
        for stage, m in r["stages"].items():
            ratio = m["wall_s"] / max(first["stages"][stage]["wall_s"], 1e-9)
            lines.append(f"| {size} | {r['params'] / 1e6:.0f}M | {stage} | {m['wall_s']:.0f} | {ratio:.1f}x ({scale:.1f}x) | "
                         f"{m['peak_rss_mib']:.0f} | {m['peak_per_layer']:.1f} | {m['peak_per_model']:.0%} | "
                         f"{m['estimate_mib']:.0f} | {m['estimate_error']:+.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="135m,0.5b,1.1b", help=f"comma-separated (default: %(default)s; all: {','.join(SIZES)})")
    ap.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads per stage (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/laco-scale"), help="scratch folder (~20 GB for 1.1b)")
    ap.add_argument("--keep", action="store_true", help="keep each size's models (deleted by default)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset to run (default: %(default)s)")
    ap.add_argument("--resume", action="store_true", help="keep the stages already in --out and run the rest, "
                    "reusing the models in --work (implies --keep)")
    ap.add_argument("--laco-samples", default="", metavar="SIZE=N,...",
                    help=f"LaCo calibration samples per size where the fixed budget ({JOB.compensate_samples}) is too slow")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.json"), help="JSON result (default: %(default)s)")
    ap.add_argument("--make", nargs=2, metavar=("SIZE", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make:
        make_model(args.make[0], Path(args.make[1]))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    try:
        laco_samples = {k.strip(): int(v) for k, v in (kv.split("=") for kv in args.laco_samples.split(",") if kv.strip())}
    except ValueError:
        ap.error(f"--laco-samples {args.laco_samples!r}: expected SIZE=N pairs, e.g. 1.1b=4")
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    if args.resume and args.out.is_file():
        results.update(json.loads(args.out.read_text())["results"])

    def save(complete: bool = False) -> dict:
        doc = {"results": results, "complete": complete, "workload": JOB.__dict__, "threads": args.threads,
               "total_s": round(time.perf_counter() - t0),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_now": os.getloadavg()},
               "protocol": {"peak": "ru_maxrss of the stage's own process (Python, torch, libraries included)",
                            "stages": "each stage a fresh laco-deploy process (the CLI), --offload disk",
                            "model": "random-init Llama from a config, fp32 safetensors, SmolLM2 tokenizer (vocab 49152)"}}
        write_json(args.out, doc)
        return doc

    for size in sizes:
        def on_stage(row: dict, size: str = size) -> None:
            results[size] = row
            save()

        job = dataclasses.replace(JOB, compensate_samples=laco_samples.get(size, JOB.compensate_samples))
        done = results.get(size, {}).get("stages") if args.resume else None
        bench_size(size, args.work / size, args.threads, on_stage, job, done, tuple(args.stages.split(",")))
        if not (args.keep or args.resume):
            shutil.rmtree(args.work / size, ignore_errors=True)
    doc = save(complete=True)
    print(table(results))
    print(f"\ntotal {doc['total_s']} s; JSON in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
