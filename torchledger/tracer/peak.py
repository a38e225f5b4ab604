"""Measure the matmul peak of the CPU (or a CUDA device) for MFU when no table entry applies."""
from __future__ import annotations

import time

import torch

__all__ = ["measure_matmul_peak"]


def measure_matmul_peak(device: str = "cpu", dtype=torch.float32, n: int = 1024, seconds: float = 0.3) -> float:
    """Best FLOP/s of an n x n x n matmul over ~``seconds`` (2*n^3 FLOPs per call)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)                                   # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device != "cpu":
            torch.cuda.synchronize()                 # NB: sync point, outside any traced step
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best
