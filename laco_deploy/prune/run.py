"""The prune stage: load the dense model, walk its layers on the sparse path, write a HF directory.

Lifecycle only; the math lives in scoring.py (masks, SparseGPT), structural.py (channel removal)
and owl.py (per-layer ratios). Checkpoints go to `<out_dir>.ckpt/` and are removed on success.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laco_deploy import data as data_mod
from laco_deploy import distributed, families
from laco_deploy.artifacts import SPARSITY_FILE, ModelDirResult, checkpoint_dir
from laco_deploy.checked import Checked, check
from laco_deploy.config import (
    PRUNABLE_LINEARS,
    DataConfig,
    ModelConfig,
    PruneConfig,
    to_dict,
)
from laco_deploy.engine import Lane, LayerCheckpoints, LazyModel, WalkOptions, capture_inputs, walk_layers
from laco_deploy.errors import ConfigError
from laco_deploy.fsutil import mark_folder, reuse_key
from laco_deploy.memory import measure
from laco_deploy.models import (
    HUB,
    check_architecture,
    linear_modules,
    load_model,
    local_dir,
    resolve_source,
    save_model,
    source_fingerprint,
)
from laco_deploy.prune import owl, record, step, structural

log = logging.getLogger(__name__)


def _calibration_record(data_cfg: DataConfig) -> dict:
    return {"calib": data_cfg.calib, "samples": data_cfg.samples, "seqlen": data_cfg.seqlen, "seed": data_cfg.seed,
            "sample_format": data_mod.SAMPLE_FORMAT}


def _resume_key(model_cfg: ModelConfig, data_cfg: DataConfig, prune_cfg: PruneConfig) -> dict:
    """What must match for --resume to reuse checkpoints: the reuse key of build stages
    (fsutil.reuse_key) over the settings and the content hashes of the model and the texts."""
    settings = {"data": _calibration_record(data_cfg), "prune": to_dict(prune_cfg)}
    inputs = {"model": source_fingerprint(model_cfg.model), "calib": data_mod.fingerprint(data_cfg.calib, "calib")}
    return {"stage": "prune", "key": reuse_key(settings, inputs)}


def _make_step(prune_cfg: PruneConfig, ratios: list[float]):
    """The per-layer step; module functions are looked up at call time (tests patch them)."""
    if prune_cfg.structured is not None:
        return lambda ctx: structural.prune_layer_structured(ctx, prune_cfg.targets, prune_cfg.structured,
                                                             prune_cfg.structured_multiple, prune_cfg.structured_metric)
    rule = step.MatrixRule.of(prune_cfg)
    return lambda ctx: step.prune_layer(ctx, rule, ratios[ctx.index])


@dataclass
class _Source:
    model: Any  # transformers causal LM (on `meta` except non-layer weights when lazy)
    tokenizer: Any
    source: str  # what the user passed
    lazy: LazyModel | None  # set with --offload disk: layers streamed from safetensors


def _open_source(model_cfg: ModelConfig, offload: str, ckpt: Path) -> _Source:
    """The dense model: fully in RAM (offload cpu) or as a skeleton with layers on disk (offload disk)."""
    if offload != "disk":
        loaded = load_model(model_cfg.model, allow_pickle=model_cfg.allow_pickle,
                            trust_remote_code=model_cfg.trust_remote_code)
        return _Source(loaded.model, loaded.tokenizer, loaded.source, None)
    from laco_deploy.tokenizer import load_tokenizer

    source = resolve_source(model_cfg.model)
    if source.kind == HUB:
        raise ConfigError(f"prune.offload disk streams layers from a local model; {model_cfg.model!r} is a hub id: "
                          "set prune.offload to cpu, or pass a local Hugging Face directory or .gguf file")
    path = local_dir(source)
    lazy = LazyModel.open(path, spill_dir=distributed.rank_dir(ckpt / "spill"), rest=False)
    check_architecture(lazy.model.config)
    tok = load_tokenizer(path, trust_remote_code=model_cfg.trust_remote_code)
    return _Source(lazy.model, tok, model_cfg.model, lazy)


def _dense_numel(model) -> dict[str, int]:
    return {f"model.layers.{i}.{name}": lin.weight.numel() for i, layer in enumerate(model.model.layers)
            for name, lin in linear_modules(layer, PRUNABLE_LINEARS).items()}


def _prune_layers(src: _Source, ids: torch.Tensor, prune_cfg: PruneConfig, fingerprint: dict, ckpt: Path, *,
                  resume: bool, device: torch.device) -> tuple[list[dict], list[float]]:
    """Capture layer-0 inputs, pick the per-layer ratios, walk the layers with the prune step.
    In a torchrun job each rank captures its own shard of the samples (statistics are summed)."""
    part = distributed.shard(ids.shape[0])
    ids = ids[part.start:part.stop]
    inputs = capture_inputs(src.model, src.lazy, ids, device, prune_cfg.offload, ckpt)
    owl_on = (prune_cfg.owl_lambda, prune_cfg.owl_m) if prune_cfg.owl else None
    ratios = owl.layer_ratios(src.model, inputs, prune_cfg.sparsity, prune_cfg.targets, owl_on, device=device,
                              batch_size=prune_cfg.batch_size, cache_file=ckpt / "owl.json", resume=resume,
                              key=fingerprint["key"], loader=src.lazy.without_spill() if src.lazy is not None else None)
    records = walk_layers(Lane(src.model, inputs, src.lazy), _make_step(prune_cfg, ratios),
                          WalkOptions(device, prune_cfg.batch_size, "prune"),
                          checkpoints=LayerCheckpoints(ckpt, fingerprint, resume))
    return records, ratios


def run(model_cfg: ModelConfig, data_cfg: DataConfig, prune_cfg: PruneConfig, out_dir: Path, *,
        resume: bool = False, device: torch.device | None = None) -> ModelDirResult:
    """Prune the dense model of `model_cfg` and write it to `out_dir` (HF dir + sparsity.json), after
    the boundary's checks (checked.check; a build passes it once and calls run_checked)."""
    return run_checked(check(model_cfg, data_cfg, device, prune=prune_cfg), out_dir, resume=resume)


