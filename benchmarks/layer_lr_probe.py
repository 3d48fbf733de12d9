"""LaCo on the first few layers of a model, per learning rate (issue 31): held-out layer loss before and
after, each try's learning rate and the loss after each epoch. A cheap look at whether the walk's
layers improve on a model before a whole build: Wanda 50% on the first --layers layers, then the
LaCo walk over them at the default settings except those given here (no final KL pass).

    python benchmarks/layer_lr_probe.py --model gemma-3-270m-q4_k_m.gguf --lr 3e-3 --retries 0 --out a.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laco_deploy.compensate.laco import SegmentMeter, make_step  # noqa: E402
from laco_deploy.compensate.train import split_indices  # noqa: E402
from laco_deploy.config import CompensateConfig, PruneConfig  # noqa: E402
from laco_deploy.data import calibration_samples  # noqa: E402
from laco_deploy.engine import Lane, Paths, WalkOptions, capture_inputs, walk_layers  # noqa: E402
from laco_deploy.fsutil import write_json  # noqa: E402
from laco_deploy.models import load_model  # noqa: E402
from laco_deploy.prune.step import MatrixRule, prune_layer  # noqa: E402

CPU = torch.device("cpu")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file, a Hugging Face directory or 'default'")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    p.add_argument("--layers", type=int, default=3, help="first layers walked (default 3)")
    p.add_argument("--samples", type=int, default=32, help="calibration samples (default 32; 1/8 held out)")
    p.add_argument("--seqlen", type=int, default=128, help="tokens per sample (default 128, the CPU default)")
    p.add_argument("--lr", type=float, default=CompensateConfig.lr, help="compensate.lr")
    p.add_argument("--retries", type=int, default=CompensateConfig.lr_retries, help="compensate.lr_retries")
    return p.parse_args()


def first_layers(model, n: int):
    """The model cut to its first n decoder layers (the head is never used here)."""
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]
    return model


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    dense = first_layers(loaded.model.eval(), args.layers).requires_grad_(False)
    ids = calibration_samples(loaded.tokenizer, "builtin", args.samples, args.seqlen, 0)
    sparse = copy.deepcopy(dense)
    prune = PruneConfig()
    rule = MatrixRule.of(prune)
    walk_layers(Lane(sparse, capture_inputs(sparse, None, ids, CPU)), lambda ctx: prune_layer(ctx, rule, prune.sparsity),
                WalkOptions(CPU, 8, "prune"))
    cfg = dataclasses.replace(CompensateConfig(), batch_size=CompensateConfig.cpu_batch_size, final_kl_epochs=0,
                              lr=args.lr, lr_retries=args.retries)
    step = make_step(cfg, prune.targets, split_indices(args.samples, cfg.val_fraction, 0), 0, SegmentMeter(CPU))
    t0 = time.perf_counter()
    records = walk_layers(Lane(sparse, capture_inputs(sparse, None, ids, CPU)), step, WalkOptions(CPU, 2, "LaCo"),
                          paths=Paths.BOTH, dense=Lane(dense), dense_in_step=False)
    keys = ("layer", "loss_before", "loss_after", "best_epoch", "lr_tried", "val_history", "train_s")
    rows = [{k: r[k] for k in keys} for r in records]
    write_json(args.out, {"model": args.model, "layers": args.layers, "samples": args.samples, "seqlen": args.seqlen,
                          "lr": args.lr, "lr_retries": args.retries, "wall_s": round(time.perf_counter() - t0, 1),
                          "records": rows})
    for r in rows:
        print(f"layer {r['layer']}: {r['loss_before']:.4g} -> {r['loss_after']:.4g} lr tried {r['lr_tried']} "
              f"val {r['val_history']}")


if __name__ == "__main__":
    main()
