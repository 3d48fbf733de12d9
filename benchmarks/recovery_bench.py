"""Recovery benchmark: LaCo vs the LoRA baseline on Wanda-pruned SmolLM2-135M (the default model).

For Wanda 50% unstructured and 2:4 it measures the perplexity of the dense, pruned, LaCo- and
LoRA-recovered models at the same calibration budget, and of LaCo at a quarter of that budget, on
every evaluation domain: the builtin Wikipedia articles (in-domain: calibration is Wikipedia too)
and the shipped fiction, technical-documentation and code texts (out-of-domain, never calibrated
on), the same windows for every model; the wall time, training throughput and memory of each
recovery (peak RSS growth and the device working set); and checks that every recovered model
keeps the pruned model's sparsity. `--curve 8,16,...` adds the data-efficiency curve: LaCo and
LoRA at each calibration size, one table and one plot (recovery.png next to the JSON). Each
recovery runs in its own process through the CLI (`laco-deploy compensate --json`), so memory and
time are not polluted by earlier runs; finished recoveries are reused unless --fresh.

    python benchmarks/recovery_bench.py --out benchmarks/results/recovery.json --curve 8,16,32,64,128,256

Recoveries train on 64 samples x 256 tokens by default (LaCo 1/4: 16), Wanda calibrates on
64 x 256, perplexity is scored on 16 windows of 256 tokens per domain; LaCo and LoRA use the same
batch size and epochs (CompensateConfig defaults).
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
from laco_deploy.data import eval_domains, evaluation_windows
from laco_deploy.fidelity.metrics import next_token_nll
from laco_deploy.fsutil import write_json
from laco_deploy.models import load_model

log = logging.getLogger("recovery_bench")
HERE = Path(__file__).resolve().parent
PATTERNS = {"unstructured": PruneConfig(method="wanda", sparsity=0.5), "2:4": PruneConfig(method="wanda", pattern="2:4")}


@torch.no_grad()
def perplexity(model_dir: str, windows: torch.Tensor | dict[str, torch.Tensor], batch: int = 4):
    """exp(mean next-token NLL) over all windows [n, seq]; for a dict domain -> windows, a dict of
    perplexities (the model is loaded once)."""
    model = load_model(model_dir).model
    single = not isinstance(windows, dict)
    out = {}
    for domain, win in ({"_": windows} if single else windows).items():
        total, count = 0.0, 0
        for chunk in win.split(batch):
            logits = model(chunk, use_cache=False).logits
            for row, ids in zip(logits, chunk):
                nll = next_token_nll(row, ids)
                total += float(nll.sum())
                count += nll.numel()
        out[domain] = math.exp(total / count)
    del model
    return out["_"] if single else out


def domain_windows(tokenizer, per_domain: int, seqlen: int) -> dict[str, torch.Tensor]:
    """The evaluation windows of every shipped domain: wikipedia (in-domain) first, then the
    out-of-domain texts. {label: [n, seqlen]}"""
    return {label: evaluation_windows(tokenizer, spec, per_domain, seqlen) for label, spec in eval_domains()}


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


def _gaps(ppl: dict[str, float], dense: dict[str, float], pruned: dict[str, float]) -> dict[str, float | None]:
    return {d: round((pruned[d] - ppl[d]) / (pruned[d] - dense[d]), 4) if pruned[d] != dense[d] else None for d in ppl}


def _row(name: str, samples, ppl: dict, dense: dict, pruned: dict, res: dict | None, pruned_sparsity: float) -> dict:
    """One model: perplexity and gap closed per evaluation domain, plus the recovery's cost."""
    row = {"model": name, "samples": samples, "ppl": {d: round(v, 3) for d, v in ppl.items()},
           "gap_closed": _gaps(ppl, dense, pruned)}
    if res is not None:
        mem = res["settings"]["memory"]
        row.update({"wall_s": res["wall_s"], "peak_rss_mib": mem["peak_mib"], "peak_rss_delta_mib": mem["peak_delta_mib"],
                    "device_ws_mib": mem["device_working_set_mib"].get("total"),
                    "device_ws_parts_mib": mem["device_working_set_mib"],
                    "throughput": res["settings"].get("throughput"),
                    "sparsity": res["sparsity"], "sparsity_equal": res["sparsity"] == pruned_sparsity})
    return row


