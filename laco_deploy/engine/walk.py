"""Walk the decoder layers in order, running a stage's step on each and propagating activations.

Two paths can run side by side: the dense path (original layers of `dense_model`) and the
sparse path (layers of `model`, which the step prunes or compensates in place). With
`Paths.BOTH` the step sees the dense targets of its layer (dense layer applied to dense inputs)
and the sparse inputs (outputs of the already processed sparse layers), which is what LaCo needs.

With a LayerCheckpoints (engine.checkpoint) each finished layer is saved; a resumed walk reloads
finished layers, re-propagates activations through them (forward only, deterministic) and
continues, so the result equals an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import LayerInputs
from laco_deploy.engine.checkpoint import LayerCheckpoints
from laco_deploy.models import decoder_layers
from laco_deploy.progress import interactive, progress_bar, set_status


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
    autocast: torch.dtype | None = None  # compute dtype of run() (None: the weights' own)

    def forward(self, layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Call a decoder layer on a batch. hidden [b, seq, hidden] -> [b, seq, hidden]."""
        return call_layer(layer, hidden, self.kwargs)

    def run(self, layer: torch.nn.Module, src: ActivationCache, dst: ActivationCache) -> None:
        run_layer(layer, src, dst, self.kwargs, self.device, self.batch_size, self.autocast)


@torch.no_grad()
def run_layer(layer: torch.nn.Module, src: ActivationCache, dst: ActivationCache, kwargs: dict[str, Any],
              device: torch.device, batch_size: int, autocast: torch.dtype | None = None) -> None:
    """One decoder layer over a whole cache, batch by batch: src [n, seq, hidden] -> dst (may be src:
    rows are independent, so the outputs overwrite the inputs exactly)."""
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with amp:
        for start in range(0, len(src), batch_size):
            stop = min(start + batch_size, len(src))
            dst.store(start, call_layer(layer, src.batch(start, stop, device), kwargs))


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoder layer on a batch. hidden [b, seq, hidden] -> [b, seq, hidden]."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class Lane:
    """One model walked layer by layer: the model, its layer-0 inputs, and a loader when its layers
    live on disk (engine.lazy). A dense lane without inputs starts from the sparse lane's embeddings."""

    model: Any
    inputs: LayerInputs | None = None
    loader: LayerLoader | None = None


@dataclass(frozen=True)
class WalkOptions:
    """How the walk runs: the device layers run on, the batch size of a layer call, the bar's label."""

    device: torch.device
    batch_size: int = 8
    desc: str | None = ""  # None: no progress bar (a short check)
    # compute dtype of the layer calls that propagate activations (LaCo: its training precision;
    # None: fp32, as fidelity and pruning statistics need); caches stay fp32 either way
    autocast: torch.dtype | None = None


LayerDone = Callable[[int, dict, ActivationCache, "ActivationCache | None"], None]


@dataclass
class _Caches:
    """The walk's activation caches. Each layer's outputs overwrite its inputs batch by batch (rows
    are independent): one cache per path, not two; the dense path's inputs only where the step reads
    them (`dense_in_step`), else its outputs overwrite them too (`dense_in_place`)."""

    sparse: ActivationCache  # sparse-path inputs, then outputs, in place
    dense_in: ActivationCache | None = None
    dense_out: ActivationCache | None = None
    dense_in_place: bool = False

    @classmethod
    def start(cls, sparse: Lane, dense: Lane | None, dense_in_step: bool) -> _Caches:
        if dense is None:
            return cls(sparse.inputs.hidden)
        if dense.inputs is None:
            dense_in = sparse.inputs.hidden.clone_empty()
            dense_in.copy_from(sparse.inputs.hidden)  # both paths start from the same embeddings
        else:
            dense_in = dense.inputs.hidden
        in_place = not dense_in_step
        return cls(sparse.inputs.hidden, dense_in, dense_in if in_place else dense_in.clone_empty(), in_place)

    def next_layer(self) -> None:
        """The dense outputs become the next layer's inputs (in place: they already are)."""
        if self.dense_in is not None and not self.dense_in_place:
            self.dense_in, self.dense_out = self.dense_out, self.dense_in


