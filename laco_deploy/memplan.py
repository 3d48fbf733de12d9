"""Memory planning: what a model's weights take in fp32, and how much RAM is available.

Sizes come from the model's config alone (a skeleton on `meta`, no weights read), per decoder
layer at its own width (structured-pruned models), so they hold for any size of model.
"""

from __future__ import annotations

from pathlib import Path

from laco_deploy.memory import proc_bytes
from laco_deploy.models import decoder_layers

FP32 = 4  # bytes per weight: every stage computes in float32


def skeleton_of(path: Path):
    """The causal LM of the HF directory `path` on `meta` (reads config.json only)."""
    from transformers import AutoConfig

    from laco_deploy.engine.lazy import skeleton

    return skeleton(AutoConfig.from_pretrained(Path(path)))


def weight_bytes(model) -> dict[str, int]:
    """fp32 bytes of a (skeleton) model: all decoder layers, the largest one, embeddings, head, total."""
    layers = [sum(p.numel() for p in layer.parameters()) * FP32 for layer in decoder_layers(model)]
    embed = model.model.embed_tokens.weight.numel() * FP32
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head = 0 if tied else model.lm_head.weight.numel() * FP32
    total = sum(p.numel() for p in model.parameters()) * FP32  # tied weights counted once
    return {"layers": sum(layers), "layer_max": max(layers, default=0), "embed": embed, "head": head,
            "total": total, "num_layers": len(layers), "hidden": int(model.config.hidden_size)}


def model_bytes(path: Path) -> dict[str, int]:
    """weight_bytes of the model in the HF directory `path`."""
    return weight_bytes(skeleton_of(path))


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none, e.g. macOS)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")