def bench_pattern(label: str, args, windows: dict[str, torch.Tensor], dense_ppl: dict[str, float]) -> dict:
    workdir = Path(args.workdir)
    sparse = ensure_pruned(label, workdir, args.prune_samples, args.prune_seqlen)
    pruned_sparsity = json.loads((sparse / "config.json").read_text())["laco_deploy"]["sparsity"]
    pruned_ppl = perplexity(str(sparse), windows)
    rows = [_row("dense", "-", dense_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity),
            _row("pruned (Wanda)", args.prune_samples, pruned_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity)]
    runs = [("LaCo", "laco", args.samples), ("LoRA", "lora", args.samples),
            ("LaCo 1/4 budget", "laco", max(1, args.samples // 4))]
    for name, method, n in runs:
        res, ppl = _recover_and_score(label, method, n, sparse, args, windows)
        rows.append(_row(name, n, ppl, dense_ppl, pruned_ppl, res, pruned_sparsity))
        rows[-1]["notes"] = res["notes"]
    return {"pattern": label, "pruned_sparsity": pruned_sparsity, "rows": rows,
            "dense_ppl": dense_ppl, "pruned_ppl": pruned_ppl, "sparse_dir": str(sparse)}


def _recover_and_score(label: str, method: str, n: int, sparse: Path, args, windows) -> tuple[dict, dict]:
    out = Path(args.workdir) / f"{label.replace(':', 'of')}-{method}-{n}"
    res = recover(method, sparse, out, n, args)
    return res, perplexity(str(out), windows)


def data_efficiency(result: dict, sizes: list[int], args, windows) -> list[dict]:
    """LaCo and LoRA perplexity per domain at each calibration size (same seqlen, same settings)."""
    rows = []
    sparse = Path(result["sparse_dir"])
    for n in sizes:
        for method in ("laco", "lora"):
            res, ppl = _recover_and_score(result["pattern"], method, n, sparse, args, windows)
            rows.append(_row(f"{'LaCo' if method == 'laco' else 'LoRA'}", n, ppl, result["dense_ppl"], result["pruned_ppl"],
                             res, result["pruned_sparsity"]))
    return rows


def _ood_mean(row: dict, in_domain: str) -> float | None:
    vals = [v for d, v in row["gap_closed"].items() if d != in_domain and v is not None]
    return sum(vals) / len(vals) if vals else None


def goals(results: list[dict], in_domain: str) -> list[str]:
    lines = []
    for r in results:
        by = {row["model"]: row for row in r["rows"]}
        laco, lora = by["LaCo"], by["LoRA"]
        ws_ratio = lora["device_ws_mib"] / laco["device_ws_mib"]
        lines.append(f"[{r['pattern']}] gap closed in-domain: LaCo {laco['gap_closed'][in_domain]:.0%}, LoRA "
                     f"{lora['gap_closed'][in_domain]:.0%}; out-of-domain: " + ", ".join(
                         f"{d} LaCo {laco['gap_closed'][d]:.0%} vs LoRA {lora['gap_closed'][d]:.0%}"
                         for d in laco["gap_closed"] if d != in_domain))
        ood_better = all(laco["ppl"][d] <= lora["ppl"][d] for d in laco["ppl"] if d != in_domain)
        lines.append(f"[{r['pattern']}] out of domain LaCo at least as good as LoRA at the same data: "
                     f"{'met' if ood_better else 'NOT met'}; wall time LaCo {laco['wall_s']:.0f} s vs LoRA "
                     f"{lora['wall_s']:.0f} s: {'met' if laco['wall_s'] <= lora['wall_s'] else 'NOT met'}")
        lines.append(f"[{r['pattern']}] device working set LoRA/LaCo = {ws_ratio:.1f}x (paper: ~7x)")
        ok = all(row.get("sparsity_equal", True) for row in r["rows"] + r.get("curve", []))
        lines.append(f"[{r['pattern']}] recovered sparsity equals pruned sparsity ({r['pruned_sparsity']}): {'yes' if ok else 'NO'}")
        curve = r.get("curve") or []
        if curve:
            full = max(row["samples"] for row in curve)
            lora_full = next(row for row in curve if row["model"] == "LoRA" and row["samples"] == full)
            eighth = [row for row in curve if row["model"] == "LaCo" and row["samples"] == full // 8]
            if eighth:
                gap = eighth[0]["ppl"][in_domain] - lora_full["ppl"][in_domain]
                lines.append(f"[{r['pattern']}] LaCo at {full // 8} samples (1/8) vs LoRA at {full}: in-domain ppl "
                             f"{eighth[0]['ppl'][in_domain]:.2f} vs {lora_full['ppl'][in_domain]:.2f} "
                             f"({'met' if gap <= 0 else f'NOT met, {gap:+.2f} ppl'})")
    return lines


def table(results: list[dict], key: str = "rows") -> str:
    domains = list(results[0]["rows"][0]["ppl"])
    head = f"{'pattern':<13}{'model':<17}{'samples':>8}" + "".join(f"{d[:16]:>18}" for d in domains) + \
        f"{'wall s':>8}{'RSS +MiB':>10}{'dev WS MiB':>11}{'GFLOP/s':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        for row in r.get(key, []):
            cells = "".join(f"{row['ppl'][d]:>10.2f}" + (f" ({row['gap_closed'][d]:>4.0%})" if row['gap_closed'][d] is not None
                                                           and row["model"] != "dense" else " " * 7) + " " for d in domains)
            extra = (f"{row['wall_s']:>8.0f}{row['peak_rss_delta_mib']:>10.0f}{row['device_ws_mib']:>11.1f}"
                     f"{(row.get('throughput') or {}).get('achieved_gflops', 0):>9.1f}" if "wall_s" in row else "")
            lines.append(f"{r['pattern']:<13}{row['model']:<17}{str(row['samples']):>8}{cells}{extra}")
    return "\n".join(lines)


def curve_plot(results: list[dict], in_domain: str, path: Path) -> None:
    """Perplexity vs calibration samples, LaCo and LoRA, in-domain and out-of-domain mean, per pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_curve = [r for r in results if r.get("curve")]
    if not with_curve:
        return
    fig, axes = plt.subplots(1, len(with_curve), figsize=(6 * len(with_curve), 4), squeeze=False)
    for ax, r in zip(axes[0], with_curve):
        for method, color in (("LaCo", "tab:blue"), ("LoRA", "tab:orange")):
            rows = sorted((row for row in r["curve"] if row["model"] == method), key=lambda row: row["samples"])
            xs = [row["samples"] for row in rows]
            ax.plot(xs, [row["ppl"][in_domain] for row in rows], "o-", color=color, label=f"{method} {in_domain} (in)")
            ood = [sum(v for d, v in row["ppl"].items() if d != in_domain) / (len(row["ppl"]) - 1) for row in rows]
            ax.plot(xs, ood, "s--", color=color, label=f"{method} out-of-domain mean")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("calibration samples")
        ax.set_ylabel("perplexity")
        ax.set_title(f"Wanda {r['pattern']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--eval-windows", type=int, default=16, help="evaluation windows per domain")
    ap.add_argument("--eval-seqlen", type=int, default=256)
    ap.add_argument("--patterns", default="unstructured,2:4")
    ap.add_argument("--curve", default="", help="data-efficiency curve sizes, e.g. 8,16,32,64,128,256 (empty: no curve)")
    ap.add_argument("--fresh", action="store_true", help="rerun recoveries whose results already exist")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    dense = load_model("default")
    windows = domain_windows(dense.tokenizer, args.eval_windows, args.eval_seqlen)
    in_domain = next(iter(windows))
    del dense
    dense_ppl = perplexity("default", windows)
    results = [bench_pattern(p, args, windows, dense_ppl) for p in args.patterns.split(",")]
    sizes = [int(x) for x in args.curve.split(",") if x]
    for r in results:
        if sizes:
            r["curve"] = data_efficiency(r, sizes, args, windows)
    plot = args.out.with_suffix(".png")
    curve_plot(results, in_domain, plot)
    doc = {"protocol": {"model": "default (SmolLM2-135M-Instruct, fp32)",
                        "eval": {d: f"{len(w)} x {args.eval_seqlen} tokens" for d, w in windows.items()},
                        "in_domain": in_domain,
                        "prune": f"Wanda, builtin calibration {args.prune_samples} x {args.prune_seqlen}",
                        "calibration": f"builtin, seed 0, {args.samples} x {args.seqlen} tokens (LaCo 1/4: {args.samples // 4})",
                        "curve_sizes": sizes, "epochs": args.epochs,
                        "batch_size": args.batch_size, "device": "cpu", "threads": torch.get_num_threads(),
                        "laco": {"loss": CompensateConfig.loss, "lr": CompensateConfig.lr, "init": CompensateConfig.init},
                        "lora": {"rank": CompensateConfig.lora_rank, "alpha": CompensateConfig.lora_alpha,
                                 "lr": CompensateConfig.lora_lr}},
           "results": [{k: v for k, v in r.items() if k != "sparse_dir"} for r in results],
           "goals": goals(results, in_domain), "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, doc)
    print(table(results))
    if sizes:
        print("\ndata-efficiency curve\n" + table(results, "curve"))
        print(f"plot: {plot}")
    print("\n".join(doc["goals"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
