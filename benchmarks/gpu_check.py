"""Prove the CUDA paths on a GPU machine in under 8 minutes; print one table.

    python benchmarks/gpu_check.py [--work /tmp/gpu-check] [--samples 256] [--seqlen 256]

1. the unit tests that need CUDA (tests/test_cuda.py, the onnxruntime CUDA provider test);
2. one build of the default model on CUDA (`build --device cuda --target gguf`) with the paper's
   2,048-sample LaCo budget cut to --samples (the whole check must fit in 8 minutes);
3. peak CUDA memory of LaCo vs the LoRA baseline at the same samples, sequence length and batch;
4. with 2+ GPUs: `torchrun --standalone --nproc-per-node G` Wanda pruning, checking the masks
   against one process, and the wall time of both.

Without a CUDA GPU it stops at once with one line and exit code 2. Each row says ok / FAILED /
skipped, the seconds it took, and what it measured; the exit code is 1 if any row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 8 * 60


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, last lines of output, seconds); a timeout counts as a failure."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=max(timeout, 1))
        code, text = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"timed out after {timeout:.0f} s: {(e.stderr or b'')[-500:]!r}"
    return code, "\n".join(text.strip().splitlines()[-3:]), time.perf_counter() - t0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "laco_deploy.cli", "--quiet", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "laco_deploy.cli", "--quiet", *args]


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, str]] = []
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return BUDGET_S - (time.perf_counter() - self.t0)

    def add(self, check: str, ok: bool | None, seconds: float, detail: str) -> None:
        self.rows.append((check, "ok" if ok else "skipped" if ok is None else "FAILED", seconds, detail))
        print(f"[{self.rows[-1][1]}] {check} ({seconds:.0f} s)", file=sys.stderr, flush=True)

    def print(self) -> None:
        print("| check | status | s | detail |\n|---|---|---|---|")
        for check, status, s, detail in self.rows:
            print(f"| {check} | {status} | {s:.0f} | {detail.replace('|', '/').replace(chr(10), ' ')[:300]} |")
        print(f"\ntotal {time.perf_counter() - self.t0:.0f} s (budget {BUDGET_S} s)")


def weights(d: Path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def mask_mismatches(a: Path, b: Path) -> int:
    wa, wb = weights(a), weights(b)
    return sum(int(((wa[k] == 0) != (wb[k] == 0)).sum()) for k in wa)


def peak(path: Path) -> str:
    r = json.loads(path.read_text())
    return f"{r['peak_mib']:.0f} MiB ({r['memory_kind']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/laco-gpu-check"))
    ap.add_argument("--samples", type=int, default=256, help="LaCo calibration samples (the paper: 2048)")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a CUDA machine "
              "with a CUDA build of torch", file=sys.stderr)
        sys.exit(2)
    gpus = torch.cuda.device_count()
    w, t = a.work, Table()
    w.mkdir(parents=True, exist_ok=True)
    data = ["--samples", str(a.samples), "--seqlen", str(a.seqlen)]

    code, tail, s = run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_cuda.py", "tests/bench/test_onnxrt.py"],
                        min(120, t.left()))
    t.add("unit tests needing CUDA", code == 0, s, tail.splitlines()[-1] if tail else "")

    build = w / "build"
    # compensate.samples: build's --samples sets the pruning samples; LaCo on CUDA would take all 2,048
    config = w / "build.yaml"
    config.write_text(f"compensate:\n  samples: {a.samples}\n")
    code, tail, s = run(cli("build", "--config", str(config), "--device", "cuda", "--target", "gguf", *data,
                            "--eval-samples", "16", "--out", str(build)), min(240, t.left() - 120))
    detail = tail
    if code == 0:
        summary = json.loads((build / "manifest.json").read_text())["summary"]
        detail = f"{a.samples} x {a.seqlen} LaCo samples; ppl torch {summary.get('ppl_pytorch')}"
    t.add(f"default-model build on {torch.cuda.get_device_name(0)}", code == 0, s, detail)

    pruned = build / "pruned"
    common = ["--dense", "default", "--sparse", str(pruned), *data, "--batch-size", str(a.batch_size),
              "--epochs", "1", "--device", "cuda"]
    peaks = {}
    for method in ("laco", "lora"):
        if not pruned.is_dir() or t.left() < 30:
            t.add(f"peak CUDA memory {method}", None, 0, "needs the build's pruned model and time left")
            continue
        code, tail, s = run(cli("compensate", "--method", method, *common, "--json", str(w / f"{method}.json"),
                                "--out", str(w / method), "--force"), min(120, t.left() - 30))
        peaks[method] = peak(w / f"{method}.json") if code == 0 else None
        t.add(f"peak CUDA memory {method} (batch {a.batch_size}, seqlen {a.seqlen})", code == 0, s, peaks[method] or tail)

    if gpus < 2:
        t.add("torchrun data parallel", None, 0, f"{gpus} GPU: needs 2 or more")
    elif t.left() < 60:
        t.add("torchrun data parallel", None, 0, "no time left in the 8-minute budget")
    else:
        prune = ["prune", "--model", "default", "--method", "wanda", "--samples", "64", "--seqlen", str(a.seqlen),
                 "--device", "auto", "--force"]
        c1, tail1, s1 = run(cli(*prune, "--out", str(w / "p1")), t.left() / 2)
        c2, tail2, s2 = run(torchrun(gpus, *prune, "--out", str(w / f"p{gpus}")), t.left() - 10)
        ok = c1 == 0 and c2 == 0
        detail = (f"{gpus} ranks: Wanda masks differ in {mask_mismatches(w / 'p1', w / f'p{gpus}')} weights; "
                  f"wall {s1:.0f} s (1) vs {s2:.0f} s ({gpus})") if ok else (tail2 or tail1)
        t.add("torchrun data parallel", ok, s1 + s2, detail)
    t.print()
    sys.exit(1 if any(status == "FAILED" for _c, status, _s, _d in t.rows) else 0)


if __name__ == "__main__":
    main()
