"""Per-layer error curves of candidates against the dense model, and whole-model layer outputs.

`LayerCurves` keeps running sums of per-token relative error and cosine per decoder layer. Fidelity
fills it from the layer engine (fidelity/torch_pass.py: every model walked side by side, each
candidate layer fed by the candidate's own previous layers, the way it runs in deployment), one
layer over all windows at a time (`add_layer`). `record_layer_outputs` / `forward_with_layers`
give the same per-layer outputs from one whole-model forward pass (hooks on the decoder layers):
the reference the engine is tested against.
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
    tokens: list[int] = field(default_factory=list)  # tokens summed per layer

    def __post_init__(self) -> None:
        self.rel_sum = [0.0] * self.num_layers
        self.cos_sum = [0.0] * self.num_layers
        self.tokens = [0] * self.num_layers

    def add(self, cand: list[torch.Tensor], dense: list[torch.Tensor]) -> None:
        """Add one window. cand and dense: L x [seq, hidden] (same shapes, same device)."""
        if len(cand) != self.num_layers or len(dense) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer outputs, got {len(cand)} and {len(dense)}")
        for i, (hc, hd) in enumerate(zip(cand, dense)):
            self.add_layer(i, hc, hd)

    def add_layer(self, i: int, cand: torch.Tensor, dense: torch.Tensor) -> None:
        """Add layer i's outputs for some tokens. cand, dense [..., hidden] (same shapes)."""
        self.rel_sum[i] += relative_error(cand, dense).sum().item()
        self.cos_sum[i] += cosine(cand, dense).sum().item()
        self.tokens[i] += cand[..., 0].numel()

    def absorb(self, other: LayerCurves) -> None:
        """Add the sums of tokens scored elsewhere (another rank's windows)."""
        for i in range(self.num_layers):
            self.rel_sum[i] += other.rel_sum[i]
            self.cos_sum[i] += other.cos_sum[i]
            self.tokens[i] += other.tokens[i]

    def to_list(self) -> list[dict[str, float]]:
        """[{layer, rel_error, cosine}] averaged over tokens, one entry per decoder layer."""
        return [{"layer": i, "rel_error": r / max(n, 1), "cosine": c / max(n, 1)}
                for i, (r, c, n) in enumerate(zip(self.rel_sum, self.cos_sum, self.tokens))]
