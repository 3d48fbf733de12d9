"""Activations for all calibration samples at one depth: [samples, seq, hidden] on CPU, disk or the device."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from laco_deploy import devices


class ActivationCache:
    """A fixed-shape float32 buffer of hidden states, in RAM (`cpu`) or memory-mapped (`disk`);
    `place()` moves a RAM cache onto the device when it fits there (compensate/steps.py decides).

    Disk mode keeps RAM flat for models whose activations do not fit; the file is scratch and
    deleted with the cache. A host cache feeding a CUDA device gathers the rows of a training batch
    into pinned memory, so the copy runs without blocking the host (`rows`).
    """

    def __init__(self, shape: tuple[int, int, int], offload: str = "cpu", workdir: Path | None = None,
                 device: torch.device | None = None):
        self.shape = tuple(shape)
        self.offload = offload
        self._file = None
        if offload == "disk":
            self._file = tempfile.NamedTemporaryFile(prefix="laco-act-", suffix=".f32", dir=workdir, delete=True)
            mm = np.memmap(self._file.name, dtype=np.float32, mode="w+", shape=self.shape)
            self.data = torch.from_numpy(mm)
        else:
            self.data = torch.empty(self.shape, dtype=torch.float32, device=device)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def place(self, device: torch.device) -> None:
        """Move a RAM cache onto `device` (its batches then never cross the bus)."""
        if self.offload != "disk" and not devices.same(self.data.device, device):
            self.data = self.data.to(device)

    def batch(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        return self.data[start:stop].to(device, non_blocking=True)

    def rows(self, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The samples `idx` [k] (a CPU index) as [k, seq, hidden] on `device`. Towards CUDA nothing
        here waits for the device: the index (for a device cache) or the gathered rows (for a host
        cache) go from pinned memory, whose blocks torch's caching host allocator reuses only once
        their copy is done."""
        if devices.same(self.data.device, device):
            return self.data[devices.send(idx, device)]
        if not devices.pinned(device):
            return self.data[idx].to(device)
        buf = torch.empty((len(idx), *self.shape[1:]), dtype=torch.float32, pin_memory=True)
        torch.index_select(self.data, 0, idx, out=buf)
        return buf.to(device, non_blocking=True)

    def store(self, start: int, values: torch.Tensor) -> None:
        self.data[start : start + values.shape[0]] = values.detach().to(self.data.device, torch.float32)

    def clone_empty(self) -> ActivationCache:
        workdir = Path(self._file.name).parent if self._file is not None else None
        return ActivationCache(self.shape, self.offload, workdir, device=self.data.device if self._file is None else None)

    def copy_from(self, other: ActivationCache) -> None:
        self.data.copy_(other.data)
