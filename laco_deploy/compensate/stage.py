"""The compensate stage: load dense + pruned models, run LaCo (or the LoRA baseline), write a HF dir.

Lifecycle only: budget resolution (budget.py), the layer loop (laco.py), the LoRA baseline
(lora.py) and the training math (train.py, losses.py, masks.py) live next door.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from laco_deploy import data as data_mod
from laco_deploy import devices, distributed, families, imatrix, sizing
from laco_deploy.artifacts import SPARSITY_FILE, ModelDirResult, checkpoint_dir
from laco_deploy.checked import Checked, check
from laco_deploy.compensate import laco, lora, steps, streamed
from laco_deploy.compensate.budget import Budget, resolve_budget
from laco_deploy.compensate.guard import ModelGuard, restore_layers_from
from laco_deploy.compensate.masks import dense_numel
from laco_deploy.compensate.record import config_summary, result_record, sparsity_document
from laco_deploy.compensate.train import amp_dtype, resolve_precision
from laco_deploy.config import IMATRIX_CALIB, PRUNABLE_LINEARS, CompensateConfig, DataConfig, ModelConfig, to_dict
from laco_deploy.errors import ConfigError, ModelError
from laco_deploy.fsutil import atomic_dir, atomic_path, mark_folder, reuse_key, sha256_tree
from laco_deploy.models import check_source, source_fingerprint
from laco_deploy.throughput import matmul_gflops

log = logging.getLogger(__name__)


def _check_sparse(sparse_dir: Path, comp_cfg: CompensateConfig, trust_remote_code: bool) -> None:
    """The pruned model folder a caller names (a build's own prune output needs no check)."""
    if not sparse_dir.is_dir() or not (sparse_dir / "config.json").is_file():
        raise ModelError(f"pruned model directory {sparse_dir} not found (no config.json there); "
                         "prune a model into DIR first (prune.out DIR) and pass DIR as compensate.sparse")
    if comp_cfg.recovers:  # before either model loads
        check_source(str(sparse_dir), trust_remote_code=trust_remote_code)


def check_compatible(dense_cfg: Any, sparse_cfg: Any, dense_dir: str, sparse_dir: Path) -> None:
    """The pruned model must come from the dense one: same family, depth, width and vocabulary."""
    keys = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
    diff = [f"{k} {getattr(dense_cfg, k, None)} vs {getattr(sparse_cfg, k, None)}" for k in keys
            if getattr(dense_cfg, k, None) != getattr(sparse_cfg, k, None)]
    if diff:
        raise ModelError(f"dense model {dense_dir} and pruned model {sparse_dir} do not match ({'; '.join(diff)}); "
                         "pass as model.model the model that was pruned into compensate.sparse")


def _check_shapes(dense, sparse, targets: tuple[str, ...], sparse_dir: Path) -> None:
    """Shapes only (skeletons on `meta` have them too)."""
    numel = dense_numel(dense, targets)
    for key, n in dense_numel(sparse, targets).items():
        if n > numel.get(key, -1):
            raise ModelError(f"{sparse_dir}: {key} is larger than in the dense model; "
                             "pass as model.model the model that was pruned into compensate.sparse")


def _prune_info(sparse_cfg: Any) -> dict[str, Any]:
    info = getattr(sparse_cfg, "laco_deploy", None)
    return dict(info) if isinstance(info, dict) else {}


@torch.no_grad()
def _page_in(*models) -> None:
    """Read every weight once. Safetensors are memory-mapped, so pages are only faulted in on first
    use; without this, the recovery's peak-RSS growth would include the models' own weights."""
    for model in models:
        for p in model.parameters():
            p.sum()


def _resume_key(model_cfg, data_cfg, comp_cfg, budget: Budget, sparse_dir: Path) -> dict:
    """What must match for --resume: the reuse key of build stages (fsutil.reuse_key) over the
    settings and the content hashes of the dense and pruned models and the texts."""
    settings = {"data": {"calib": data_cfg.calib, "seed": data_cfg.seed, "sample_format": data_mod.SAMPLE_FORMAT},
                "budget": to_dict(budget), "compensate": to_dict(comp_cfg)}
    inputs = {"dense": source_fingerprint(model_cfg.model), "pruned": sha256_tree(sparse_dir),
              "calib": data_mod.fingerprint(data_cfg.calib, "calib")}
    return {"stage": "compensate", "key": reuse_key(settings, inputs)}


def _copy_only(sparse_dir: Path, out_dir: Path, comp_cfg: CompensateConfig) -> ModelDirResult:
    """method none: the pruned directory, copied unchanged."""
    t0 = time.perf_counter()
    if distributed.is_main():
        with atomic_dir(out_dir) as tmp:
            shutil.copytree(sparse_dir, tmp, dirs_exist_ok=True)
    distributed.barrier()
    doc = json.loads((sparse_dir / SPARSITY_FILE).read_text()) if (sparse_dir / SPARSITY_FILE).is_file() else {}
    cfg = json.loads((sparse_dir / "config.json").read_text()).get("laco_deploy", {})
    return ModelDirResult(model_dir=str(out_dir), stage="compensate", sparsity=float(cfg.get("sparsity", 0.0)),
                          pattern=str(doc.get("label", cfg.get("pattern", ""))), settings={"compensate": to_dict(comp_cfg)},
                          wall_s=round(time.perf_counter() - t0, 3), notes=["method none: pruned model copied unchanged"])


def _plan(comp_cfg: CompensateConfig, data_cfg: DataConfig, device: torch.device, sparse_dir: Path):
    """The budget, precision and step size this run uses; -> (settings with them, budget, step plan)."""
    budget = resolve_budget(comp_cfg, data_cfg, device)
    model_config = json.loads((sparse_dir / "config.json").read_text())
    comp_cfg = dataclasses.replace(comp_cfg, precision=resolve_precision(comp_cfg.precision, device),
                                   loss=comp_cfg.loss or families.layer_loss(model_config),
                                   lr=comp_cfg.lr if comp_cfg.lr is not None else families.layer_lr(model_config))
    train_samples = budget.samples - int(budget.samples * comp_cfg.val_fraction)  # as split_indices holds out
    step_plan = steps.plan(comp_cfg, budget.seqlen, train_samples, sizing.model_bytes(sparse_dir),
                           devices.traits(device), comp_cfg.needs_dense_layer)
    comp_cfg = step_plan.apply(comp_cfg)
    log.info("training steps: %s", step_plan.reason)
    log.info("training computes in %s%s", comp_cfg.precision,
             "" if comp_cfg.precision == "fp32" else " (autocast; weights, optimizer state and activations stay fp32)")
    return comp_cfg, budget, step_plan


def _importance(comp_cfg: CompensateConfig, data_cfg: DataConfig, budget: Budget, sparse_dir: Path, ckpt: Path,
                device: torch.device) -> tuple[dict[str, torch.Tensor] | None, Path | None]:
    """compensate.quant_imatrix -> (per decoder linear, the importance the fake quantizer is weighted by;
    the file holding it), or (None, None). IMATRIX_CALIB: llama-imatrix's statistic on the pruned model
    over the walk's samples (the first `budget.samples` of the calibration draw)."""
    if comp_cfg.quant_imatrix is None:
        return None, None
    if comp_cfg.quant_imatrix == IMATRIX_CALIB:
        cfg = dataclasses.replace(data_cfg, samples=budget.samples, seqlen=budget.seqlen)
        path = Path(imatrix.compute(sparse_dir, cfg, mark_folder(ckpt) / imatrix.TRAINED_FILE, device=device).path)
    else:
        path = Path(comp_cfg.quant_imatrix)
    importance = imatrix.linear_importance(path, sparse_dir)
    log.info("quant-aware %s through llama.cpp's importance-weighted quantizer: %d linears weighted by %s",
             comp_cfg.quant_aware, len(importance), path)
    return importance, path


def _save(models, out_dir: Path, doc: dict, imatrix_file: Path | None) -> None:
    """The recovered model, and the importance matrix QA-LaCo trained through, which an export with an
    importance matrix takes (imatrix.trained_with) so that it reproduces the grid."""
    streamed.save(models, out_dir, extra_files={SPARSITY_FILE: json.dumps(doc, indent=2) + "\n"})
    if imatrix_file is not None:
        with atomic_path(out_dir / imatrix.TRAINED_FILE) as tmp:
            shutil.copyfile(imatrix_file, tmp)


def run(model_cfg: ModelConfig, data_cfg: DataConfig, comp_cfg: CompensateConfig, sparse_dir: Path, out_dir: Path, *,
        resume: bool = False, device: torch.device | None = None) -> ModelDirResult:
    """Compensate the pruned model in `sparse_dir` towards the dense `model_cfg.model`; write `out_dir`;
    after the boundary's checks (checked.check; a build passes it once and calls run_checked)."""
    sparse_dir = Path(sparse_dir)
    copy = not comp_cfg.recovers  # a copy reads neither the dense model nor the texts, on no device
    checked = check(model_cfg, data_cfg, torch.device("cpu") if copy else device, compensate=comp_cfg,
                    reads_inputs=not copy)
    _check_sparse(sparse_dir, comp_cfg, model_cfg.trust_remote_code)
    return run_checked(checked, sparse_dir, out_dir, resume=resume)


def run_checked(c: Checked, sparse_dir: Path, out_dir: Path, *, resume: bool = False) -> ModelDirResult:
    """`run` on settings and inputs that passed the boundary."""
    model_cfg, data_cfg, comp_cfg, device = c.model, c.data, c.compensate, c.device
    sparse_dir, out_dir = Path(sparse_dir), Path(out_dir)
    if comp_cfg.method == "lora" and distributed.world() > 1:
        raise ConfigError("compensate.method lora trains the whole model in one process and is not split over torchrun "
                          "ranks; run it without torchrun (or set compensate.method to laco)")
    if not comp_cfg.recovers:
        return _copy_only(sparse_dir, out_dir, comp_cfg)
    comp_cfg, budget, step_plan = _plan(comp_cfg, data_cfg, device, sparse_dir)
    log.debug("compensate settings: %s; device %s", to_dict(comp_cfg), device)
    ckpt = checkpoint_dir(out_dir)
    importance, imatrix_file = _importance(comp_cfg, data_cfg, budget, sparse_dir, ckpt, device)
    run_cfg = streamed.resolve_offload(comp_cfg, sparse_dir, budget.samples * budget.seqlen)
    models = streamed.open_models(model_cfg, sparse_dir, run_cfg, distributed.rank_dir(ckpt / "spill"))
    check_compatible(models.dense.config, models.sparse.config, model_cfg.model, sparse_dir)
    info = _prune_info(models.sparse.config)
    targets = tuple(info.get("targets") or PRUNABLE_LINEARS)
    _check_shapes(models.dense, models.sparse, targets, sparse_dir)
    numel = dense_numel(models.dense, targets)
    before = streamed.sparsity(models.sparse, models.sparse_lazy, targets, numel)
    # the final KL pass's fresh samples follow the walk's (the same seed draws the same first ones)
    ids = data_mod.calibration_samples(models.tokenizer, data_cfg.calib, budget.samples + budget.kl_samples,
                                       budget.seqlen, data_cfg.seed)
    _page_in(*models.resident())
    # before the meter: its buffers are not the stage's memory
    reference_gflops = matmul_gflops(device, dtype=amp_dtype(device, comp_cfg.precision) or torch.float32)
    meter = laco.SegmentMeter(device)
    meter.next()
    t0 = time.perf_counter()
    if comp_cfg.method == "laco":
        fp = _resume_key(model_cfg, data_cfg, comp_cfg, budget, sparse_dir)
        guard = ModelGuard(restore_layers_from(sparse_dir))
        records, final_kl = laco.compensate(models.dense, models.sparse, ids, run_cfg, targets, device=device, seed=data_cfg.seed,
                                  checkpoint_dir=ckpt, fingerprint=fp, resume=resume, meter=meter,
                                  layer_loader=models.sparse_lazy, dense_loader=models.dense_lazy,
                                  kl_samples=budget.kl_samples, guard=guard, importance=importance)
        model, summary, model_guard = models.sparse, None, guard.record
    else:
        if resume:
            log.warning("the LoRA baseline trains the whole model at once and has no per-layer checkpoints to resume "
                        "from; it starts over")
        model, summary = lora.compensate(models.sparse, ids[: budget.samples], comp_cfg, targets, device=device, seed=data_cfg.seed)
        records, final_kl, model_guard = [], None, None
    meter.close()
    wall = time.perf_counter() - t0
    after = streamed.sparsity(model, models.sparse_lazy, targets, numel)
    model.config.laco_deploy = config_summary(info, comp_cfg, budget, after["sparsity"])
    doc = sparsity_document(sparse_dir / SPARSITY_FILE, before, after, comp_cfg)
    if distributed.is_main():  # every rank holds the same weights; rank 0 writes them
        _save(models, out_dir, doc, imatrix_file)
    distributed.barrier()  # the other ranks' scratch files live in the checkpoint folder
    if distributed.is_main():
        shutil.rmtree(ckpt, ignore_errors=True)
    log.info("compensated model written to %s (sparsity %.4f -> %.4f)", out_dir, before["sparsity"], after["sparsity"])
    return result_record(out_dir, info, comp_cfg, budget, before, after, records, summary, meter, wall, device,
                         reference_gflops, data={"calib": data_cfg.calib, "seed": data_cfg.seed,
                                                 "sample_format": data_mod.SAMPLE_FORMAT},
                         final_kl=final_kl, steps_note=f"training steps: {step_plan.reason}", model_guard=model_guard)
