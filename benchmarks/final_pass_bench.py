"""The final KL pass's variants on the default build's walked model: memory, time and quality.

    python benchmarks/final_pass_bench.py prepare --work /tmp/fp       # prune + walk once (default build settings)
    python benchmarks/final_pass_bench.py variant --work /tmp/fp --name adafactor_1e-2 \
        --set final_kl_optimizer=adafactor --set final_kl_lr=1e-2    # one process per variant

`prepare` prunes the default model as `laco-deploy build` does (Wanda 50% on builtin:mixed) and
runs the default LaCo walk alone (256 x 128 tokens, 2 epochs: the walk no longer depends on the
pass's samples), then scores the dense and pruned models. Each `variant` is a fresh process: it
loads the walked model as the compensate stage holds it (resident; the dense twin streamed), runs
the pass as the stage runs it (laco._final_pass, on the next 256 calibration samples) and records
the peak RSS growth while the pass ran (the stage's own measure()), its wall time, the held-out KL
and the perplexity of every evaluation domain (16 windows x 256 tokens, fp32, as fidelity scores
them) with the share of the pruned-to-dense gap closed. Results append to <work>/variants.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from laco_deploy.compensate import distill, klpass, laco, streamed
from laco_deploy.compensate import run as compensate_run
from laco_deploy.compensate.budget import resolve_budget
from laco_deploy.compensate.train import autocast_ctx, cosine_lr, propagate_dtype, resolve_precision, split_indices
from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig, PruneConfig
from laco_deploy.data import calibration_samples, eval_domains, evaluation_windows
from laco_deploy.engine import capture_inputs
from laco_deploy.engine.checkpoint import _load_layer_state
from laco_deploy.engine.walk import call_layer
from laco_deploy.fidelity.metrics import next_token_nll
from laco_deploy.memory import measure
from laco_deploy.models import decoder_layers, load_model
from laco_deploy.prune.run import run as prune_run

MODEL, DATA = ModelConfig(model="default", device="cpu"), DataConfig()
CPU = torch.device("cpu")


@torch.no_grad()
def domain_ppl(model, tokenizer) -> dict[str, float]:
    out = {}
    for label, spec in eval_domains(DATA.eval):
        ids = evaluation_windows(tokenizer, spec, DATA.eval_samples, DATA.seqlen)
        nll, count = 0.0, 0
        for row in ids:
            logits = model(row[None], use_cache=False).logits[0]
            values = next_token_nll(logits, row)
            nll, count = nll + float(values.sum()), count + values.numel()
        out[label] = round(math.exp(nll / count), 3)
    return out


def prepare(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "pruned" / "config.json").is_file():
        prune_run(MODEL, DATA, PruneConfig(), work / "pruned")
    if not (work / "walked" / "config.json").is_file():
        compensate_run(MODEL, DATA, CompensateConfig(final_kl_epochs=0), work / "pruned", work / "walked")
    refs = {}
    for name, path in (("dense", MODEL.model), ("pruned", str(work / "pruned")), ("walk", str(work / "walked"))):
        loaded = load_model(path)
        refs[name] = domain_ppl(loaded.model.eval(), loaded.tokenizer)
        print(name, refs[name], flush=True)
    (work / "refs.json").write_text(json.dumps(refs, indent=2))


class _Walked:
    """Stands in for the walk's LayerCheckpoints: the pass's guard reloads the walked layers."""

    def __init__(self, path: Path):
        self.path = path

    def reload(self, i: int, layer) -> bool:
        from laco_deploy.engine.lazy import read_tensors

        prefix = f"model.layers.{i}."
        state = {k[len(prefix):]: v for k, v in read_tensors(self.path).items() if k.startswith(prefix)}
        _load_layer_state(layer, state)
        return True


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_pass(models, kl_ids: torch.Tensor, cfg: CompensateConfig, block: int) -> dict:
    """A candidate that lost (not in the product): the pass streamed block by block, each block of
    `block` layers trained for cfg.final_kl_epochs on the KL with every other layer frozen (AdamW
    state for that block only; gradients through the later layers as activations), then its
    outputs become the next block's inputs."""
    model, n = models.sparse, len(decoder_layers(models.sparse))
    propagate = propagate_dtype(CPU, cfg.precision)
    teacher = distill.dense_teacher(models.dense, models.dense_lazy, capture_inputs(model, None, kl_ids, CPU), CPU,
                                    cfg.batch_size, propagate)
    inputs = capture_inputs(model, None, kl_ids, CPU)
    kwargs = inputs.kwargs_per_layer(n, CPU)
    amp = lambda: autocast_ctx(CPU, cfg.precision)  # noqa: E731
    stack = klpass.LayerStack(model, None, kwargs, CPU, amp)
    train_idx, val_idx = split_indices(kl_ids.shape[0], cfg.val_fraction, DATA.seed)
    cache, t0 = inputs.hidden.data, time.perf_counter()

    def held_out(start: int) -> float:
        total = 0.0
        for rows in val_idx.split(cfg.batch_size):
            last, _ = stack.forward(cache[rows], False, start)
            total += klpass.chunked_kl(model, last, teacher.data[rows], None, amp, False)[0] * len(rows)
        return total / len(val_idx)

    before, steps = held_out(0), 0
    for start in range(0, n, block):
        end = min(n, start + block)
        stepper = distill.StepInBackward(cfg.final_kl_optimizer, TARGETS, CPU)
        attach = lambda i, layer: stepper.attach(i, layer) if i < end else None  # noqa: E731
        detach = lambda i, layer: stepper.detach(i, layer) if i < end else None  # noqa: E731
        gen = torch.Generator().manual_seed(DATA.seed + start)
        total = -(-len(train_idx) // cfg.batch_size) * cfg.final_kl_epochs
        for step in range(total):
            if step % -(-len(train_idx) // cfg.batch_size) == 0:
                order = train_idx[torch.randperm(len(train_idx), generator=gen)].split(cfg.batch_size)
            rows = order[step % len(order)]
            stepper.lr = cfg.kl_lr * cosine_lr(step, total, int(total * cfg.warmup_fraction))
            last, saved = stack.forward(cache[rows], True, start)
            _, grad = klpass.chunked_kl(model, last, teacher.data[rows], None, amp, True)
            stack.backward(saved, grad, attach, detach, start)
            steps += 1
        with torch.no_grad(), amp():  # this block's outputs are the next block's inputs
            for rows in torch.arange(len(cache)).split(cfg.batch_size):
                x = cache[rows]
                for i in range(start, end):
                    x = call_layer(decoder_layers(model)[i], x, kwargs[i])
                cache[rows] = x.float()
    after = held_out(n)  # the cache now holds the last hidden states
    return {"kl_before": round(before, 6), "kl_after": round(after, 6), "steps": steps, "block": block,
            "train_s": round(time.perf_counter() - t0, 1)}


def variant(work: Path, name: str, settings: dict) -> None:
    block = settings.pop("block", None)
    # the precision the stage resolves on this CPU (bf16 autocast only where its matmul is native)
    cfg = dataclasses.replace(CompensateConfig(), batch_size=CompensateConfig.cpu_batch_size, **settings)
    cfg = dataclasses.replace(cfg, precision=resolve_precision(cfg.precision, CPU))
    propagate = propagate_dtype(CPU, cfg.precision)  # as laco.compensate
    budget = resolve_budget(cfg, DATA, CPU)
    models = streamed.open_models(MODEL, work / "walked", cfg, work / "spill")
    ids = calibration_samples(models.tokenizer, DATA.calib, budget.samples + budget.kl_samples, budget.seqlen, DATA.seed)
    for p in models.sparse.parameters():
        p.sum()  # page the weights in, as the stage does before it measures
    t0 = time.perf_counter()
    if block:
        with measure(CPU) as m:
            final = block_pass(models, ids[budget.samples:], cfg, block)
        final.update({"peak_mib": round(m.peak_bytes / 2**20, 1), "peak_delta_mib": round(m.peak_delta_bytes / 2**20, 1)})
    else:  # as the stage runs it: the dense teacher walked alone, then the pass, its own measured segment
        final, _ = laco._final_pass(models.dense, models.sparse, ids[budget.samples:], cfg, TARGETS, device=CPU,
                                    seed=DATA.seed, meter=laco.SegmentMeter(CPU), checkpoints=_Walked(work / "walked"),
                                    layer_loader=models.sparse_lazy, dense_loader=models.dense_lazy,
                                    propagate=propagate, workdir=work)
    wall = time.perf_counter() - t0
    refs = json.loads((work / "refs.json").read_text())
    ppl = domain_ppl(models.sparse.eval(), models.tokenizer)
    gap = {d: round(100 * (refs["pruned"][d] - v) / (refs["pruned"][d] - refs["dense"][d]), 1) for d, v in ppl.items()}
    row = {"name": name, "precision": cfg.precision, "settings": {**settings, **({"block": block} if block else {})}, "peak_mib": final["peak_mib"],
           "peak_delta_mib": final["peak_delta_mib"], "wall_s": round(wall, 1), "ppl": ppl,
           "gap_closed_pct": gap, "final": final, "layers": len(decoder_layers(models.sparse))}
    print(json.dumps(row), flush=True)
    with open(work / "variants.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "variant"])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--name", default="default")
    ap.add_argument("--set", action="append", default=[], help="compensate.FIELD=VALUE for the pass")
    args = ap.parse_args()
    if args.what == "prepare":
        prepare(args.work)
    else:
        variant(args.work, args.name, {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)})


if __name__ == "__main__":
    main()
