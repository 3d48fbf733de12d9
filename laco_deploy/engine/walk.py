"""Walk the decoder layers in order, running a stage's step on each and propagating activations.

Two paths can run side by side: the dense path (original layers of `dense_model`) and the
sparse path (layers of `model`, which the step prunes or compensates in place). With
`Paths.BOTH` the step sees the dense targets of its layer (dense layer applied to dense inputs)
and the sparse inputs (outputs of the already processed sparse layers), which is what LaCo needs.

After each layer a checkpoint (layer weights as safetensors + the step's record as JSON) is
written; `resume=True` reloads finished layers, re-propagates activations through them (forward
only, deterministic) and continues, so the result equals an uninterrupted run.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import LayerInputs, kwargs_on
from laco_deploy.errors import ConfigError
from laco_deploy.fsutil import atomic_path, write_json
from laco_deploy.models import decoder_layers
from laco_deploy.progress import interactive, progress_bar, set_status

log = logging.getLogger(__name__)


class LayerLoader(Protocol):
    """Brings decoder layer i into memory (`load`) and out again (`release`); see engine.lazy."""

    def load(self, i: int, layer: torch.nn.Module) -> None: ...

    def release(self, i: int, layer: torch.nn.Module) -> None: ...


class Paths(enum.Enum):
    SPARSE = "sparse"  # only the model being changed (pruning)
    BOTH = "both"  # dense twin alongside (compensation, layer-wise fidelity)


@dataclass
class LayerContext:
    """Everything a step needs for one layer. Tensors in caches are [samples, seq, hidden] on CPU."""

    index: int
    num_layers: int
    layer: torch.nn.Module  # the sparse-path layer, on `device`; the step changes it in place
    inputs: ActivationCache  # sparse-path inputs of this layer
    kwargs: dict[str, Any]  # layer call arguments (position embeddings, mask), on `device`
    device: torch.device
    batch_size: int
    dense_layer: torch.nn.Module | None = None  # frozen dense twin on `device` (Paths.BOTH)
    dense_inputs: ActivationCache | None = None
    dense_targets: ActivationCache | None = None  # dense twin's outputs for dense_inputs
    progress: Callable[[str], None] = field(default=lambda _s: None)  # sets the bar's postfix

    def forward(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Call a decoder layer on a batch. hidden [b, seq, hidden] -> [b, seq, hidden]."""
        return call_layer(layer, hidden, self.kwargs)

    @torch.no_grad()
    def run(self, layer: torch.nn.Module, src: ActivationCache, dst: ActivationCache) -> None:
        for start in range(0, len(src), self.batch_size):
            stop = min(start + self.batch_size, len(src))
            dst.store(start, self.forward(layer, src.batch(start, stop, self.device)))


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoder layer on a batch. hidden [b, seq, hidden] -> [b, seq, hidden]."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _load_layer_state(layer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpointed layer, rebuilding any Linear whose shape changed (structured pruning)."""
    for name, tensor in state.items():
        owner_name, _, pname = name.rpartition(".")
        owner = layer.get_submodule(owner_name) if owner_name else layer
        current = getattr(owner, pname)
        if current is None or current.shape != tensor.shape:
            if isinstance(owner, torch.nn.Linear) and pname == "weight":
                owner.in_features, owner.out_features = tensor.shape[1], tensor.shape[0]
            setattr(owner, pname, torch.nn.Parameter(tensor.clone(), requires_grad=False))
        else:
            with torch.no_grad():
                current.copy_(tensor)


def _checkpoint_paths(ckpt: Path, i: int) -> tuple[Path, Path]:
    return ckpt / f"layer_{i:03d}.safetensors", ckpt / f"layer_{i:03d}.json"


