"""Achieved compute throughput, reported against a matmul measured in the same run.

Absolute times on a shared machine say little; the ratio of a stage's achieved GFLOP/s to what
a plain matmul (in the stage's compute dtype) reaches on the same device, at the same moment,
says how much of the hardware the stage used (and so whether it is compute-bound or wasting time elsewhere).
"""

from __future__ import annotations

import time

import torch


def matmul_gflops(device: torch.device, n: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n matmul in `dtype` on `device` (2 n^3 FLOPs each);
    a stage that computes in bf16 is compared with a bf16 matmul."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    b = torch.randn(n, n, generator=gen).to(device, dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up kernels and caches
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def throughput_record(gflop: float, seconds: float, reference_gflops: float) -> dict[str, float]:
    """Achieved GFLOP/s of `gflop` done in `seconds`, and its share of the reference matmul rate."""
    achieved = gflop / seconds if seconds > 0 else 0.0
    return {"gflop": round(gflop, 3), "seconds": round(seconds, 3), "achieved_gflops": round(achieved, 2),
            "matmul_gflops": round(reference_gflops, 2), "share_of_matmul": round(achieved / reference_gflops, 4)
            if reference_gflops > 0 else 0.0}
