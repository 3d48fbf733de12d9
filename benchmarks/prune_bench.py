"""Pruning benchmark: dense vs magnitude vs Wanda vs SparseGPT on the default model (SmolLM2-135M).

For unstructured 50% and 2:4 it prunes with each method (each run in its own process through
`laco-deploy prune --json`, so time and peak memory are not polluted by earlier runs), then scores
every model's perplexity on the same windows of the builtin evaluation text (never used for
calibration). Prints a table and writes JSON.

    python benchmarks/prune_bench.py --out benchmarks/results/prune.json
    python benchmarks/prune_bench.py --extra      # also Wanda+OWL 50% and structured 30%
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from laco_deploy.data import evaluation_windows
from laco_deploy.fsutil import write_json
from laco_deploy.models import load_model

log = logging.getLogger("prune_bench")

CORE = [  # (label, CLI arguments)
    ("magnitude 50%", ["--method", "magnitude", "--sparsity", "0.5"]),
    ("wanda 50%", ["--method", "wanda", "--sparsity", "0.5"]),
    ("sparsegpt 50%", ["--method", "sparsegpt", "--sparsity", "0.5"]),
    ("magnitude 2:4", ["--method", "magnitude", "--pattern", "2:4"]),
    ("wanda 2:4", ["--method", "wanda", "--pattern", "2:4"]),
    ("sparsegpt 2:4", ["--method", "sparsegpt", "--pattern", "2:4"]),
]
EXTRA = [
    ("wanda+owl 50%", ["--method", "wanda", "--sparsity", "0.5", "--owl"]),
    ("structured 30% (wanda)", ["--structured", "0.3"]),
]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over all windows, each scored on its own. windows [n, seq]."""
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(chunk, use_cache=False).logits[:, :-1]  # [b, seq-1, vocab]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                chunk[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def model_ppl(path: str, windows: torch.Tensor) -> float:
    model = load_model(path).model
    try:
        return perplexity(model, windows)
    finally:
        del model


def prune_once(args: list[str], out: Path, calib: argparse.Namespace) -> dict:
    """Run `laco-deploy prune --json` in a fresh process; return its result record."""
    cmd = [sys.executable, "-c", "from laco_deploy.cli import main; main()", "--quiet", "prune", "--model", "default",
           "--device", "cpu", "--samples", str(calib.samples), "--seqlen", str(calib.seqlen), "--out", str(out),
           "--force", "--json", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    result["process_s"] = round(time.perf_counter() - t0, 1)
    return result


def table(rows: list[dict]) -> str:
    head = f"{'model':<24} {'ppl':>8} {'x dense':>8} {'sparsity':>9} {'prune s':>8} {'peak MiB':>9}"
    lines = [head, "-" * len(head)]
    dense = rows[0]["ppl"]
    for r in rows:
        sp = "" if r.get("sparsity") is None else f"{r['sparsity']:.2%}"
        wall = "" if r.get("wall_s") is None else f"{r['wall_s']:.1f}"
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        lines.append(f"{r['label']:<24} {r['ppl']:>8.2f} {r['ppl'] / dense:>8.2f} {sp:>9} {wall:>8} {peak:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prune.json"), help="JSON result (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=64, help="calibration samples (default: %(default)s)")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sample and eval window (default: %(default)s)")
    ap.add_argument("--eval-windows", type=int, default=32, help="evaluation windows (default: %(default)s)")
    ap.add_argument("--extra", action="store_true", help="also Wanda+OWL 50%% and structured 30%%")
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch in every process (default: torch's choice); 1 is faster on a busy machine")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the pruning processes
    torch.manual_seed(0)
    configs = CORE + (EXTRA if args.extra else [])
    if args.only:
        wanted = {s.strip() for s in args.only.split(",")}
        configs = [c for c in configs if c[0] in wanted]
    dense = load_model("default")
    windows = evaluation_windows(dense.tokenizer, "builtin", args.eval_windows, args.seqlen)
    rows = [{"label": "dense", "ppl": perplexity(dense.model, windows)}]
    dense_path = str(dense.path)
    del dense
    log.info("dense ppl %.3f", rows[0]["ppl"])
    work = Path(tempfile.mkdtemp(prefix="prune-bench-"))
    try:
        for label, cli_args in configs:
            out = work / label.replace(" ", "_").replace(":", "of").replace("%", "")
            log.info("pruning: %s", label)
            res = prune_once(cli_args, out, args)
            ppl = model_ppl(str(out), windows)
            rows.append({"label": label, "args": cli_args, "ppl": ppl, "sparsity": res["sparsity"], "wall_s": res["wall_s"],
                         "peak_mib": res["peak_mib"], "memory_kind": res["memory_kind"], "process_s": res["process_s"],
                         "per_layer_s": sum(r.get("seconds", 0.0) for r in res["per_layer"])})
            log.info("%s: ppl %.3f, %.1f s, peak %.0f MiB", label, ppl, res["wall_s"], res["peak_mib"])
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    doc = {
        "benchmark": "prune",
        "protocol": {"model": "default (SmolLM2-135M-Instruct, dequantized fp32)", "source": dense_path,
                     "calibration": {"text": "builtin", "samples": args.samples, "seqlen": args.seqlen, "seed": 0},
                     "evaluation": {"text": "builtin evaluation split", "windows": int(windows.shape[0]),
                                    "seqlen": args.seqlen, "scoring": "every window on its own, tokens 2..seqlen"},
                     "time": "wall time of the prune stage (load, calibration, layer walk, save) in its own process",
                     "memory": "peak RSS of that process during the stage (CPU)"},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine()},
        "results": rows,
    }
    write_json(args.out, doc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
