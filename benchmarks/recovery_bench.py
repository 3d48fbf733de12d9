"""Recovery benchmark: LaCo vs the LoRA baseline on Wanda-pruned SmolLM2-135M (the default model).

For Wanda 50% unstructured and 2:4 it measures the perplexity (builtin evaluation text, the same
windows for every model) of the dense, pruned, LaCo- and LoRA-recovered models at the same
calibration budget, and of LaCo at a quarter of that budget; the wall time and memory of each
recovery (peak RSS growth and the device working set); and checks that every recovered model
keeps the pruned model's sparsity. Each recovery runs in its own process through the CLI
(`laco-deploy compensate --json`), so memory and time are not polluted by earlier runs.

    python benchmarks/recovery_bench.py --out benchmarks/results/recovery.json

Defaults follow the measured starting point of the design notes: recoveries train on 64 samples
x 256 tokens (LaCo 1/4: 16), Wanda calibrates on 64 x 256, perplexity is scored on 32 windows of
256 tokens; LaCo and LoRA use the same batch size and epochs (CompensateConfig defaults).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig, PruneConfig
from laco_deploy.data import evaluation_windows
from laco_deploy.fidelity.metrics import next_token_nll
from laco_deploy.fsutil import write_json
from laco_deploy.models import load_model

log = logging.getLogger("recovery_bench")
HERE = Path(__file__).resolve().parent
PATTERNS = {"unstructured": PruneConfig(method="wanda", sparsity=0.5), "2:4": PruneConfig(method="wanda", pattern="2:4")}


@torch.no_grad()
def perplexity(model_dir: str, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over all windows. windows [n, seq]."""
    model = load_model(model_dir).model
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(chunk, use_cache=False).logits
        for row, ids in zip(logits, chunk):
            nll = next_token_nll(row, ids)
            total += float(nll.sum())
            count += nll.numel()
    del model
    return math.exp(total / count)


def ensure_pruned(label: str, workdir: Path, calib_samples: int = 64, seqlen: int = 256) -> Path:
    """Wanda-prune the default model once per pattern (reused when the folder exists)."""
    from laco_deploy.prune import run as prune

    out = workdir / f"wanda-{label.replace(':', 'of')}"
    if not (out / "config.json").is_file():
        prune(ModelConfig(device="cpu"), DataConfig(samples=calib_samples, seqlen=seqlen), PATTERNS[label], out,
              device=torch.device("cpu"))
    return out