def walk_layers(
    sparse: Lane,
    step: Callable[[LayerContext], dict | None] | None,
    opts: WalkOptions,
    *,
    paths: Paths = Paths.SPARSE,
    dense: Lane | None = None,
    checkpoints: LayerCheckpoints | None = None,
    on_layer_done: LayerDone | None = None,
    dense_in_step: bool = True,
) -> list[dict]:
    """Process every decoder layer of `sparse.model` in order; return the step's record per layer.

    `on_layer_done(i, record, sparse_out, dense_out)` sees each layer's outputs (fidelity curves).
    With `checkpoints`, each finished layer is saved, and on resume restored instead of stepped.
    `dense_in_step=False`: the step reads the dense targets only, so a streamed dense twin is released
    as soon as they are computed (one layer less in memory while the step runs; ctx.dense_layer None)
    and they overwrite the dense inputs (ctx.dense_inputs None): one dense cache instead of two.
    """
    if paths is Paths.BOTH and dense is None:
        raise ValueError("Paths.BOTH needs a dense lane")
    if sparse.inputs is None:
        raise ValueError("the sparse lane needs its layer-0 inputs")
    dense = dense if paths is Paths.BOTH else None
    n = len(decoder_layers(sparse.model))
    if checkpoints is not None:
        checkpoints.prepare()
    kwargs = sparse.inputs.kwargs_per_layer(n, opts.device)
    caches = _Caches.start(sparse, dense, dense_in_step)
    early_release = not dense_in_step  # a streamed twin leaves as soon as its targets are made (_walk_one)
    records: list[dict] = []
    bar = progress_bar(range(n), desc=opts.desc or "layers", unit="layer")
    for i in bar:
        bar.set_description(f"layer {i + 1}/{n} {opts.desc}".strip(), refresh=interactive())
        record = _walk_one(i, sparse, dense, caches, kwargs[i], step, opts, checkpoints, early_release,
                           progress=lambda s: set_status(bar, s))
        records.append(record)
        if on_layer_done is not None:
            on_layer_done(i, record, caches.sparse, caches.dense_out)
        _release_layer(i, sparse)
        if dense is not None and not (early_release and dense.loader is not None):
            _release_layer(i, dense)
        caches.next_layer()
    bar.close()
    return records


def _walk_one(i: int, sparse: Lane, dense: Lane | None, caches: _Caches, kwargs: dict[str, Any], step, opts: WalkOptions,
              checkpoints: LayerCheckpoints | None, early_release: bool, progress: Callable[[str], None]) -> dict:
    """Layer i: the dense twin's outputs, the step (or its checkpoint), then the sparse outputs."""
    layer = _load(i, sparse).to(opts.device)
    dense_layer = _load(i, dense).to(opts.device) if dense is not None else None
    ctx = LayerContext(i, len(decoder_layers(sparse.model)), layer, caches.sparse, kwargs, opts.device, opts.batch_size,
                       dense_layer, None if caches.dense_in_place else caches.dense_in, caches.dense_out,
                       progress=progress, autocast=opts.autocast)
    if dense_layer is not None:
        ctx.run(dense_layer, caches.dense_in, caches.dense_out)
        if early_release and dense.loader is not None:  # the step reads the targets only: release the twin now
            _release_layer(i, dense)
            ctx.dense_layer = None
    record = checkpoints.restore(i, layer, opts.device) if checkpoints is not None else None
    if record is None:
        record = (step(ctx) if step is not None else None) or {}
        if checkpoints is not None:
            checkpoints.save(i, layer, record)
    ctx.run(layer, caches.sparse, caches.sparse)
    return record


def walk_side_by_side(lanes: dict[str, Lane], opts: WalkOptions,
                      on_layer: Callable[[int, dict[str, Lane]], None] | None = None) -> None:
    """The forward-only mode of the walk (fidelity): every lane advances through its decoder layers,
    depth by depth, its outputs over its inputs (`lane.inputs.hidden`); after depth i,
    `on_layer(i, lanes)` sees all of them side by side (lanes with fewer layers keep their last
    outputs). Each layer is loaded just before it runs and released right after, so one decoder
    layer is in memory at a time whatever the number of models."""
    depths = {label: len(decoder_layers(lane.model)) for label, lane in lanes.items()}
    kwargs = {label: lane.inputs.kwargs_per_layer(depths[label], opts.device) for label, lane in lanes.items()}
    depth = max(depths.values())
    steps = range(depth) if opts.desc is None else progress_bar(range(depth), desc=opts.desc or "layers", unit="layer")
    for i in steps:
        for label, lane in lanes.items():
            if i < depths[label]:
                layer = _load(i, lane).to(opts.device)
                run_layer(layer, lane.inputs.hidden, lane.inputs.hidden, kwargs[label][i], opts.device, opts.batch_size)
                _release_layer(i, lane)
        if on_layer is not None:
            on_layer(i, lanes)


def _load(i: int, lane: Lane) -> torch.nn.Module:
    layer = decoder_layers(lane.model)[i]
    if lane.loader is not None:
        lane.loader.load(i, layer)
    return layer


def _release_layer(i: int, lane: Lane) -> None:
    layer = decoder_layers(lane.model)[i]
    layer.to("cpu")
    if lane.loader is not None:
        lane.loader.release(i, layer)
