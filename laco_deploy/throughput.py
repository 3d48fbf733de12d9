"""Achieved compute throughput, reported against a matmul measured in the same run.

Absolute times on a shared machine say little; the ratio of a stage's achieved GFLOP/s to what
a plain matmul (in the stage's compute dtype) reaches on the same device, at the same moment,
says how much of the hardware the stage used (and so whether it is compute-bound or wasting time elsewhere).
"""

from __future__ import annotations

import time

import torch

from laco_deploy import devices


MIN_MATMUL_S = 0.05  # grow the reference matmul until one takes this long (timer and launch noise)


def matmul_gflops(device: torch.device, n: int | None = None, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n matmul in `dtype` on `device` (2 n^3 FLOPs each);
    a stage that computes in bf16 is compared with a bf16 matmul. n None: from 256 up, doubled while
    one product takes under MIN_MATMUL_S, to 2048 on a CPU and 8192 on a GPU (an H200 needs the
    large size to approach its peak; a CPU without native bf16 emulates it ~50x slower than fp32,
    where a fixed 1024 took 35 s)."""
    if n is not None:
        return 2 * n**3 / _best_seconds(device, n, dtype, repeats) / 1e9
    n, largest, best = 256, (8192 if device.type == "cuda" else 2048), 0.0
    while True:  # the best rate over the sizes tried (a busy machine can stall one of them)
        seconds = _best_seconds(device, n, dtype, repeats)
        best = max(best, 2 * n**3 / seconds / 1e9)
        if seconds >= MIN_MATMUL_S or n >= largest:
            return best
        n *= 2


def _best_seconds(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best time of `repeats` n x n matmuls (after one that warms up kernels and caches)."""
    if device.type == "cuda":
        gen = torch.Generator(device).manual_seed(0)
        a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    else:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(device, dtype)
        b = torch.randn(n, n, generator=gen).to(device, dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        devices.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        devices.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def throughput_record(gflop: float, seconds: float, reference_gflops: float) -> dict[str, float]:
    """Achieved GFLOP/s of `gflop` done in `seconds`, and its share of the reference matmul rate."""
    achieved = gflop / seconds if seconds > 0 else 0.0
    return {"gflop": round(gflop, 3), "seconds": round(seconds, 3), "achieved_gflops": round(achieved, 2),
            "matmul_gflops": round(reference_gflops, 2), "share_of_matmul": round(achieved / reference_gflops, 4)
            if reference_gflops > 0 else 0.0}
