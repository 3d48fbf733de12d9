"""What tests/test_distributed.py runs inside torchrun processes (and in-process, for the 1-process side).

    python -m torch.distributed.run ... tests/dist_jobs.py options MODEL SPARSE CALIB OUT NAME,NAME,...
    python -m torch.distributed.run ... tests/dist_jobs.py fail-at-layer-1 CLI-ARGS...
    python -m torch.distributed.run ... tests/dist_jobs.py count-training CLI-ARGS...
    python -m torch.distributed.run ... tests/dist_jobs.py build-resume MODEL CALIB OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# LaCo settings whose rank invariance test_laco_options_two_ranks_like_one checks, each on top of
# BASE. lsq's damping is strong enough that the tiny model keeps the refit (the test checks it).
# fp32: 2 ranks equal 1 process up to the order of float sums; under bf16 autocast (auto on CPUs with
# native bf16) that order noise is amplified by bf16 rounding to the size of the tiny model's update.
# The final KL pass is off in BASE (the options are the walk's) and on in "final_kl": its 4 fresh
# samples follow the walk's 8 and are shared by the ranks as the walk's are (2 each).
BASE = {"samples": 8, "epochs": 2, "batch_size": 3, "lr": 1e-3, "val_fraction": 0.25, "precision": "fp32",
        "final_kl_epochs": 0}
OPTIONS = {
    "cos_mse": {"loss": "cos_mse"},
    "subblock_norms": {"loss": "subblock", "train_norms": True},
    "anchor_mix_accum": {"anchor_decay": 50.0, "dense_input_mix": 0.5, "grad_accum": 2},
    "quant_aware": {"quant_aware": "q8_0"},
    "lsq": {"init": "lsq", "lsq_damp": 10.0, "lsq_token_weight": "nmse"},
    "lowrank": {"trainable": "lowrank"},
    "final_kl": {"final_kl_epochs": 2, "final_kl_lr": 1e-3, "final_kl_samples": 4},
}
DATA = {"samples": 8, "seqlen": 32, "seed": 0}
MARK = "dist_jobs: trained layer"


def compensate_options(model: Path, sparse: Path, calib: Path, out: Path, names: list[str]) -> dict[str, list[dict]]:
    """LaCo with each named option set, out/NAME per set; the per-layer records, by name (rank 0 also
    writes them to out/records.json)."""
    from laco_deploy import distributed
    from laco_deploy.compensate import run
    from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig

    records = {}
    for name in names:
        res = run(ModelConfig(model=str(model), device="cpu"), DataConfig(calib=str(calib), **DATA),
                  CompensateConfig(**{**BASE, **OPTIONS[name]}), Path(sparse), Path(out) / name)
        records[name] = res.per_layer
    if distributed.is_main():
        (Path(out) / "records.json").write_text(json.dumps(records, default=str))
    return records


def _fail_at_layer_1() -> None:
    """The job dies with layer 0's checkpoint on disk and layer 1 trained but not saved: all ranks
    meet at layer 1's save, then rank 1 stops (Ctrl-C) and rank 0 waits for it until torchrun ends it."""
    from laco_deploy import distributed
    from laco_deploy.engine.checkpoint import LayerCheckpoints

    real = LayerCheckpoints.save

    def save(self, i, layer, record):
        if i == 1:
            distributed.barrier()
            if distributed.rank() == 1:
                raise KeyboardInterrupt
            distributed.barrier()  # rank 1 never comes
        return real(self, i, layer, record)

    LayerCheckpoints.save = save


def _count_training() -> None:
    """Print a line to stderr for every layer a rank trains (a restored layer is not trained)."""
    from laco_deploy import distributed
    from laco_deploy.compensate.train import LayerTrainer

    real = LayerTrainer.fit

    def fit(self, *args, **kwargs):
        print(f"{MARK} (seed {self.seed}) on rank {distributed.rank()}", file=sys.stderr, flush=True)
        return real(self, *args, **kwargs)

    LayerTrainer.fit = fit


def _build_first_stages(model: Path, calib: Path, out: Path, resume: bool = False):
    """build's prune and compensate stages, as build() runs them; -> (recipe, recovered model folder)."""
    from laco_deploy.buildconfig import merge
    from laco_deploy.pipeline import prepare

    values = {"model": {"model": str(model), "device": "cpu"}, "compensate": {"epochs": 1},
              "data": {"calib": str(calib), "samples": 6, "seqlen": 32, "eval_samples": 2}}
    recipe = prepare(merge(values, {"out": str(out), "resume": resume}))
    src = recipe.sources()
    return recipe, recipe.compensate(src, recipe.prune(src)).path


def build_resume(model: Path, calib: Path, out: Path) -> None:
    """In one torchrun job: an uninterrupted build (OUT/ref), one stopped on every rank as LaCo
    reaches layer 1 (OUT/killed), and `--resume` of it. Rank 0 writes OUT/result.json: the folders,
    the layers each rank trained on resume, and whether prune was reused."""
    import laco_deploy.compensate.laco as laco
    from laco_deploy import distributed

    _, reference = _build_first_stages(model, calib, out / "ref")
    real_make_step = laco.make_step

    def stop_at_layer_1(*args, **kwargs):
        step = real_make_step(*args, **kwargs)

        def stopping(ctx):
            if ctx.index == 1:
                raise KeyboardInterrupt  # every rank at the same point: no collective is left waiting
            return step(ctx)
        return stopping

    laco.make_step = stop_at_layer_1
    try:
        _build_first_stages(model, calib, out / "killed")
    except KeyboardInterrupt:
        pass
    stages_after_kill = list(json.loads((out / "killed" / "manifest.json").read_text())["stages"])
    trained: list[int] = []

    def counting(*args, **kwargs):
        step = real_make_step(*args, **kwargs)
        return lambda ctx: (trained.append(ctx.index), step(ctx))[1]

    laco.make_step = counting
    recipe, recovered = _build_first_stages(model, calib, out / "killed", resume=True)
    per_rank = distributed.gather_all(trained)
    if distributed.is_main():
        (out / "result.json").write_text(json.dumps({
            "reference": str(reference), "recovered": str(recovered), "trained": per_rank,
            "stages_after_kill": stages_after_kill, "prune_reused": recipe.cache.manifest["stages"]["prune"]["reused"]}))


def main(argv: list[str]) -> None:
    mode, rest = argv[0], argv[1:]
    if mode == "options":
        from laco_deploy import distributed

        distributed.init_from_env()
        try:
            compensate_options(*map(Path, rest[:4]), rest[4].split(","))
        finally:
            distributed.teardown()
        return
    if mode == "build-resume":
        from laco_deploy import distributed

        distributed.init_from_env()
        try:
            build_resume(*map(Path, rest))
        finally:
            distributed.teardown()
        return
    {"fail-at-layer-1": _fail_at_layer_1, "count-training": _count_training}[mode]()
    from laco_deploy.cli import main as cli_main

    cli_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
