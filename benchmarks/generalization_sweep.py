"""Which LaCo settings transfer to text unlike the calibration data (issue 15)?

Wanda 50% unstructured SmolLM2-135M (the default model), pruned once on builtin calibration text.
Each variant runs LaCo in this process on builtin (Wikipedia) calibration samples and is scored
on every evaluation domain: the builtin Wikipedia evaluation articles (in-domain) and the shipped
out-of-domain texts (fiction, technical documentation, code), never seen in calibration. The
table gives perplexity per domain, the share of the pruned-to-dense gap closed, and wall time.

    python benchmarks/generalization_sweep.py --variants base,s128e1 --out benchmarks/results/generalization.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch

from recovery_bench import HERE, ensure_pruned

from laco_deploy.compensate import laco
from laco_deploy.compensate.budget import final_kl_samples
from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig
from laco_deploy.data import calibration_samples, eval_domains, evaluation_windows
from laco_deploy.fidelity.metrics import next_token_nll
from laco_deploy.fsutil import write_json
from laco_deploy.models import load_model

# name -> (samples, seqlen, CompensateConfig overrides)
VARIANTS: dict[str, tuple[int, int, dict]] = {
    "base": (32, 128, {}),  # the CPU default before this sweep
    "s64e2": (64, 128, {"epochs": 2}),
    "s128e1": (128, 128, {"epochs": 1}),
    "s128e1_lr1e-3": (128, 128, {"epochs": 1, "lr": 1e-3}),
    "s64e2_lr1e-3": (64, 128, {"epochs": 2, "lr": 1e-3}),
    "s128e1_mix50": (128, 128, {"epochs": 1, "dense_input_mix": 0.5}),
    "s128e1_mix25": (128, 128, {"epochs": 1, "dense_input_mix": 0.25}),
    "s128e1_anchor30": (128, 128, {"epochs": 1, "anchor_decay": 30.0}),
    "s128e1_anchor100": (128, 128, {"epochs": 1, "anchor_decay": 100.0}),
    "s128e1_wd": (128, 128, {"epochs": 1, "weight_decay": 0.1}),
    "base_mix50": (32, 128, {"dense_input_mix": 0.5}),
    "s128_lsq": (128, 128, {"epochs": 0, "init": "lsq"}),
    "s128_lsq_w": (128, 128, {"epochs": 0, "init": "lsq", "lsq_token_weight": "nmse"}),
    "s128e1_lsq": (128, 128, {"epochs": 1, "init": "lsq"}),
    "s64e2_lsq": (64, 128, {"epochs": 2, "init": "lsq"}),
    "base_lsq": (32, 128, {"init": "lsq"}),
    "base_anchor100": (32, 128, {"anchor_decay": 100.0}),
    "s256": (256, 128, {}),  # the CPU default since builtin:mixed calibration
    "s256_bf16": (256, 128, {"precision": "bf16"}),
    "s512_bf16": (512, 128, {"precision": "bf16"}),
    "s256_bs4_bf16": (256, 128, {"precision": "bf16", "batch_size": 4, "lr": 4.24e-3}),
    "s1024_bf16": (1024, 128, {"precision": "bf16"}),
    "s256_fp32": (256, 128, {"precision": "fp32"}),
    "s256e2_bf16": (256, 128, {"precision": "bf16", "epochs": 2}),
    "s256e3_bf16": (256, 128, {"precision": "bf16", "epochs": 3}),
    "s256e4_bf16": (256, 128, {"precision": "bf16", "epochs": 4}),
    "s512e2_bf16": (512, 128, {"precision": "bf16", "epochs": 2}),
    "s512_lr2e-3_bf16": (512, 128, {"precision": "bf16", "lr": 2e-3}),
    "s512_lr5e-3_bf16": (512, 128, {"precision": "bf16", "lr": 5e-3}),
    # the final KL pass on the dense logits (distill.py)
    "s256e2_kl1": (256, 128, {"precision": "bf16", "epochs": 2, "final_kl_epochs": 1}),
    "s256e2_kl1_lr1e-4": (256, 128, {"precision": "bf16", "epochs": 2, "final_kl_epochs": 1, "final_kl_lr": 1e-4}),
    "s256e1_kl1": (256, 128, {"precision": "bf16", "epochs": 1, "final_kl_epochs": 1}),
    "s256e2_kl2": (256, 128, {"precision": "bf16", "epochs": 2, "final_kl_epochs": 2}),
}


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over all windows. windows [n, seq]."""
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(chunk, use_cache=False).logits
        for row, ids in zip(logits, chunk):
            nll = next_token_nll(row, ids)
            total += float(nll.sum())
            count += nll.numel()
    return math.exp(total / count)


