"""Device working-set accounting: what a training step keeps on the accelerator.

On CPU there is no device-memory counter, and the process RSS mixes the host-side activation
offload with what would live on a GPU. This module counts, for one training step, the bytes
that would be on the device: parameters resident there, gradients and AdamW state of the
trainable ones, the tensors autograd saves for the backward pass (measured exactly with
saved-tensor hooks, shared storages counted once) and the step's input/target batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

ADAMW_STATES = 2  # exp_avg and exp_avg_sq per trainable element


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


@dataclass
class SavedTensorMeter:
    """Bytes of distinct storages autograd saved for backward, minus those of excluded tensors."""

    exclude: set = field(default_factory=set)
    storages: dict = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.exclude:
            self.storages[key] = t.untyped_storage().nbytes()
        return t


@contextlib.contextmanager
def count_saved(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensorMeter]:
    """Count saved activations of the autograd graph built inside the block.

    Tensors in `exclude` (the parameters: counted separately) are not activations.
    """
    meter = SavedTensorMeter(exclude={_storage_key(t) for t in exclude})
    with torch.autograd.graph.saved_tensors_hooks(meter._pack, lambda t: t):
        yield meter


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def working_set(resident: Iterable[torch.Tensor], trainable: Iterable[torch.Tensor], saved_bytes: int,
                batch: Iterable[torch.Tensor]) -> dict[str, int]:
    """The device working set of one step, in bytes, by part (and `total`)."""
    trainable = list(trainable)
    parts = {
        "params": tensor_bytes(resident),
        "grads": tensor_bytes(trainable),
        "optimizer": ADAMW_STATES * tensor_bytes(trainable),
        "saved_activations": int(saved_bytes),
        "batch": tensor_bytes(batch),
    }
    parts["total"] = sum(parts.values())
    return parts
