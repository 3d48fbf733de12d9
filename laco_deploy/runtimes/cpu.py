"""CPU facts the runtimes size their threads by and the benchmarks report (from /proc; no torch,
so a benchmark's child process stays free of it)."""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Physical cores this process may use (hyper-threads counted once, CPU affinity respected)."""
    try:
        pairs, phys = set(), None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "physical id":
                phys = value.strip()
            elif key.strip() == "core id":
                pairs.add((phys, value.strip()))
        cores = len(pairs)
    except OSError:
        cores = 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, usable) if cores else usable)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
