"""Does the LaCo walk make the whole model better? Model-level KL to the dense logits of a pruned
model before and after the walk, on held-out samples (issue 31).

The walk is the compensate stage's own `laco.compensate` (dense twin streamed from its safetensors
as the stage streams it, the model-level guard's record, no final KL pass; the guard's restore is
switched off so the walked weights are scored). KL is measured here too, on 8 held-out samples of
`builtin` and of `builtin:mixed` (seed 1, never trained on), per position: all, position 0 (after
BOS), positions 1+. Settings of CompensateConfig can be overridden with --set key=value.

    flock /work/heavy.lock env OMP_NUM_THREADS=1 python benchmarks/walk_kl_probe.py \\
        --model gemma-3-270m-q4_k_m.gguf --pruned BUILD/pruned --samples 64 --out g3-walk.json [--set lr=3e-4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laco_deploy.compensate import laco  # noqa: E402
from laco_deploy.compensate.guard import ModelGuard  # noqa: E402
from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig, PruneConfig  # noqa: E402
from laco_deploy.data import calibration_samples  # noqa: E402
from laco_deploy.engine import Lane, LazyModel, WalkOptions, capture_inputs, walk_layers  # noqa: E402
from laco_deploy.fsutil import write_json  # noqa: E402
from laco_deploy.models import load_model, local_model_dir  # noqa: E402
from laco_deploy.prune.step import MatrixRule, prune_layer  # noqa: E402

CPU = torch.device("cpu")
HELD = ("builtin", "builtin:mixed")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the dense model: a .gguf file, a Hugging Face directory or 'default'")
    p.add_argument("--pruned", type=Path, help="the pruned model's folder (default: Wanda 50%% here, on the walk's samples)")
    p.add_argument("--calib", default="builtin:mixed", help="the walk's calibration text (default builtin:mixed, as a build)")
    p.add_argument("--samples", type=int, default=64, help="walk samples, 1/8 held out (default 64)")
    p.add_argument("--seqlen", type=int, default=128, help="tokens per sample (default 128, the CPU budget's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a CompensateConfig field (JSON value)")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    return p.parse_args()


@torch.no_grad()
def kl_by_position(dense, model, held: dict[str, torch.Tensor]) -> dict:
    """Mean token KL(dense || model) per text: all positions, position 0, positions 1+."""
    out = {}
    for text, ids in held.items():
        rows = []
        for i in range(len(ids)):
            t = torch.log_softmax(dense(ids[i:i + 1]).logits[0].float(), -1)
            s = torch.log_softmax(model(ids[i:i + 1]).logits[0].float(), -1)
            rows.append((t.exp() * (t - s)).sum(-1))  # [seq]
        k = torch.stack(rows)
        out[text] = {"all": round(k.mean().item(), 4), "pos0": round(k[:, 0].mean().item(), 4),
                     "pos1+": round(k[:, 1:].mean().item(), 4)}
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dense_dir = local_model_dir(args.model)
    loaded = load_model(str(dense_dir))
    dense, tok = loaded.model.eval().requires_grad_(False), loaded.tokenizer
    ids = calibration_samples(tok, args.calib, args.samples, args.seqlen, 0)
    held = {text: calibration_samples(tok, text, 8, args.seqlen, 1) for text in HELD}
    if args.pruned is not None:
        sparse = load_model(str(args.pruned)).model.eval()
    else:
        sparse = load_model(str(dense_dir)).model.eval()
        walk_layers(Lane(sparse, capture_inputs(sparse, None, ids, CPU)),
                    lambda ctx: prune_layer(ctx, MatrixRule.of(PruneConfig()), 0.5), WalkOptions(CPU, 8, None))
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = dataclasses.replace(CompensateConfig(), batch_size=CompensateConfig.cpu_batch_size, final_kl_epochs=0,
                              precision="fp32", **overrides)
    result = {"model": args.model, "pruned": str(args.pruned), "calib": args.calib, "samples": args.samples,
              "seqlen": args.seqlen, "overrides": overrides, "kl_pruned": kl_by_position(dense, sparse, held)}
    lazy = LazyModel.open(dense_dir, rest=False)  # the dense twin as the stage streams it
    guard = ModelGuard(lambda _model: None)  # measure only: keep the walked weights
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        records, _ = laco.compensate(lazy.model, sparse, ids, cfg, PRUNABLE_LINEARS, device=CPU, seed=0,
                                     checkpoint_dir=Path(work) / "ckpt", fingerprint={}, resume=False,
                                     meter=laco.SegmentMeter(CPU), dense_loader=lazy, kl_samples=0, guard=guard)
    result.update({"walk_s": round(time.perf_counter() - t0, 1), "guard": guard.record,
                   "layers": [{"layer": r["layer"], "loss_before": round(r["loss_before"], 5),
                               "loss_after": round(r["loss_after"], 5), "lr_tried": r["lr_tried"]} for r in records],
                   "kl_walked": kl_by_position(dense, sparse, held)})
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("guard", "kl_pruned", "kl_walked", "walk_s")}, indent=2))


if __name__ == "__main__":
    main()
