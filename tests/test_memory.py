"""memory.map_large_allocations: a large buffer freed after glibc raised its mmap threshold goes back
to the OS, so one stage's activation caches do not stay in the footprint of the next; and how a
stage's peak is counted (the kernel's mark, samples, child processes on top)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from laco_deploy import memory

PROBE = """
import ctypes, sys
from laco_deploy.memory import current_rss_bytes, map_large_allocations
if sys.argv[1] == "mapped":
    map_large_allocations()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 24 * 2**20  # above our 16 MiB threshold, below glibc's 32 MiB cap on raising its own
def touched():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
libc.free(touched())  # glibc's default raises its mmap threshold past n here
big = touched()        # ... so this one comes from the heap
pin = libc.malloc(64)  # a live block above it: the heap top cannot shrink
ctypes.memset(pin, 1, 64)
before = current_rss_bytes()
libc.free(big)
print((before - current_rss_bytes()) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_large_freed_buffers_leave_the_footprint():
    def released(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin"})
        return float(out.stdout.strip())

    assert released("mapped") > 20  # the 24 MiB buffer was its own mapping
    assert released("default") < 4  # without it the freed pages stay resident (what the build saw)


def test_mapped_allocations_sets_then_restores_the_threshold(monkeypatch):
    from laco_deploy import memory

    calls = []
    monkeypatch.setattr(memory, "_glibc", lambda fn, *args: calls.append((fn, *args)))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError), memory.mapped_allocations(2**20):
        assert calls == [("mallopt", memory._M_MMAP_THRESHOLD, 2**20)]
        raise RuntimeError  # restored on the way out of a failing block too
    assert calls[-1] == ("mallopt", memory._M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD) and len(calls) == 2
    calls.clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own setting wins
    with memory.mapped_allocations(2**20):
        pass
    assert calls == []


STAGES = """
import time
import numpy as np
from laco_deploy.memory import measure
def hold(mib, seconds):
    buf = np.ones(mib * 2**18, dtype=np.float32)  # touched: resident
    time.sleep(seconds)
    del buf
with measure() as high:
    hold(200, 0.05)
with measure() as outer:
    with measure() as low:  # stays below the first stage's peak: only the sampler sees it
        hold(60, 0.3)
print(high.peak_bytes, low.peak_bytes, low.peak_delta_bytes, outer.peak_bytes)
"""

# What `/usr/bin/time -v` does: start the command and read its ru_maxrss from wait4. A small launcher
# in between, because a process started straight from pytest inherits pytest's own peak in its
# ru_maxrss (the kernel carries the peak of the image exec replaced; the suite's was 2.6 GB).
TIMED = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
out = child.stdout.read()
_, status, usage = os.wait4(child.pid, 0)
assert status == 0, status
print(out.strip(), usage.ru_maxrss * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and ru_maxrss in KiB")
def test_stage_peaks_agree_with_the_kernels_and_never_reset_it():
    """A stage that sets the process's peak reports the kernel's mark, which `/usr/bin/time -v` reads
    at exit; a later, smaller stage reports its own peak (sampled) without lowering that mark."""
    out = subprocess.run([sys.executable, "-c", TIMED, STAGES], capture_output=True, text=True, check=True)
    high, low, low_delta, outer, maxrss = (int(v) for v in out.stdout.split())
    mib = 2**20
    assert abs(high - maxrss) <= 8 * mib  # the first stage's peak is the process's, as time -v reports it
    assert 50 * mib <= low_delta <= 80 * mib and low < high - 100 * mib  # its own 60 MiB, not the earlier peak
    assert outer >= low  # nested measurements see the inner block's peak too


HOLDER = "import time; b = bytearray({mib} * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); time.sleep({s})"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/PID/task/TID/children")
def test_a_child_process_counts_on_top_of_this_ones():
    """A stage whose work runs in a child process (llama-quantize, a benchmark) held both processes'
    memory at once: its peak is this process's resident set plus the child's, not the larger one."""
    mib = 2**20
    others = memory.descendants_private_bytes()  # children of earlier tests (e.g. multiprocessing's tracker)
    with memory.measure("cpu") as m:
        own = memory.current_rss_bytes()
        child = subprocess.Popen([sys.executable, "-c", HOLDER.format(mib=300, s=1.0)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "held"
        during = memory.descendants_private_bytes()
        child.wait()
    assert during >= others + 300 * mib
    assert m.peak_bytes >= own + 300 * mib
    assert memory.descendants_private_bytes() < others + 50 * mib  # an ended child counts no more


def test_the_sampler_thread_ends_when_stopped_even_with_a_measurement_open():
    """stop() (registered with atexit) ends the daemon thread, so finalization never has to kill it."""
    sampler = memory._RssSampler()
    box = sampler.open()
    assert sampler._thread.is_alive()
    sampler.stop()
    assert not sampler._thread.is_alive()
    assert sampler.close(box)[0] > 0
