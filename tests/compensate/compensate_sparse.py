"""Pruned tiny models made inline (magnitude zeros, 2:4, structured shapes) for compensation tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from laco_deploy.config import PRUNABLE_LINEARS
from laco_deploy.models import load_model, save_model
from laco_deploy.structured import write_widths


def magnitude_prune_(weight: torch.Tensor, sparsity: float = 0.5, nm: tuple[int, int] | None = None) -> None:
    """Zero the smallest-magnitude weights per output row (or per group of M inputs for N:M)."""
    with torch.no_grad():
        if nm is not None:
            n, m = nm
            groups = weight.abs().view(weight.shape[0], -1, m)
            drop = groups.argsort(dim=-1)[..., : m - n]
            mask = torch.ones_like(groups, dtype=torch.bool).scatter_(-1, drop, False)
            weight.mul_(mask.view_as(weight))
        else:
            k = int(weight.shape[1] * sparsity)
            drop = weight.abs().argsort(dim=1)[:, :k]
            weight.scatter_(1, drop, 0.0)


def _write(loaded, out: Path, info: dict) -> Path:
    loaded.model.config.laco_deploy = {"stage": "prune", "method": "magnitude", "targets": list(PRUNABLE_LINEARS), **info}
    save_model(loaded.model, loaded.tokenizer, out,
               extra_files={"sparsity.json": json.dumps({"stage": "prune", "label": info["pattern"]})})
    return out


def make_unstructured(dense_dir: Path, out: Path, sparsity: float = 0.5, nm=None) -> Path:
    loaded = load_model(str(dense_dir))
    for layer in loaded.model.model.layers:
        for name, mod in layer.named_modules():
            if name.rsplit(".", 1)[-1] in PRUNABLE_LINEARS:
                magnitude_prune_(mod.weight, sparsity, nm)
    pattern = f"{nm[0]}:{nm[1]}" if nm else "unstructured"
    return _write(loaded, out, {"pattern": pattern, "target_sparsity": 0.5, "sparsity": 0.5})


def make_structured(dense_dir: Path, out: Path, keep_ffn: int) -> Path:
    """Remove FFN channels beyond `keep_ffn` in every layer (smaller gate/up/down shapes)."""
    loaded = load_model(str(dense_dir))
    cfg = loaded.model.config
    for layer in loaded.model.model.layers:
        mlp = layer.mlp
        for lin_name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
            old = getattr(mlp, lin_name)
            w = old.weight.detach().narrow(dim, 0, keep_ffn).clone()
            new = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            new.weight = torch.nn.Parameter(w)
            setattr(mlp, lin_name, new)
    write_widths(cfg, [{"intermediate_size": keep_ffn, "num_attention_heads": cfg.num_attention_heads,
                        "num_key_value_heads": cfg.num_key_value_heads} for _ in range(cfg.num_hidden_layers)])
    return _write(loaded, out, {"pattern": "structured", "target_sparsity": 0.25, "sparsity": 0.25})