def _prepare_checkpoints(ckpt: Path | None, fingerprint: dict, resume: bool) -> None:
    if ckpt is None:
        return
    meta = ckpt / "meta.json"
    fingerprint = json.loads(json.dumps(fingerprint, default=str))  # tuples -> lists, as read back
    if resume and meta.is_file():
        old = json.loads(meta.read_text())
        if old != fingerprint:
            raise ConfigError(
                f"--resume: the checkpoints in {ckpt} were made with other settings; "
                "rerun with the same settings, or without --resume to start over"
            )
        return
    if resume:
        log.warning("--resume: no checkpoints in %s; starting from the first layer", ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    for old_file in list(ckpt.glob("layer_*")):
        old_file.unlink()
    write_json(meta, fingerprint)


def walk_layers(
    model,
    inputs: LayerInputs,
    step: Callable[[LayerContext], dict | None] | None,
    *,
    paths: Paths,
    device: torch.device,
    dense_model=None,
    dense_inputs: LayerInputs | None = None,
    batch_size: int = 8,
    checkpoint_dir: Path | None = None,
    fingerprint: dict | None = None,
    resume: bool = False,
    desc: str = "",
    on_layer_done: Callable[[int, dict, ActivationCache, ActivationCache | None], None] | None = None,
    layer_loader: LayerLoader | None = None,
    dense_loader: LayerLoader | None = None,
) -> list[dict]:
    """Process every decoder layer of `model` in order; return the step's record per layer.

    `on_layer_done(i, record, sparse_out, dense_out)` sees each layer's outputs (fidelity curves).
    `layer_loader` / `dense_loader` (e.g. engine.lazy.LazyModel) bring layer i in from disk before
    it runs and put it back after, for models that do not fit in RAM.
    """
    if paths is Paths.BOTH and dense_model is None:
        raise ValueError("Paths.BOTH needs dense_model")
    layers = decoder_layers(model)
    dense_layers = decoder_layers(dense_model) if dense_model is not None else None
    _prepare_checkpoints(checkpoint_dir, fingerprint or {}, resume)
    kwargs = kwargs_on(inputs.kwargs, device)
    sparse_in = inputs.hidden
    dense_in = None
    if paths is Paths.BOTH:
        if dense_inputs is None:
            dense_in = sparse_in.clone_empty()
            dense_in.copy_from(sparse_in)  # both paths start from the same embeddings
        else:
            dense_in = dense_inputs.hidden
    sparse_out, dense_out = sparse_in.clone_empty(), (dense_in.clone_empty() if dense_in is not None else None)
    records: list[dict] = []
    bar = progress_bar(range(len(layers)), desc=desc or "layers", unit="layer")
    for i in bar:
        bar.set_description(f"layer {i + 1}/{len(layers)} {desc}".strip(), refresh=interactive())
        if layer_loader is not None:
            layer_loader.load(i, layers[i])
        if dense_loader is not None and paths is Paths.BOTH:
            dense_loader.load(i, dense_layers[i])
        layer = layers[i].to(device)
        dense_layer = dense_layers[i].to(device) if paths is Paths.BOTH else None
        ctx = LayerContext(i, len(layers), layer, sparse_in, kwargs, device, batch_size, dense_layer, dense_in,
                           dense_out, progress=lambda s: set_status(bar, s))
        if dense_layer is not None:
            ctx.run(dense_layer, dense_in, dense_out)
        weights_file, record_file = _checkpoint_paths(checkpoint_dir, i) if checkpoint_dir else (None, None)
        if resume and record_file is not None and record_file.is_file() and weights_file.is_file():
            _load_layer_state(layer, load_file(str(weights_file), device=str(device)))
            record = json.loads(record_file.read_text())
            log.debug("layer %d restored from %s", i, weights_file)
        else:
            record = (step(ctx) if step is not None else None) or {}
            if weights_file is not None:
                with atomic_path(weights_file) as tmp:
                    save_file({k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}, str(tmp))
                write_json(record_file, record)
        records.append(record)
        ctx.run(layer, sparse_in, sparse_out)
        if on_layer_done is not None:
            on_layer_done(i, record, sparse_out, dense_out)
        layers[i].to("cpu")
        if dense_layer is not None:
            dense_layers[i].to("cpu")
        if layer_loader is not None:
            layer_loader.release(i, layers[i])
        if dense_loader is not None and dense_layer is not None:
            dense_loader.release(i, dense_layers[i])
        sparse_in, sparse_out = sparse_out, sparse_in
        if dense_in is not None:
            dense_in, dense_out = dense_out, dense_in
    bar.close()
    return records
