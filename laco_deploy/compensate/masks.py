"""Sparsity masks taken from the pruned weights themselves, and the realised sparsity of a model.

The mask of a pruned matrix is `weight != 0`: whatever pattern the pruner produced (unstructured,
N:M, or none at all for structured shapes) is kept bit-exactly because every update is followed
by writing +0.0 back into the masked positions.
"""

from __future__ import annotations

from typing import Iterable

import torch

from laco_deploy.config import PRUNABLE_LINEARS
from laco_deploy.models import decoder_layers, linear_modules


def weight_mask(weight: torch.Tensor) -> torch.Tensor:
    """Surviving positions of a pruned matrix. [out, in] float -> [out, in] bool."""
    return weight != 0


def layer_masks(layer: torch.nn.Module, targets: Iterable[str] = PRUNABLE_LINEARS) -> dict[str, torch.Tensor]:
    """Masks of a decoder layer's prunable linears, by module name (e.g. `self_attn.q_proj`)."""
    return {name: weight_mask(lin.weight.detach()) for name, lin in linear_modules(layer, tuple(targets)).items()}


class MaskFactors:
    """A layer's masks as 0/1 factors in the weights' dtype, for the writes after every training step.

    Multiplying is ~10x cheaper than masked_fill_ on CPU (0.16 vs 1.7 ms for a 1536x576 matrix,
    measured), and at batch 2 the per-step masking was a quarter of LaCo's training time.
    """

    def __init__(self, layer: torch.nn.Module, masks: dict[str, torch.Tensor]):
        self.pairs = [(lin.weight, masks[name].to(lin.weight.dtype)) for name, lin in
                      ((name, layer.get_submodule(name)) for name in masks)]

    def zero_grads(self) -> None:
        """Zero the gradient of masked-out weights so optimizer moments never see them."""
        pairs = [(w.grad, keep) for w, keep in self.pairs if w.grad is not None]
        if pairs and pairs[0][0].is_cuda:  # one kernel for all matrices: a GPU's step is launch-bound
            torch._foreach_mul_([g for g, _ in pairs], [k for _, k in pairs])
            return
        for grad, keep in pairs:  # on CPU the loop (each matrix stays in cache) was as fast or faster
            grad.mul_(keep)

    @torch.no_grad()
    def apply(self) -> None:
        """Write +0.0 into every masked-out weight: w * 0 may be -0.0, and -0.0 + 0.0 is +0.0."""
        if self.pairs and self.pairs[0][0].is_cuda:
            weights = [w for w, _ in self.pairs]
            torch._foreach_mul_(weights, [k for _, k in self.pairs])
            torch._foreach_add_(weights, 0.0)
            return
        for weight, keep in self.pairs:
            weight.mul_(keep).add_(0.0)


def masked_merge(weight: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Merge an update under the weight's own mask. [out, in] x2 -> (merged [out, in], lost).

    `lost` counts the zeros that an unmasked merge (weight + delta) would have made non-zero.
    """
    mask = weight_mask(weight)
    lost = int(((~mask) & (delta != 0)).sum())
    merged = torch.where(mask, weight + delta.to(weight.dtype), torch.zeros((), dtype=weight.dtype, device=weight.device))
    return merged, lost


def model_sparsity(model, targets: Iterable[str] = PRUNABLE_LINEARS,
                   dense_numel: dict[str, int] | None = None) -> dict:
    """Realised sparsity over the prunable matrices of all decoder layers (see weights_sparsity)."""
    weights = ((f"model.layers.{i}.{name}", lin.weight.detach()) for i, layer in enumerate(decoder_layers(model))
               for name, lin in linear_modules(layer, tuple(targets)).items())
    return weights_sparsity(weights, dense_numel)


def weights_sparsity(weights: Iterable[tuple[str, torch.Tensor]], dense_numel: dict[str, int] | None = None) -> dict:
    """Realised sparsity of (matrix key, weight) pairs, e.g. `model.layers.0.mlp.up_proj`; the
    weights may be read one at a time (streamed compensation).

    `dense_numel` (matrix name -> element count of the dense model) makes removed rows and
    columns of structured pruning count as zeros: sparsity = 1 - nonzeros / dense elements.
    Returns {"sparsity", "zeros", "elements", "matrices": {name: {"zeros", "numel"}}}.
    """
    zeros = nonzeros = original = 0
    matrices = {}
    for key, w in weights:
        nz = int(torch.count_nonzero(w))
        numel = w.numel()
        matrices[key] = {"zeros": numel - nz, "numel": numel}
        zeros += numel - nz
        nonzeros += nz
        original += (dense_numel or {}).get(key, numel)
    sparsity = 1.0 - nonzeros / original if original else 0.0
    return {"sparsity": round(sparsity, 6), "zeros": zeros, "elements": original, "matrices": matrices}


def dense_numel(model, targets: Iterable[str] = PRUNABLE_LINEARS) -> dict[str, int]:
    """Element count of each prunable matrix of a (dense) model, keyed like `model_sparsity`."""
    return {f"model.layers.{i}.{name}": lin.weight.numel()
            for i, layer in enumerate(decoder_layers(model))
            for name, lin in linear_modules(layer, tuple(targets)).items()}