def run_checked(c: Checked, out_dir: Path, *, resume: bool = False) -> ModelDirResult:
    """`run` on settings and inputs that passed the boundary."""
    model_cfg, data_cfg, prune_cfg, device = c.model, c.data, c.prune, c.device
    out_dir = Path(out_dir)
    ckpt = checkpoint_dir(out_dir)
    calib = _calibration_record(data_cfg)
    log.debug("prune settings: %s; calibration: %s; device %s", to_dict(prune_cfg), calib, device)
    t0 = time.perf_counter()
    with measure(device) as meas:
        src = _open_source(model_cfg, prune_cfg.offload, ckpt)
        (families.of_config(src.model.config) or families.TABLE[0]).check_targets(prune_cfg.targets)
        if prune_cfg.structured is not None:
            structural.check_feasible(src.model.config, prune_cfg.targets, prune_cfg.structured,
                                      prune_cfg.structured_multiple)
        ids = data_mod.calibration_samples(src.tokenizer, data_cfg.calib, data_cfg.samples, data_cfg.seqlen, data_cfg.seed)
        mark_folder(ckpt)  # marked as ours: a rerun may resume or clear it
        dense_numel = _dense_numel(src.model)
        records, ratios = _prune_layers(src, ids, prune_cfg, _resume_key(model_cfg, data_cfg, prune_cfg), ckpt,
                                        resume=resume, device=device)
        overall = record.summarize(records, dense_numel)
        if prune_cfg.structured is not None:
            structural.record_widths(src.model.config, records)
        src.model.config.laco_deploy = record.config_summary(prune_cfg, overall, calib)
        doc = record.sparsity_document(prune_cfg, records, overall, calib, time.perf_counter() - t0)
        extra = {SPARSITY_FILE: json.dumps(doc, indent=2) + "\n"}
        if not distributed.is_main():
            pass  # rank 0 writes the model; every rank holds the same weights
        elif src.lazy is not None:
            src.lazy.save(out_dir, src.tokenizer, extra_files=extra)
        else:
            save_model(src.model, src.tokenizer, out_dir, extra_files=extra)
    distributed.barrier()  # the other ranks' scratch files live in the checkpoint folder
    if distributed.is_main():
        shutil.rmtree(ckpt, ignore_errors=True)
    log.info("pruned model written to %s (sparsity %.4f)", out_dir, overall["sparsity"])
    m = meas.to_dict()
    return ModelDirResult(
        model_dir=str(out_dir), stage="prune", sparsity=overall["sparsity"], pattern=record.label(prune_cfg),
        settings={"prune": to_dict(prune_cfg), "calibration": calib, "model": src.source},
        per_layer=[{k: v for k, v in r.items() if k != "matrices"} for r in records],
        wall_s=m["wall_s"], peak_mib=m["peak_mib"], memory_kind=m["memory_kind"],
        notes=[f"layer ratios (OWL): {[round(r, 4) for r in ratios]}"] if prune_cfg.owl else [],
    )
