"""PyTorch models in fidelity, on the layer engine: the dense model and its candidates side by side.

Every model embeds the evaluation windows ([windows, seq, hidden], one activation cache each), then
the layer engine's forward-only walk (`engine.walk.walk_side_by_side`) advances all of them one decoder layer at a time, streaming the
layer's weights from safetensors; after each depth the candidates' outputs are compared with the
dense model's (the per-layer curves). At the end each model's final norm and LM head turn its last
hidden states into logits, one window at a time. In memory: the caches, one decoder layer, and the
heads (one head serves every model whose head is identical, as after pruning and LaCo).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from laco_deploy.engine.forward import Head, ModelStream, open_stream
from laco_deploy.engine.walk import WalkOptions, walk_side_by_side
from laco_deploy.fidelity.layerwise import LayerCurves
from laco_deploy.memory import trim_heap

log = logging.getLogger(__name__)
DENSE = "dense"
CURVE_BATCH = 8  # windows per chunk when summing the per-layer curves (bounds the float64 temporaries)


class TorchPass:
    """Logits of the dense model and each PyTorch candidate, per evaluation window, after one
    side-by-side walk; `curves[label]` holds a candidate's per-layer curves (None: not comparable)."""

    def __init__(self, streams: dict[str, ModelStream], curves: dict[str, LayerCurves | None], device: torch.device):
        self.streams, self.curves, self.device = streams, curves, device
        self.heads: dict[str, Head] = {}
        self._owned: list[Head] = []
        for label, stream in streams.items():
            self._add_head(label, stream)

    def _add_head(self, label: str, stream: ModelStream) -> None:
        head = Head(stream, self.device)
        dense = self.heads.get(DENSE)
        if dense is not None and head.same_weights(dense):
            head.close()
            head = dense
        else:
            self._owned.append(head)
        self.heads[label] = head

    def logits(self, label: str, window: int) -> torch.Tensor:
        """[seq, vocab] float32 on CPU: model `label`'s next-token logits for evaluation window `window`."""
        return self.heads[label](self.streams[label].hidden.data[window])

    def release(self, keep: tuple[str, ...] = (DENSE,)) -> None:
        """Drop every model but `keep` (caches and heads), e.g. before the runtime candidates load."""
        for label in [lab for lab in self.streams if lab not in keep]:
            head = self.heads.pop(label)
            if head not in self.heads.values():
                head.close()
                self._owned.remove(head)
            del self.streams[label]
        gc.collect()
        # the walk's freed caches and temporaries leave the heap, or the first runtime session loads on
        # top of them (832 MiB before onnxruntime opened its first candidate, 665 before the second)
        trim_heap()

    def close(self) -> None:
        self.release(keep=())


def run_torch_pass(dense_path: Path, candidates: dict[str, Path], windows: torch.Tensor, device: torch.device, *,
                   layerwise: bool, notes: list[str], load_resident: Callable[[Path], Any],
                   batch_size: int = 8) -> TorchPass:
    """Embed windows [n, seq] with every model, walk all layers side by side (curves on the way),
    load the heads. `load_resident(path)` loads a model whose weights are not safetensors."""
    paths = {DENSE: Path(dense_path), **{label: Path(p) for label, p in candidates.items()}}
    streams = {label: open_stream(p, windows, device, load_resident=load_resident) for label, p in paths.items()}
    curves = {label: _curves_for(label, streams[label], streams[DENSE], notes) if layerwise else None
              for label in candidates}

    def compare(i: int, _lanes) -> None:
        dense = streams[DENSE].hidden.data
        for label, c in curves.items():
            if c is not None:
                cand = streams[label].hidden.data
                for s in range(0, dense.shape[0], CURVE_BATCH):
                    c.add_layer(i, cand[s : s + CURVE_BATCH].to(device), dense[s : s + CURVE_BATCH].to(device))

    walk_side_by_side({label: s.lane for label, s in streams.items()}, WalkOptions(device, batch_size, "fidelity"),
                      on_layer=compare)
    return TorchPass(streams, curves, device)


def _curves_for(label: str, stream: ModelStream, dense: ModelStream, notes: list[str]) -> LayerCurves | None:
    """Per-layer curves for candidates whose depth and hidden size match the dense model."""
    n_dense, n_cand = dense.num_layers, stream.num_layers
    h_dense, h_cand = dense.model.config.hidden_size, stream.model.config.hidden_size
    if (n_dense, h_dense) != (n_cand, h_cand):
        notes.append(f"{label}: no per-layer curves ({n_cand} layers x hidden {h_cand} vs dense {n_dense} x {h_dense})")
        return None
    return LayerCurves(n_dense)
