"""Peak-memory and wall-time measurement for a stage or a layer, on CPU and CUDA.

CUDA: peak bytes allocated by torch on the device. CPU: the peak resident set of the process
within the block, or, where higher, its own plus the pages only its child processes map (a
runtime's tool such as llama-quantize, a benchmark process, a call in isolated.py), sampled: what
the machine held for the block. `/usr/bin/time -v` reports the largest single process instead.
Where the block raised the process's all-time peak (VmHWM) that mark is exact; otherwise the peak
is the largest resident set sampled every SAMPLE_S by one background thread.
The kernel's mark is never reset (/proc/self/clear_refs): resetting it also lowers the process's
ru_maxrss, so `/usr/bin/time -v` would report the last stage's peak instead of the build's.
`peak_delta_bytes` is the growth above the footprint at entry.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import resource
import sys
import threading
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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_rss_bytes(pid: int | str = "self") -> int:
    """Resident set of process `pid` from /proc/PID/statm; raises OSError/IndexError/ValueError."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE


def current_rss_bytes() -> int:
    """Resident set now: /proc/self/statm (cheaper than /proc/self/status, read every SAMPLE_S)."""
    try:
        return _statm_rss_bytes()
    except (OSError, IndexError, ValueError):
        return proc_bytes("/proc/self/status", "VmRSS") or 0


def _peak_rss_bytes() -> int:
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


SAMPLE_S = 0.02  # RSS sampling period while a measurement is open (a read of statm costs ~20 us)
CHILDREN_EVERY = 5  # child processes are looked up every this many samples (one read per thread)


def _descendants(pid: int) -> list[int]:
    """Process ids of `pid`'s children, theirs, and so on (Linux /proc; elsewhere none)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            pass
    return kids + [d for k in kids for d in _descendants(k)]


def descendants_private_bytes() -> int:
    """The pages of this process's child processes (a runtime's tool, a benchmark, an export in
    isolated.call) that only they map, added up: with this process's resident set, what the machine
    holds (the libraries they share with it are already in that). Their resident set where
    /proc/PID/smaps_rollup is unreadable."""
    total = 0
    for pid in _descendants(os.getpid()):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            total += sum(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Private_"))
        except (OSError, IndexError, ValueError):
            try:
                total += _statm_rss_bytes(pid)
            except (OSError, IndexError, ValueError):
                pass  # ended meanwhile
    return total


class _RssSampler:
    """One daemon thread that, while any measurement is open, samples the resident set every SAMPLE_S
    (with the child processes' own pages added every CHILDREN_EVERY samples) and raises each open
    measurement's running maxima: [own, own + children]. It sleeps when none is open."""

    def __init__(self):
        self._open: dict[int, list[int]] = {}  # id -> [max own bytes, max own + children bytes]
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def open(self) -> list[int]:
        own = current_rss_bytes()
        box = [own, own + descendants_private_bytes()]
        with self._wake:
            self._open[id(box)] = box
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="laco-rss-sampler", daemon=True)
                self._thread.start()
            self._wake.notify()
        return box

    def close(self, box: list[int]) -> list[int]:
        with self._wake:
            self._open.pop(id(box), None)
        own = current_rss_bytes()
        box[0], box[1] = max(box[0], own), max(box[1], own + descendants_private_bytes())
        return box

    def stop(self) -> None:
        """End the thread before the interpreter finalizes: a daemon thread woken during finalization
        is killed with pthread_exit, which can abort the process from inside a library's C++."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        tick = 0
        while True:
            with self._wake:
                while not self._open and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                boxes = list(self._open.values())
            rss = current_rss_bytes()
            tree = rss + descendants_private_bytes() if tick % CHILDREN_EVERY == 0 else 0
            tick += 1
            for box in boxes:
                box[0], box[1] = max(box[0], rss), max(box[1], tree)
            time.sleep(SAMPLE_S)


_SAMPLER = _RssSampler()
atexit.register(_SAMPLER.stop)


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
    peak_bytes: int = 0  # CUDA: max allocated; CPU: peak RSS of the process within the block
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


_child_peaks: list[int] = []  # peak resident bytes of child processes that ran work of this one (isolated.py)


def note_child_peak(peak_bytes: int) -> None:
    """A child process that did part of this process's work peaked at `peak_bytes` (its kernel mark,
    exact where the sampler's view of it was not): the enclosing `measure` blocks count it as their
    peak where that is higher than what they saw."""
    _child_peaks.append(int(peak_bytes))


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
        mark_at_entry = _peak_rss_bytes()
        children_at_entry = len(_child_peaks)
        sampled = _SAMPLER.open()
        base = sampled[0]
    t0 = time.perf_counter()
    try:
        yield m
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            m.peak_bytes = torch.cuda.max_memory_allocated(device)
        else:
            own_sampled, with_children = _SAMPLER.close(sampled)
            mark = _peak_rss_bytes()
            # A new all-time mark was set inside the block: it is its exact own peak. Otherwise the
            # block stayed below an earlier stage's peak and only the samples can tell its own.
            # Child processes count on top (sampled, or exactly as isolated.call notes them).
            m.peak_bytes = max(mark if mark > mark_at_entry else own_sampled, with_children,
                               max(_child_peaks[children_at_entry:], default=0))
        m.peak_delta_bytes = max(0, m.peak_bytes - base)
        m.wall_s = time.perf_counter() - t0
