"""Forward-only walks of several models side by side over the same token windows.

Fidelity compares the dense model with its candidates layer by layer. Each model is a
`ModelStream`: its skeleton (engine.lazy.LazyModel, layers on disk) or a resident model, and one
activation cache of the windows ([windows, seq, hidden]) that its layers update in place.
`walk_side_by_side` advances every stream by one decoder layer, layer i of all models before layer
i + 1, loading each layer just before it runs and releasing it right after; so one decoder layer
is in memory at a time, whatever the number or size of the models, and the per-layer outputs of
all models are side by side after each depth (the per-layer error curves).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from laco_deploy import families
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import LayerInputs, capture_layer_inputs
from laco_deploy.engine.lazy import LazyModel
from laco_deploy.engine.walk import call_layer
from laco_deploy.models import decoder_layers
from laco_deploy.progress import progress_bar

EMBED = ("model.embed_tokens",)
HEAD = ("model.norm", "lm_head")


@dataclass
class ModelStream:
    """One model walked forward over the evaluation windows."""

    model: Any  # transformers causal LM: a LazyModel skeleton (on `meta`) or a resident model
    inputs: LayerInputs  # layer-0 hidden states (`hidden`) and each layer's call arguments, on CPU
    lazy: LazyModel | None = None  # None: every weight is resident

    @property
    def hidden(self) -> ActivationCache:
        """[windows, seq, hidden]: layer-0 inputs, then each layer's outputs, in place."""
        return self.inputs.hidden

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))


def open_stream(path: Path, input_ids: torch.Tensor, device: torch.device, *,
                load_resident: Callable[[Path], Any] | None = None, offload: str = "cpu",
                workdir: Path | None = None) -> ModelStream:
    """Embed the windows input_ids [windows, seq] with the model in `path`.

    Safetensors checkpoints are opened lazily: only the embedding matrix is read, and dropped again
    once the windows are embedded. Other checkpoints (pickled weights) are loaded whole through
    `load_resident(path)`, the one case where a full model sits in memory.
    """
    path = Path(path)
    if any(path.glob("*.safetensors")) or load_resident is None:
        lazy = LazyModel.open(path, rest=False)
        lazy.load_rest(EMBED)
        try:
            inputs = capture_layer_inputs(lazy.model, input_ids, device, offload=offload, workdir=workdir)
        finally:
            lazy.release_rest(EMBED)
        return ModelStream(lazy.model, inputs, lazy)
    model = load_resident(path)
    inputs = capture_layer_inputs(model, input_ids, device, offload=offload, workdir=workdir)
    return ModelStream(model, inputs, None)


@torch.no_grad()
def _advance(stream: ModelStream, i: int, kwargs: dict[str, Any], device: torch.device, batch_size: int) -> None:
    """Run decoder layer i of one stream over its whole cache, writing the outputs over the inputs
    (windows are independent, so batch by batch in place is exact)."""
    layer = decoder_layers(stream.model)[i]
    if stream.lazy is not None:
        stream.lazy.load(i, layer)
    layer.to(device)
    cache = stream.hidden
    for start in range(0, len(cache), batch_size):
        stop = min(start + batch_size, len(cache))
        cache.store(start, call_layer(layer, cache.batch(start, stop, device), kwargs))
    layer.to("cpu")
    if stream.lazy is not None:
        stream.lazy.release(i, layer)


def walk_side_by_side(streams: dict[str, ModelStream], *, device: torch.device, batch_size: int = 8,
                      on_layer: Callable[[int, dict[str, ModelStream]], None] | None = None, desc: str | None = "") -> None:
    """Advance every stream through all its decoder layers, depth by depth; after depth i call
    `on_layer(i, streams)` (streams with fewer layers keep their last outputs). desc None: no bar."""
    kwargs = {label: s.inputs.kwargs_per_layer(s.num_layers, device) for label, s in streams.items()}
    depth = max(s.num_layers for s in streams.values())
    depths = range(depth) if desc is None else progress_bar(range(depth), desc=desc or "layers", unit="layer")
    for i in depths:
        for label, stream in streams.items():
            if i < stream.num_layers:
                _advance(stream, i, kwargs[label][i], device, batch_size)
        if on_layer is not None:
            on_layer(i, streams)


class Head:
    """Final norm + LM head of one stream: last hidden states -> logits.

    Lazy streams read the two modules from their files (with tied embeddings, the embedding
    matrix); `close()` returns them to `meta`.
    """

    def __init__(self, stream: ModelStream, device: torch.device):
        self.stream, self.device = stream, device
        if stream.lazy is not None:
            stream.lazy.load_rest(HEAD)
        self.norm, self.lm_head = stream.model.model.norm.to(device), stream.model.lm_head.to(device)
        self.softcap = families.logit_softcap(stream.model.config)  # Gemma 2: cap * tanh(logits / cap)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [seq, hidden] -> logits [seq, vocab] float32 on CPU."""
        logits = self.lm_head(self.norm(hidden.to(self.device)))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float().cpu()

    def same_weights(self, other: Head) -> bool:
        """Whether both heads hold identical tensors (then one can serve both models)."""
        mine = {**self.norm.state_dict(prefix="norm."), **self.lm_head.state_dict(prefix="head.")}
        theirs = {**other.norm.state_dict(prefix="norm."), **other.lm_head.state_dict(prefix="head.")}
        return self.softcap == other.softcap and mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine)

    def close(self) -> None:
        if self.stream.lazy is not None:
            self.stream.lazy.release_rest(HEAD)
        else:
            self.norm.to("cpu")
            self.lm_head.to("cpu")


def model_logits(path: Path, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Next-token logits of the safetensors model in `path` for one sequence, through the layer
    engine (one decoder layer in memory; no progress bar: a short check). input_ids [seq] ->
    [seq, vocab] float32 on CPU."""
    stream = open_stream(path, input_ids.view(1, -1), device)
    walk_side_by_side({"model": stream}, device=device, batch_size=1, desc=None)
    head = Head(stream, device)
    try:
        return head(stream.hidden.data[0])
    finally:
        head.close()
