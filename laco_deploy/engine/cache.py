"""Activations for all calibration samples at one depth: [samples, seq, hidden] on CPU or disk."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch


class ActivationCache:
    """A fixed-shape float32 buffer of hidden states, in RAM (`cpu`) or memory-mapped (`disk`).

    Disk mode keeps RAM flat for models whose activations do not fit; the file is scratch and
    deleted with the cache.
    """

    def __init__(self, shape: tuple[int, int, int], offload: str = "cpu", workdir: Path | None = None):
        self.shape = tuple(shape)
        self.offload = offload
        self._file = None
        if offload == "disk":
            self._file = tempfile.NamedTemporaryFile(prefix="laco-act-", suffix=".f32", dir=workdir, delete=True)
            mm = np.memmap(self._file.name, dtype=np.float32, mode="w+", shape=self.shape)
            self.data = torch.from_numpy(mm)
        else:
            self.data = torch.empty(self.shape, dtype=torch.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def batch(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        return self.data[start:stop].to(device, non_blocking=True)

    def store(self, start: int, values: torch.Tensor) -> None:
        self.data[start : start + values.shape[0]] = values.detach().to("cpu", torch.float32)

    def clone_empty(self) -> ActivationCache:
        workdir = Path(self._file.name).parent if self._file is not None else None
        return ActivationCache(self.shape, self.offload, workdir)

    def copy_from(self, other: ActivationCache) -> None:
        self.data.copy_(other.data)
