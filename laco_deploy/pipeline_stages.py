"""The five build stages as calls into the stage packages, wired through a pipeline.Builder.

Each stage's reuse key is made of its own settings and the hashes of its inputs (the previous
stage's outputs), so a change anywhere upstream reruns everything downstream and nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from laco_deploy.config import to_dict
from laco_deploy.targets import TARGETS

if TYPE_CHECKING:
    from laco_deploy.pipeline import Builder

log = logging.getLogger(__name__)


def _calib(data) -> dict:
    """The data settings that shape calibration samples (evaluation settings must not rerun training)."""
    return {"calib": data.calib, "samples": data.samples, "seqlen": data.seqlen, "seed": data.seed}


def _eval(data) -> dict:
    return {"eval": data.eval, "eval_samples": data.eval_samples, "seqlen": data.seqlen}


def _hash_of(b: "Builder", stage: str, label: str) -> str:
    return b.manifest["stages"][stage]["files"][label]["sha256"]


def stage_prune(b: "Builder") -> Path:
    from laco_deploy.prune import run as prune

    cfg, out = b.cfg, b.layout.pruned
    settings = {"model": to_dict(cfg.model), "data": _calib(cfg.data), "prune": to_dict(cfg.prune)}
    settings["model"].pop("device")
    inputs = {"model": b.manifest["inputs"]["model"], "calib": b.manifest["inputs"]["calib"]}
    b.stage("prune", settings, inputs, {"pruned": out},
            lambda: prune(cfg.model, cfg.data, cfg.prune, out, resume=cfg.resume, device=b.device))
    return out


def stage_compensate(b: "Builder", pruned: Path) -> Path:
    cfg = b.cfg
    if cfg.compensate.method == "none":
        return pruned
    from laco_deploy.compensate import run as compensate

    out = b.layout.recovered
    settings = {"data": _calib(cfg.data), "compensate": to_dict(cfg.compensate)}
    inputs = {"dense": b.manifest["inputs"]["model"], "pruned": _hash_of(b, "prune", "pruned"),
              "calib": b.manifest["inputs"]["calib"]}
    b.stage("compensate", settings, inputs, {"recovered": out},
            lambda: compensate(cfg.model, cfg.data, cfg.compensate, pruned, out, resume=cfg.resume, device=b.device))
    return out


def stage_export(b: "Builder", pruned: Path, recovered: Path) -> dict[str, Path]:
    """Export the recovered model, plus dense and pruned references for the runtime comparison."""
    from laco_deploy.models import local_model_dir

    cfg, lay = b.cfg, b.layout
    target = TARGETS[cfg.export.target]
    dense_dir = local_model_dir(cfg.model.model, allow_pickle=cfg.model.allow_pickle)
    sources = {"dense": dense_dir, "pruned": pruned}
    if recovered != pruned:
        sources["model"] = recovered
    else:
        sources = {"dense": dense_dir, "model": pruned}
    outputs = {label: lay.exported(label) for label in sources}
    settings = {"export": to_dict(cfg.export), "quant": lay.quant}
    inputs = {"dense": b.manifest["inputs"]["model"], "pruned": _hash_of(b, "prune", "pruned")}
    if "compensate" in b.manifest["stages"] and recovered != pruned:
        inputs["recovered"] = _hash_of(b, "compensate", "recovered")

    def run() -> dict:
        results = {}
        for label, src in sources.items():
            sparse = cfg.export.sparse_storage and label != "dense"
            results[label] = target.export(src, outputs[label], lay.quant, sparse_storage=sparse).to_dict()
        return results

    b.stage("export", settings, inputs, outputs, run)
    return outputs


def stage_fidelity(b: "Builder", pruned: Path, recovered: Path, exported: dict[str, Path]):
    from laco_deploy.fidelity import run as fidelity

    cfg = b.cfg
    candidates: dict[str, Path] = {"pruned": pruned}
    if recovered != pruned:
        candidates[cfg.compensate.method] = recovered
    candidates[f"{cfg.export.target}-{b.layout.quant}"] = exported["model"]
    settings = {"data": _eval(cfg.data), "fidelity": to_dict(cfg.fidelity)}
    inputs = {"dense": b.manifest["inputs"]["model"], "eval": b.manifest["inputs"]["eval"],
              "candidates": {k: _hash_of(b, "export", "model") if k.startswith(cfg.export.target) else
                             _hash_of(b, "compensate" if k != "pruned" else "prune", "recovered" if k != "pruned" else "pruned")
                             for k in candidates}}
    if cfg.fidelity.tasks:  # zero-shot task files and their data are inputs too: editing one reruns the stage
        from laco_deploy.fidelity.tasks import tasks_fingerprint

        inputs["tasks"] = tasks_fingerprint(cfg.fidelity.tasks)
    outputs = {name: b.layout.root / name for name in ("fidelity.json", "fidelity.md", "fidelity.html")}
    return b.stage("fidelity", settings, inputs, outputs,
                   lambda: fidelity(cfg.model, cfg.data, cfg.fidelity, candidates, b.layout.root, device=b.device))


def stage_bench(b: "Builder", exported: dict[str, Path]):
    from laco_deploy.fsutil import write_json

    cfg = b.cfg
    target = TARGETS[cfg.export.target]
    out = b.layout.root / "bench.json"
    models = {"dense": exported["dense"]}
    if "pruned" in exported:
        models["pruned"] = exported["pruned"]
    models[cfg.compensate.method if cfg.compensate.method != "none" else "pruned"] = exported["model"]
    settings = {"bench": to_dict(cfg.bench), "eval": cfg.data.eval}
    inputs = {label: b.manifest["stages"]["export"]["files"][label]["sha256"] for label in exported}

    def run():
        result = target.run_benchmark(models, eval_spec=cfg.data.eval, cfg=cfg.bench,
                                      device=target.runtime_device(b.device))
        write_json(out, result.to_dict())
        return result

    return b.stage("bench", settings, inputs, {"bench.json": out}, run)


def run_all(b: "Builder") -> None:
    pruned = stage_prune(b)
    recovered = stage_compensate(b, pruned)
    exported = stage_export(b, pruned, recovered)
    fid = stage_fidelity(b, pruned, recovered, exported)
    stage_bench(b, exported)
    b.manifest["gates_passed"] = bool(fid["result"].get("passed", True))
    b.save()
