"""Capture what the first decoder layer receives: its hidden states and its keyword arguments.

A forward pre-hook on layer 0 records the call and aborts the forward pass, so nothing past the
embeddings runs. The keyword arguments (position embeddings, attention mask, ...) are identical
for every sample of the same length, so they are kept once and broadcast over batches.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from laco_deploy.engine.cache import ActivationCache
from laco_deploy.models import decoder_layers


_DROPPED = ("past_key_values", "past_key_value", "use_cache", "hidden_states")  # per call, not per layer


class _Captured(Exception):
    pass


@dataclass
class LayerInputs:
    hidden: ActivationCache  # [samples, seq, hidden]
    kwargs: dict[str, Any]  # layer 0's call arguments (tensors on CPU); every layer's unless layer_kwargs
    # per layer, where layers of different attention types get different arguments (Gemma: sliding-window
    # vs full masks, and local vs global RoPE tables); layers of one type share one dict
    layer_kwargs: list[dict[str, Any]] | None = None

    def kwargs_at(self, i: int) -> dict[str, Any]:
        return self.layer_kwargs[i] if self.layer_kwargs is not None else self.kwargs

    def kwargs_per_layer(self, n_layers: int, device: torch.device) -> list[dict[str, Any]]:
        """Each layer's call arguments on `device`; a dict shared by several layers is moved once."""
        moved: dict[int, dict[str, Any]] = {}
        out = []
        for i in range(n_layers):
            kw = self.kwargs_at(i)
            if id(kw) not in moved:
                moved[id(kw)] = kwargs_on(kw, device)
            out.append(moved[id(kw)])
        return out


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


def _embed_each(model, input_ids: torch.Tensor, device: torch.device):
    """Yield (i, layer 0's hidden states [1, seq, hidden], its call arguments) for each row of
    input_ids [n, seq], running only what precedes layer 0 (a pre-hook stops the pass there).
    The embedding and rotary modules run on `device` and go back where they were afterwards."""
    layers = decoder_layers(model)

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        raise _Captured((hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    with _embedding_on(model, device):
        handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i in range(input_ids.shape[0]):
                try:
                    with torch.no_grad():
                        model.model(input_ids[i : i + 1].to(device), use_cache=False)
                except _Captured as c:
                    yield i, *c.args[0]
        finally:
            handle.remove()


@contextlib.contextmanager
def _embedding_on(model, device: torch.device):
    """Within the block the modules that run before layer 0 (embedding, rotary) are on `device`;
    after it they are back where they were (a streamed model keeps them on CPU between uses)."""
    inner = model.model
    homes = [(m, _home(m)) for m in (inner.embed_tokens, getattr(inner, "rotary_emb", None)) if m is not None]
    for m, _ in homes:
        m.to(device)
    try:
        yield
    finally:
        for m, home in homes:
            if home is not None:
                m.to(home)


def _home(module: torch.nn.Module) -> torch.device | None:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first.device if first is not None else None


@torch.no_grad()
def capture_layer_inputs(model, input_ids: torch.Tensor, device: torch.device, offload: str = "cpu", workdir=None) -> LayerInputs:
    """Run the embeddings for every sample and record layer 0's inputs. input_ids [n, seq]."""
    n, seq = input_ids.shape
    cache = ActivationCache((n, seq, model.config.hidden_size), offload, workdir)
    kept: dict[str, Any] = {}
    for i, hidden, kw in _embed_each(model, input_ids, device):
        cache.store(i, hidden)
        if not kept:
            kept = _to({k: v for k, v in kw.items() if k not in _DROPPED}, torch.device("cpu"))
    return LayerInputs(cache, kept, _kwargs_by_layer_type(model, input_ids[:1].to(device), kept))


class EmbeddedOnDemand:
    """Layer 0's inputs of input_ids [n, seq], made by the resident model's own embedding each time a
    batch asks (`rows`, as ActivationCache.rows) instead of held for all samples: the final KL pass
    then keeps no [n, seq, hidden] cache (74 MiB for the default model's pass). The rows are exactly
    what capture_layer_inputs would have stored."""

    def __init__(self, model, input_ids: torch.Tensor):
        self.model, self.input_ids = model, input_ids
        self.shape = (*input_ids.shape, model.config.hidden_size)

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty((len(idx), *self.shape[1:]), dtype=torch.float32, device=device)
        for j, hidden, _ in _embed_each(self.model, self.input_ids[idx], device):
            out[j] = hidden[0].to(torch.float32)
        return out


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer i during one forward pass: keeps its call arguments, passes the
    hidden states through unchanged, and stops the pass after the last layer."""

    def __init__(self, index: int, sink: dict[int, dict[str, Any]], last: int):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last

    def forward(self, hidden, *args, **kwargs):
        self.sink[self.index] = kwargs
        if self.index == self.last:
            raise _Captured(None)
        return hidden


@torch.no_grad()
def _kwargs_by_layer_type(model, input_ids: torch.Tensor, first: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per-layer call arguments when the config gives layers different attention types (None when all
    layers are called alike). One forward pass with recording stand-ins for the layers (no layer runs);
    layers of one type share one dict, layer 0's type keeps `first`."""
    kinds = list(getattr(model.config, "layer_types", None) or [])
    layers = decoder_layers(model)
    if len(set(kinds)) <= 1 or len(kinds) != len(layers):
        return None
    inner = model.model
    sink: dict[int, dict[str, Any]] = {}
    inner.layers = torch.nn.ModuleList(_Recorder(i, sink, len(layers) - 1) for i in range(len(layers)))
    try:
        with _embedding_on(model, input_ids.device):
            inner(input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        inner.layers = layers
    by_kind = {kinds[0]: first}
    for i, kind in enumerate(kinds):
        if kind not in by_kind:
            by_kind[kind] = _to({k: v for k, v in sink[i].items() if k not in _DROPPED}, torch.device("cpu"))
    return [by_kind[kind] for kind in kinds]
