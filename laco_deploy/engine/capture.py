"""Capture what the first decoder layer receives: its hidden states and its keyword arguments.

A forward pre-hook on layer 0 records the call and aborts the forward pass, so nothing past the
embeddings runs. The keyword arguments (position embeddings, attention mask, ...) are identical
for every sample of the same length, so they are kept once and broadcast over batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from laco_deploy.engine.cache import ActivationCache
from laco_deploy.models import decoder_layers


class _Captured(Exception):
    pass


@dataclass
class LayerInputs:
    hidden: ActivationCache  # [samples, seq, hidden]
    kwargs: dict[str, Any]  # passed to every decoder layer call (tensors on CPU)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def kwargs_on(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return _to(kwargs, device)


@torch.no_grad()
def capture_layer_inputs(model, input_ids: torch.Tensor, device: torch.device, offload: str = "cpu", workdir=None) -> LayerInputs:
    """Run the embeddings for every sample and record layer 0's inputs. input_ids [n, seq]."""
    n, seq = input_ids.shape
    cache = ActivationCache((n, seq, model.config.hidden_size), offload, workdir)
    layers = decoder_layers(model)
    kept: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        raise _Captured((hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    # only the embedding and rotary modules need the device; the layers are never run here
    inner = model.model
    moved = [m for m in (inner.embed_tokens, getattr(inner, "rotary_emb", None)) if m is not None]
    for m in moved:
        m.to(device)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i in range(n):
            try:
                inner(input_ids[i : i + 1].to(device), use_cache=False)
            except _Captured as c:
                hidden, kw = c.args[0]
                cache.store(i, hidden)
                if not kept:
                    kept = _to({k: v for k, v in kw.items() if k not in ("past_key_values", "past_key_value", "use_cache")}, torch.device("cpu"))
    finally:
        handle.remove()
        for m in moved:
            m.to("cpu")
    return LayerInputs(cache, kept)
