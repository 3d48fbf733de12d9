"""What the code chooses per device, decided in one place.

Every choice that differs between a GPU and a CPU reads `traits(device)`: the precision `auto`
resolves to (bf16 autocast, fp16 with loss scaling where bf16 is not native), the calibration
budget, the step size and learning rate (compensate/steps.py), whether activation caches may live
on the device and host copies are pinned. Tests replace `traits` to drive CUDA's choices through
this same code on a CPU (tests/test_cuda_paths.py); the CUDA-only calls (pinned memory, CUDA
streams and memory counters) ask torch about the device itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Traits:
    accelerator: bool  # a GPU: the paper's budget, autocast, device-sized steps, device-resident caches
    bf16: bool  # bf16 matmuls run natively (CUDA: compute capability 8+; CPU: AMX or AVX512-BF16)
    free_bytes: int | None  # device memory free for the run (None: the host's, planned by memplan)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16; Linux flags).
    Elsewhere bf16 is emulated and slower than fp32, so auto precision stays fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def traits(device: torch.device) -> Traits:
    """The choices `device` gets (see the module docstring)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # planning a GPU run on a machine without one (laco-deploy plan)
            return Traits(True, True, None)
        return Traits(True, torch.cuda.is_bf16_supported(), int(torch.cuda.mem_get_info(device)[0]))
    return Traits(False, device.type == "cpu" and cpu_has_native_bf16(), None)


def pinned(device: torch.device) -> bool:
    """Whether host tensors bound for `device` should sit in pinned (page-locked) memory, so their
    copies run asynchronously with non_blocking=True: only towards a real CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def same(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same one (`cuda` is the current CUDA device, as `cuda:N` may be)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (an index, a mask) copied to `device`; towards CUDA from pinned memory,
    so the host does not wait for the device's queue (a copy from pageable memory would)."""
    if same(t.device, device):
        return t
    return t.pin_memory().to(device, non_blocking=True) if pinned(device) and t.device.type == "cpu" else t.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): before a clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
