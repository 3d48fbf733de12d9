"""Peak-memory and wall-time measurement for a stage or a layer, on CPU and CUDA.

CUDA: peak bytes allocated by torch on the device. CPU: the process's peak resident set
(VmHWM), which Linux lets us reset through /proc/self/clear_refs so each measurement starts
from the current footprint; `peak_delta_bytes` is the growth above the footprint at entry.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def proc_bytes(path: str, key: str) -> int | None:
    """The `key:   N kB` line of a /proc file, in bytes (None where it is absent, e.g. macOS)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    return proc_bytes("/proc/self/status", "VmRSS") or 0


def _peak_rss_bytes() -> int:
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5 resets the peak RSS (VmHWM)
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Hand the free pages inside the heap back to the OS (glibc's malloc_trim). Layers loaded and
    released one after another leave freed blocks between live ones; without this the footprint of
    a streamed walk grew ~4 MiB per layer on SmolLM2-135M (+124 MiB over its 30 layers)."""
    _glibc("malloc_trim", 0)


def _glibc(function: str, *args: int) -> None:
    """Call a glibc malloc tuning function; elsewhere (or without glibc) do nothing."""
    if sys.platform.startswith("linux"):
        try:
            getattr(ctypes.CDLL("libc.so.6"), function)(*args)
        except (OSError, AttributeError):
            pass


MMAP_THRESHOLD = 16 * 2**20  # allocations at least this large get their own mapping (see below)
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def map_large_allocations(threshold: int = MMAP_THRESHOLD) -> None:
    """Serve allocations of `threshold` bytes and more from their own memory mappings, returned to
    the OS when freed. glibc raises its threshold after the first large free, so LaCo's activation
    caches (tens of MiB each) then come from the heap and stay in the footprint for later stages:
    the default build's fidelity stage peaked 350 MiB higher for it. A fixed 1 MiB threshold fixed
    that too but made the build 20% slower (page faults on every step's tensors); 16 MiB leaves
    those on the heap. Respects MALLOC_MMAP_THRESHOLD_ when the user set it."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _glibc("mallopt", _M_MMAP_THRESHOLD, threshold)


@contextlib.contextmanager
def mapped_allocations(threshold: int):
    """Within the block, allocations of `threshold` bytes and more get their own mappings; after it,
    MMAP_THRESHOLD again (map_large_allocations). For code that makes long-lived small objects between
    large short-lived ones: from the heap, the large ones would leave holes that the small ones keep
    resident. Does nothing where the user set MALLOC_MMAP_THRESHOLD_."""
    map_large_allocations(threshold)
    try:
        yield
    finally:
        map_large_allocations()


def release_memory() -> None:
    """Collect garbage and trim the heap, so that what one stage loaded does not stay in the
    process's footprint for the next."""
    gc.collect()
    trim_heap()


@dataclass
class Measurement:
    device: str = "cpu"
    wall_s: float = 0.0
    peak_bytes: int = 0  # CUDA: max allocated; CPU: peak RSS of the process
    peak_delta_bytes: int = 0  # peak above the footprint at entry
    kind: str = field(default="rss")  # "cuda_max_allocated" | "rss"

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "wall_s": round(self.wall_s, 3),
            "peak_mib": round(self.peak_bytes / 2**20, 1),
            "peak_delta_mib": round(self.peak_delta_bytes / 2**20, 1),
            "memory_kind": self.kind,
        }


@contextlib.contextmanager
def measure(device: torch.device | str = "cpu"):
    """Measure wall time and peak memory of the enclosed block; yields a Measurement filled on exit."""
    device = torch.device(device)
    m = Measurement(device=str(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        m.kind = "cuda_max_allocated"
    else:
        _reset_peak_rss()
        base = current_rss_bytes()
    t0 = time.perf_counter()
    try:
        yield m
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            m.peak_bytes = torch.cuda.max_memory_allocated(device)
        else:
            m.peak_bytes = _peak_rss_bytes()
        m.peak_delta_bytes = max(0, m.peak_bytes - base)
        m.wall_s = time.perf_counter() - t0
