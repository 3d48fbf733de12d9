"""Per-layer hidden states of PyTorch models and the running per-layer error curves.

Each model runs its own full forward pass (so every decoder layer of the candidate is fed by the
candidate's own previous layers, the way it runs in deployment); forward hooks on the decoder
layers record each layer's output. One pass gives both the logits and the hidden states, which
is why fidelity does not walk the layers through the engine: that would cost a second pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from laco_deploy.fidelity.metrics import cosine, relative_error
from laco_deploy.models import decoder_layers


@contextlib.contextmanager
def record_layer_outputs(model) -> Iterator[list[torch.Tensor]]:
    """While open, each forward appends every decoder layer's output ([batch, seq, hidden], on
    the model's device, detached) to the yielded list, in layer order."""
    outputs: list[torch.Tensor] = []

    def hook(_module, _args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    handles = [layer.register_forward_hook(hook) for layer in decoder_layers(model)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def forward_with_layers(model, input_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One causal-LM forward pass of a single sequence.

    input_ids [seq] -> (logits [seq, vocab] float32 on CPU, per-layer outputs: L x [seq, hidden]
    float32 on `device`). `model` must already be on `device`.
    """
    with record_layer_outputs(model) as outs:
        logits = model(input_ids.view(1, -1).to(device), use_cache=False).logits
    return logits[0].float().cpu(), [h[0].float() for h in outs]


@dataclass
class LayerCurves:
    """Running sums of per-token relative error and cosine, per layer, over all evaluated tokens."""

    num_layers: int
    rel_sum: list[float] = field(default_factory=list)
    cos_sum: list[float] = field(default_factory=list)
    tokens: int = 0

    def __post_init__(self) -> None:
        self.rel_sum = [0.0] * self.num_layers
        self.cos_sum = [0.0] * self.num_layers

    def add(self, cand: list[torch.Tensor], dense: list[torch.Tensor]) -> None:
        """Add one window. cand and dense: L x [seq, hidden] (same shapes, same device)."""
        if len(cand) != self.num_layers or len(dense) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer outputs, got {len(cand)} and {len(dense)}")
        for i, (hc, hd) in enumerate(zip(cand, dense)):
            self.rel_sum[i] += relative_error(hc, hd).sum().item()
            self.cos_sum[i] += cosine(hc, hd).sum().item()
        self.tokens += cand[0].shape[0]

    def to_list(self) -> list[dict[str, float]]:
        """[{layer, rel_error, cosine}] averaged over tokens, one entry per decoder layer."""
        n = max(self.tokens, 1)
        return [{"layer": i, "rel_error": r / n, "cosine": c / n} for i, (r, c) in enumerate(zip(self.rel_sum, self.cos_sum))]
