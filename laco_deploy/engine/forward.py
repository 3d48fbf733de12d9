"""Forward-only walks of several models side by side over the same token windows.

Fidelity compares the dense model with its candidates layer by layer. Each model is a
`ModelStream`: its skeleton (engine.lazy.LazyModel, layers on disk) or a resident model, and one
activation cache of the windows ([windows, seq, hidden]) that its layers update in place. The
layer engine's forward-only mode (engine.walk.walk_side_by_side, over each stream's `lane`)
advances every stream by one decoder layer, layer i of all models before layer i + 1, so one
decoder layer is in memory at a time and the per-layer outputs of all models are side by side
after each depth (the per-layer error curves); `Head` turns the last hidden states into logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch

from laco_deploy import families
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import LayerInputs
from laco_deploy.engine.lazy import LazyModel, capture_inputs
from laco_deploy.engine.walk import Lane, WalkOptions, walk_side_by_side
from laco_deploy.models import decoder_layers

NORM = ("model.norm",)
HEAD_BLOCK_BYTES = 16 * 2**20  # fp32 bytes of the LM head read at a time (lazy streams)


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

    @property
    def lane(self) -> Lane:
        """This stream as the layer engine walks it (its layers streamed by `lazy` when on disk)."""
        return Lane(self.model, self.inputs, self.lazy)


def open_stream(path: Path, input_ids: torch.Tensor, device: torch.device, *,
                load_resident: Callable[[Path], Any] | None = None, offload: str = "cpu",
                workdir: Path | None = None) -> ModelStream:
    """Embed the windows input_ids [windows, seq] with the model in `path`.

    Safetensors checkpoints are opened lazily: only the embedding matrix is read, and dropped again
    once the windows are embedded. Other checkpoints (pickled weights) are loaded whole through
    `load_resident(path)`, the one case where a full model sits in memory.
    """
    path = Path(path)
    lazy = LazyModel.open(path, rest=False) if any(path.glob("*.safetensors")) or load_resident is None else None
    model = lazy.model if lazy is not None else load_resident(path)
    return ModelStream(model, capture_inputs(model, lazy, input_ids, device, offload, workdir), lazy)


class Head:
    """Final norm + LM head of one stream: last hidden states -> logits.

    Lazy streams load the final norm only; the head's weight (with tied embeddings, the embedding
    matrix) is read from the file in blocks of vocabulary rows on every call, one block in memory
    at a time: at vocab 49152 and hidden 2048 the matrix is 384 MiB, one window's logits 24 MiB.
    `close()` returns the norm to `meta`.
    """

    def __init__(self, stream: ModelStream, device: torch.device):
        self.stream, self.device = stream, device
        if stream.lazy is not None:
            stream.lazy.load_rest(NORM)
        self.norm = stream.model.model.norm.to(device)
        self.lm_head = stream.model.lm_head.to(device) if stream.lazy is None else None
        self.softcap = families.logit_softcap(stream.model.config)  # Gemma 2: cap * tanh(logits / cap)
        self.rows = max(1, HEAD_BLOCK_BYTES // (4 * stream.model.config.hidden_size))

    def blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(first row, weight block [rows, hidden], bias block or None) of the LM head, on `device`."""
        if self.lm_head is not None:
            w, b = self.lm_head.weight, self.lm_head.bias
            for start in range(0, w.shape[0], self.rows):
                yield start, w[start : start + self.rows], (b[start : start + self.rows] if b is not None else None)
            return
        for start, w, b in self.stream.lazy.head_blocks(self.rows):
            yield start, w.to(self.device), (b.to(self.device) if b is not None else None)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [seq, hidden] -> logits [seq, vocab] float32 on CPU."""
        h = self.norm(hidden.to(self.device))
        if self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = torch.empty(*h.shape[:-1], self.stream.model.config.vocab_size, device=self.device)
            for start, w, b in self.blocks():
                logits[..., start : start + w.shape[0]] = torch.nn.functional.linear(h, w, b)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float().cpu()

    def same_weights(self, other: Head) -> bool:
        """Whether both heads hold identical tensors (then one can serve both models); compared
        block by block, so that neither head is read whole."""
        mine, theirs = self.norm.state_dict(), other.norm.state_dict()
        if self.softcap != other.softcap or mine.keys() != theirs.keys() or not all(
                mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine):
            return False
        if self.rows != other.rows or self.stream.model.config.vocab_size != other.stream.model.config.vocab_size:
            return False  # different widths: the blocks would not line up (nor the weights match)
        for (_, w, b), (_, w2, b2) in zip(self.blocks(), other.blocks(), strict=True):
            if w.shape != w2.shape or not torch.equal(w, w2) or (b is None) != (b2 is None) or (
                    b is not None and not torch.equal(b, b2)):
                return False
        return True

    def close(self) -> None:
        if self.stream.lazy is not None:
            self.stream.lazy.release_rest(NORM)
        else:
            self.norm.to("cpu")
            self.lm_head.to("cpu")


def model_logits(path: Path, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Next-token logits of the safetensors model in `path` for one sequence, through the layer
    engine (one decoder layer in memory; no progress bar: a short check). input_ids [seq] ->
    [seq, vocab] float32 on CPU."""
    stream = open_stream(path, input_ids.view(1, -1), device)
    walk_side_by_side({"model": stream.lane}, WalkOptions(device, batch_size=1, desc=None))
    head = Head(stream, device)
    try:
        return head(stream.hidden.data[0])
    finally:
        head.close()
