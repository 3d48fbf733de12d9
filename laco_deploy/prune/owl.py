"""OWL: outlier-weighted layerwise sparsity (Yin et al. 2024), behind `--owl`.

Layers holding more outliers keep more weights. Per layer l, the layerwise outlier distribution
D_l is the share of Wanda scores |W_ij| * ||X_j||_2 (over all its target linears) above M times
their mean. The ratios are then

    s_l = S - (a_l - mean(a)),   a = 2 * lambda * (D - min D) / (max D - min D)

so they average to the target S and stay within S +- lambda (up to rounding). The outlier pass
walks the dense layers (no pruning) with the same calibration data, as the paper's code does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from laco_deploy import distributed
from laco_deploy.engine import Lane, LayerInputs, WalkOptions, walk_layers
from laco_deploy.fsutil import write_json
from laco_deploy.models import linear_modules
from laco_deploy.prune.scoring import wanda_scores
from laco_deploy.prune.stats import collect_input_stats

log = logging.getLogger(__name__)


def outlier_share(scores: list[torch.Tensor], m: float) -> float:
    """Share of all entries of `scores` (concatenated) above m * their mean."""
    flat = torch.cat([s.flatten() for s in scores])
    return float((flat > m * flat.mean()).float().mean())


def owl_ratios(outliers: list[float], target: float, lam: float) -> list[float]:
    """Per-layer sparsity from per-layer outlier shares D (see the module docstring)."""
    d = torch.tensor(outliers, dtype=torch.float64)
    span = float(d.max() - d.min()) if len(outliers) else 0.0
    if span <= 0:
        return [target] * len(outliers)
    a = (d - d.min()) / span * (2 * lam)
    ratios = target - (a - a.mean())
    return [float(r) for r in ratios.clamp(0.0, 0.99)]


def _outlier_step(targets: tuple[str, ...], m: float):
    def step(ctx) -> dict:
        modules = linear_modules(ctx.layer, targets)
        ctx.progress("outliers")
        stats = collect_input_stats(ctx, modules, hessian=False)
        scores = [wanda_scores(lin.weight.data, stats[name].sq_sum) for name, lin in modules.items()]
        return {"outliers": outlier_share(scores, m)}

    return step


def layer_ratios(model, inputs: LayerInputs, sparsity: float, targets: tuple[str, ...], owl: tuple[float, float] | None,
                 *, device: torch.device, batch_size: int, cache_file: Path | None = None, resume: bool = False,
                 key: str = "", loader=None) -> list[float]:
    """Sparsity ratio per decoder layer: uniform `sparsity` (prune.sparsity), or OWL's when `owl` is
    (prune.owl_lambda, prune.owl_m), which needs one extra dense pass over the `targets` linears.

    With `resume`, ratios computed by the interrupted run are reused from `cache_file` when it holds
    `key` (the walk's reuse key: settings and the model's and texts' content hashes). `loader`:
    the engine's layer loader when layers live on disk.
    """
    n_layers = model.config.num_hidden_layers
    if owl is None:
        return [sparsity] * n_layers
    if resume and cache_file is not None and distributed.agree(_cached(cache_file, key, n_layers) is not None):
        return _cached(cache_file, key, n_layers)
    probe = inputs.hidden.clone_empty()
    probe.copy_from(inputs.hidden)  # the walk overwrites its buffers; keep the embeddings for pruning
    records = walk_layers(Lane(model, LayerInputs(probe, inputs.kwargs, inputs.layer_kwargs), loader),
                          _outlier_step(targets, owl[1]), WalkOptions(device, batch_size, "owl outliers"))
    ratios = owl_ratios([r["outliers"] for r in records], sparsity, owl[0])
    log.info("OWL layer ratios: %s", [round(r, 4) for r in ratios])
    if cache_file is not None and distributed.is_main():
        write_json(cache_file, {"key": key, "outliers": [r["outliers"] for r in records], "ratios": ratios})
    return ratios


def _cached(cache_file: Path, key: str, n_layers: int) -> list[float] | None:
    """The ratios an interrupted run with the same OWL settings computed, if any."""
    if not cache_file.is_file():
        return None
    cached = json.loads(cache_file.read_text())
    if cached.get("key") == key and len(cached.get("ratios", [])) == n_layers:
        return [float(r) for r in cached["ratios"]]
    return None