def recover(method: str, sparse: Path, out: Path, samples: int, args, extra: list[str] | None = None) -> dict:
    """One recovery in a fresh process through the CLI; returns its result record."""
    rec = out.with_suffix(".json")
    if rec.is_file() and (out / "config.json").is_file() and not args.fresh:
        return json.loads(rec.read_text())
    cmd = [sys.executable, "-c", "from laco_deploy.cli import main; main()", "--quiet", "compensate",
           "--dense", "default", "--sparse", str(sparse), "--out", str(out), "--method", method,
           "--samples", str(samples), "--seqlen", str(args.seqlen), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--device", "cpu", "--json", str(rec), *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method} on {sparse} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log.info("%s %s (%d samples) done in %.0f s", method, sparse.name, samples, time.perf_counter() - t0)
    return json.loads(rec.read_text())


def _row(name: str, samples, ppl: float, dense: float, pruned: float, res: dict | None, pruned_sparsity: float) -> dict:
    row = {"model": name, "samples": samples, "ppl": round(ppl, 3),
           "gap_closed": round((pruned - ppl) / (pruned - dense), 4) if pruned != dense else None}
    if res is not None:
        mem = res["settings"]["memory"]
        row.update({"wall_s": res["wall_s"], "peak_rss_mib": mem["peak_mib"], "peak_rss_delta_mib": mem["peak_delta_mib"],
                    "device_ws_mib": mem["device_working_set_mib"].get("total"),
                    "device_ws_parts_mib": mem["device_working_set_mib"],
                    "sparsity": res["sparsity"], "sparsity_equal": res["sparsity"] == pruned_sparsity})
    return row


def bench_pattern(label: str, args, windows: torch.Tensor, dense_ppl: float) -> dict:
    workdir = Path(args.workdir)
    sparse = ensure_pruned(label, workdir, args.prune_samples, args.prune_seqlen)
    pruned_sparsity = json.loads((sparse / "config.json").read_text())["laco_deploy"]["sparsity"]
    pruned_ppl = perplexity(str(sparse), windows)
    rows = [_row("dense", "-", dense_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity),
            _row("pruned (Wanda)", args.prune_samples, pruned_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity)]
    tag = label.replace(":", "of")
    runs = [("LaCo", "laco", args.samples), ("LoRA", "lora", args.samples),
            ("LaCo 1/4 budget", "laco", max(1, args.samples // 4))]
    for name, method, n in runs:
        out = workdir / f"{tag}-{method}-{n}"
        res = recover(method, sparse, out, n, args)
        rows.append(_row(name, n, perplexity(str(out), windows), dense_ppl, pruned_ppl, res, pruned_sparsity))
        rows[-1]["notes"] = res["notes"]
    return {"pattern": label, "pruned_sparsity": pruned_sparsity, "rows": rows}


def goals(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        by = {row["model"]: row for row in r["rows"]}
        laco, lora = by["LaCo"], by["LoRA"]
        ws_ratio = lora["device_ws_mib"] / laco["device_ws_mib"]
        rss_ratio = lora["peak_rss_delta_mib"] / max(laco["peak_rss_delta_mib"], 1e-9)
        lines.append(f"[{r['pattern']}] LaCo closes {laco['gap_closed']:.0%} of the gap (goal >= 50% at unstructured): "
                     f"{'met' if laco['gap_closed'] >= 0.5 else 'NOT met'}; LaCo ppl {laco['ppl']} vs LoRA {lora['ppl']} "
                     f"at the same budget: {'LaCo lower' if laco['ppl'] < lora['ppl'] else 'LoRA lower'}")
        lines.append(f"[{r['pattern']}] device working set LoRA/LaCo = {ws_ratio:.1f}x (goal >= 7x: "
                     f"{'met' if ws_ratio >= 7 else 'NOT met'}); peak RSS growth LoRA/LaCo = {rss_ratio:.1f}x")
        ok = all(row.get("sparsity_equal", True) for row in r["rows"])
        lines.append(f"[{r['pattern']}] recovered sparsity equals pruned sparsity ({r['pruned_sparsity']}): {'yes' if ok else 'NO'}")
    return lines


def table(results: list[dict]) -> str:
    head = f"{'pattern':<13}{'model':<17}{'samples':>8}{'ppl':>9}{'gap closed':>11}{'wall s':>9}{'RSS +MiB':>10}{'dev WS MiB':>11}{'sparsity':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        for row in r["rows"]:
            gap = f"{row['gap_closed']:.0%}" if row["gap_closed"] is not None else "-"
            extra = (f"{row['wall_s']:>9.0f}{row['peak_rss_delta_mib']:>10.0f}{row['device_ws_mib']:>11.1f}{row['sparsity']:>10.4f}"
                     if "wall_s" in row else f"{'':>9}{'':>10}{'':>11}{r['pruned_sparsity'] if row['model'] != 'dense' else 0:>10.4f}")
            lines.append(f"{r['pattern']:<13}{row['model']:<17}{str(row['samples']):>8}{row['ppl']:>9.2f}{gap:>11}{extra}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "recovery.json")
    ap.add_argument("--workdir", default=str(HERE / "results" / "recovery-work"), help="pruned and recovered models")
    ap.add_argument("--samples", type=int, default=64, help="calibration budget of LaCo and LoRA (LaCo 1/4: samples // 4)")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sample of the recoveries")
    ap.add_argument("--prune-samples", type=int, default=64, help="Wanda calibration samples")
    ap.add_argument("--prune-seqlen", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=CompensateConfig.epochs)
    ap.add_argument("--batch-size", type=int, default=CompensateConfig.batch_size)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--eval-seqlen", type=int, default=256)
    ap.add_argument("--patterns", default="unstructured,2:4")
    ap.add_argument("--fresh", action="store_true", help="rerun recoveries whose results already exist")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    dense = load_model("default")
    windows = evaluation_windows(dense.tokenizer, "builtin", args.eval_windows, args.eval_seqlen)
    del dense
    dense_ppl = perplexity("default", windows)
    results = [bench_pattern(p, args, windows, dense_ppl) for p in args.patterns.split(",")]
    doc = {"protocol": {"model": "default (SmolLM2-135M-Instruct, fp32)", "eval": f"builtin, {len(windows)} x {args.eval_seqlen} tokens",
                        "prune": f"Wanda, builtin calibration {args.prune_samples} x {args.prune_seqlen}",
                        "calibration": f"builtin, seed 0, {args.samples} x {args.seqlen} tokens (LaCo 1/4: {args.samples // 4})",
                        "epochs": args.epochs,
                        "batch_size": args.batch_size, "device": "cpu", "threads": torch.get_num_threads(),
                        "laco": {"loss": CompensateConfig.loss, "lr": CompensateConfig.lr},
                        "lora": {"rank": CompensateConfig.lora_rank, "alpha": CompensateConfig.lora_alpha,
                                 "lr": CompensateConfig.lora_lr}},
           "results": results, "goals": goals(results), "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, doc)
    print(table(results))
    print("\n".join(doc["goals"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
