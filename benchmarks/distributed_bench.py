"""1 vs N torchrun processes on one machine: the same results, and each stage's wall time.

For N in --procs (default 1 2), under `torchrun --standalone --nproc-per-node N` with
OMP_NUM_THREADS=1 per process: prune with Wanda and with SparseGPT, LaCo on the N=1 Wanda model
(so every N starts from the same pruned weights), then fidelity of the same candidates (the
Wanda model and every N's LaCo model). Checks: identical masks to N=1, LaCo perplexity within 1%
of N=1, fidelity numbers equal to float tolerance. Writes JSON (--json) and prints a Markdown table.

On a 2-core machine shared with other jobs this shows correctness more than speed: N processes
on N cores each do 1/N of the samples but also repeat the per-layer fixed costs (loading the
layer, the all-reduces, the optimizer on the layer's weights).

    python benchmarks/distributed_bench.py --work /tmp/dist-bench --samples 16 --seqlen 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def launch(nproc: int, args: list[str]) -> float:
    """Run the CLI under torchrun; return its wall time. A failure stops the benchmark with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "laco_deploy.cli", "--quiet", *args]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        sys.exit(f"failed ({run.returncode}): {' '.join(cmd)}\n{run.stderr[-4000:]}")
    return wall


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def mask_mismatches(a: Path, b: Path) -> int:
    """Weights whose zero pattern differs between two model folders (0: same masks)."""
    wa, wb = weights(a), weights(b)
    return sum(int(((wa[k] == 0) != (wb[k] == 0)).sum()) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.procs[0] != 1:
        sys.exit("--procs must start with 1 (the reference)")
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    data = ["--samples", str(a.samples), "--seqlen", str(a.seqlen), "--device", "cpu"]
    times: dict[int, dict[str, float]] = {}
    for n in a.procs:
        t = times.setdefault(n, {})
        for method in ("wanda", "sparsegpt"):
            t[f"prune {method}"] = launch(n, ["prune", "--model", a.model, "--method", method, *data,
                                              "--out", str(work / f"n{n}" / method), "--force"])
        t["compensate laco"] = launch(n, ["compensate", "--dense", a.model, "--sparse", str(work / "n1" / "wanda"),
                                          "--epochs", str(a.epochs), *data, "--out", str(work / f"n{n}" / "laco"), "--force"])
    cands = ["--candidate", f"wanda={work / 'n1' / 'wanda'}"]
    cands += [arg for n in a.procs for arg in ("--candidate", f"laco_n{n}={work / f'n{n}' / 'laco'}")]
    reports = {}
    for n in a.procs:
        times[n]["fidelity"] = launch(n, ["fidelity", "--dense", a.model, *cands, "--eval", "builtin",
                                          "--eval-samples", str(a.eval_samples), "--seqlen", str(a.seqlen),
                                          "--device", "cpu", "--no-layerwise", "--report", str(work / f"n{n}" / "report")])
        reports[n] = json.loads((work / f"n{n}" / "report" / "fidelity.json").read_text())
    ref = reports[1]["candidates"]
    result = {"model": a.model, "samples": a.samples, "seqlen": a.seqlen, "epochs": a.epochs,
              "eval_samples": a.eval_samples, "cpu_count": os.cpu_count(), "times_s": times, "checks": {}}
    for n in a.procs[1:]:
        got = reports[n]["candidates"]
        result["checks"][n] = {
            "wanda_mask_mismatches": mask_mismatches(work / "n1" / "wanda", work / f"n{n}" / "wanda"),
            "sparsegpt_mask_mismatches": mask_mismatches(work / "n1" / "sparsegpt", work / f"n{n}" / "sparsegpt"),
            "laco_ppl_n1": ref["laco_n1"]["metrics"]["ppl"],
            f"laco_ppl_n{n}": ref[f"laco_n{n}"]["metrics"]["ppl"],
            "laco_ppl_rel_diff": ref[f"laco_n{n}"]["metrics"]["ppl"] / ref["laco_n1"]["metrics"]["ppl"] - 1,
            "fidelity_max_rel_diff": max(abs(got[c]["metrics"][k] / ref[c]["metrics"][k] - 1)
                                         for c in ref for k in ("ppl", "top1", "nll_mean")),
        }
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    stages = list(times[1])
    print("| stage | " + " | ".join(f"N={n} wall s" for n in a.procs) + " |")
    print("|---|" + "---|" * len(a.procs))
    for s in stages:
        print(f"| {s} | " + " | ".join(f"{times[n][s]:.1f}" for n in a.procs) + " |")
    print(json.dumps(result["checks"], indent=2))


if __name__ == "__main__":
    main()