def score(model, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    model.eval()
    return {d: round(perplexity(model, w), 3) for d, w in windows.items()}


def run_variant(name: str, sparse_dir: Path, dense, tokenizer, windows, workdir: Path, calib: str) -> dict:
    samples, seqlen, overrides = VARIANTS[name]
    # variants that do not name the final KL pass ran before it existed: off, so they reproduce
    cfg = dataclasses.replace(CompensateConfig(), samples=samples, **{"final_kl_epochs": 0, **overrides})
    sparse = load_model(str(sparse_dir)).model
    kl = final_kl_samples(cfg, samples)
    ids = calibration_samples(tokenizer, calib, samples + kl, seqlen, 0)
    device = torch.device("cpu")
    meter = laco.SegmentMeter(device)
    t0 = time.perf_counter()
    _records, final = laco.compensate(dense, sparse, ids, cfg, PRUNABLE_LINEARS, device=device, seed=0,
                                      checkpoint_dir=workdir / f"{name}.ckpt", fingerprint={"variant": name},
                                      resume=False, meter=meter, kl_samples=kl)
    meter.close()
    wall = time.perf_counter() - t0
    return {"ppl": score(sparse, windows), "wall_s": round(wall, 1), "samples": samples, "seqlen": seqlen,
            "overrides": overrides, "calib": calib, "final_kl": final}


def gap(row: dict, dense: dict, pruned: dict) -> dict[str, float]:
    return {d: round((pruned[d] - row[d]) / (pruned[d] - dense[d]), 3) for d in row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="base,s128e1")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "generalization.json")
    ap.add_argument("--workdir", type=Path, default=HERE / "results" / "generalization-work")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--calib", default="builtin",
                    help="calibration text of every variant (default: builtin); rows are named VARIANT@LABEL otherwise")
    ap.add_argument("--calib-label", default=None, help="short name of --calib for row names")
    ap.add_argument("--domains", default=None, help="comma-separated evaluation specs (default: every shipped domain)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args.workdir.mkdir(parents=True, exist_ok=True)
    sparse_dir = ensure_pruned("unstructured", HERE / "results" / "recovery-work", calib="builtin")
    dense_loaded = load_model("default")
    dense, tok = dense_loaded.model, dense_loaded.tokenizer
    specs = args.domains.split(",") if args.domains else [spec for _, spec in eval_domains()]
    windows = {spec: evaluation_windows(tok, spec, args.eval_windows, 256) for spec in specs}
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": {}}
    if "dense" not in doc["rows"] or set(doc["rows"]["dense"]["ppl"]) != set(specs):
        doc["rows"] = {"dense": {"ppl": score(dense, windows)},
                       "pruned": {"ppl": score(load_model(str(sparse_dir)).model, windows)}}
    d, p = doc["rows"]["dense"]["ppl"], doc["rows"]["pruned"]["ppl"]
    for name in args.variants.split(","):
        row = run_variant(name, sparse_dir, dense, tok, windows, args.workdir, args.calib)
        row["gap_closed"] = gap(row["ppl"], d, p)
        if args.calib != "builtin":
            name = f"{name}@{args.calib_label or Path(args.calib).stem}"
        doc["rows"][name] = row
        doc["protocol"] = {"prune": "Wanda 50% unstructured, builtin 64 x 256", "eval": f"{args.eval_windows} x 256 per domain",
                           "threads": torch.get_num_threads()}
        write_json(args.out, doc)
        print(f"{name:<18} wall {row['wall_s']:6.0f}s " + "  ".join(
            f"{k.split(':')[-1]} {row['ppl'][k]:.2f} ({row['gap_closed'][k]:.0%})" for k in specs), flush=True)
    print("dense  ", d)
    print("pruned ", p)


if __name__ == "__main__":
    main()
