"""Loss and setting sweep for LaCo on a reduced budget (to pick defaults by measurement).

Wanda 50% unstructured SmolLM2-135M (pruned once with 64 x 256 calibration tokens); each LaCo
variant trains on `--samples` x `--seqlen` (default 32 x 128) and is scored on `--eval-windows`
windows of 256 tokens of the builtin evaluation text. Variants run one after another, each in its
own process through the CLI.

    python benchmarks/compensate_sweep.py --variants mse,nmse,cos_mse,subblock --out benchmarks/results/sweep.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from recovery_bench import HERE, ensure_pruned, perplexity, recover

from laco_deploy.data import evaluation_windows
from laco_deploy.fsutil import write_json
from laco_deploy.models import load_model

VARIANTS = {
    "mse": ["--loss", "mse"],
    "nmse": ["--loss", "nmse"],
    "cos_mse": ["--loss", "cos_mse"],
    "subblock": ["--loss", "subblock"],
    "nmse_norms": ["--loss", "nmse", "--train-norms"],
    "nmse_lr3e-4": ["--loss", "nmse", "--lr", "3e-4"],
    "nmse_lr3e-3": ["--loss", "nmse", "--lr", "3e-3"],
    "nmse_late0.3": ["--loss", "nmse", "--lr-last-factor", "0.3"],
    "nmse_bs2": ["--loss", "nmse", "--batch-size", "2"],
    "nmse_bs2_lr3e-3": ["--loss", "nmse", "--batch-size", "2", "--lr", "3e-3"],
    "nmse_bs1": ["--loss", "nmse", "--batch-size", "1"],
    "nmse_bs1_lr2e-3": ["--loss", "nmse", "--batch-size", "1", "--lr", "2e-3"],
    "nmse_bs2_lr3e-3_norms": ["--loss", "nmse", "--batch-size", "2", "--lr", "3e-3", "--train-norms"],
    "nmse_bs2_ep8": ["--loss", "nmse", "--batch-size", "2", "--epochs", "8"],
    "mse_bs2": ["--loss", "mse", "--batch-size", "2"],
    "cos_mse_bs2": ["--loss", "cos_mse", "--batch-size", "2"],
    "nmse_bs2_lr3e-3_late0.3": ["--loss", "nmse", "--batch-size", "2", "--lr", "3e-3", "--lr-last-factor", "0.3"],
    "cos_mse_bs2_lr3e-3": ["--loss", "cos_mse", "--batch-size", "2", "--lr", "3e-3"],
    "mse_bs2_lr3e-3": ["--loss", "mse", "--batch-size", "2", "--lr", "3e-3"],
    "lora_bs1_lr1e-3": ["--lora-lr", "1e-3", "--batch-size", "1"],
    "lora_bs2_lr2e-3": ["--lora-lr", "2e-3", "--batch-size", "2"],
    "lora_lr3e-3": ["--lora-lr", "3e-3"],
    "lora_bs2_lr1e-3": ["--lora-lr", "1e-3", "--batch-size", "2"],
    "mse_lr3e-4": ["--loss", "mse", "--lr", "3e-4"],
    "channel_bs2_lr3e-3": ["--trainable", "channel", "--batch-size", "2", "--lr", "3e-3"],
    "channel_bs2_lr1e-2": ["--trainable", "channel", "--batch-size", "2", "--lr", "1e-2"],
    "lowrank8_bs2_lr3e-3": ["--trainable", "lowrank", "--batch-size", "2", "--lr", "3e-3"],
    "lowrank8_bs2_lr1e-3": ["--trainable", "lowrank", "--batch-size", "2", "--lr", "1e-3"],
    "lowrank32_bs2_lr1e-3": ["--trainable", "lowrank", "--correction-rank", "32", "--batch-size", "2", "--lr", "1e-3"],
    "lora": [],
    "lora_lr1e-3": ["--lora-lr", "1e-3"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="mse,nmse,cos_mse,subblock")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sweep.json")
    ap.add_argument("--workdir", default=str(HERE / "results" / "sweep-work"))
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--pattern", default="unstructured")
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workdir = Path(args.workdir)
    sparse = ensure_pruned(args.pattern, HERE / "results" / "recovery-work")
    tok = load_model("default").tokenizer
    windows = evaluation_windows(tok, "builtin", args.eval_windows, 256)
    doc = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": {}}
    for key, ppl_of in (("dense", "default"), ("pruned", str(sparse))):
        if key not in doc["rows"]:
            doc["rows"][key] = {"ppl": round(perplexity(ppl_of, windows), 3)}
    for name in args.variants.split(","):
        method = "lora" if name.startswith("lora") else "laco"
        t0 = time.perf_counter()
        res = recover(method, sparse, workdir / f"{args.pattern}-{name}-{args.samples}x{args.seqlen}", args.samples, args,
                      extra=VARIANTS[name])
        ppl = perplexity(res["model_dir"], windows)
        d, p = doc["rows"]["dense"]["ppl"], doc["rows"]["pruned"]["ppl"]
        doc["rows"][name] = {"ppl": round(ppl, 3), "gap_closed": round((p - ppl) / (p - d), 4), "wall_s": res["wall_s"],
                             "args": VARIANTS[name], "elapsed_s": round(time.perf_counter() - t0, 1),
                             "device_ws_mib": res["settings"]["memory"]["device_working_set_mib"]}
        doc["protocol"] = {"samples": args.samples, "seqlen": args.seqlen, "epochs": args.epochs, "eval": f"{len(windows)} x 256",
                           "threads": torch.get_num_threads()}
        write_json(args.out, doc)
        print(f"{name:<16} ppl {ppl:8.3f}  gap closed {doc['rows'][name]['gap_closed']:.0%}  wall {res['wall_s']:.0f} s", flush=True)
    for name, row in doc["rows"].items():
        print(f"{name:<16} {row}")


if __name__ == "__main__":
    main()
