"""Timing GPU work and measuring this machine's ceilings, in the same run as the cases."""

from __future__ import annotations

import torch


def time_us(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of `fn()` in microseconds: CUDA events, warm-up, L2 flushed between runs."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def host_overhead_us(fn, calls: int = 2000) -> float:
    """Wall time per call of `fn()` issued back to back, for tiny launches: the host-side cost."""
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate of a large cuBLAS GEMM."""
    n_bytes = 2 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = time_us(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_us = time_us(lambda: torch.mm(a, b))
    return {"copy_TBps": round(2 * n_bytes / copy_us / 1e6, 3),
            "bf16_mm_TFLOPs": round(2 * n**3 / mm_us / 1e6, 1)}


def bound_us(flops: float, n_bytes: float, ceilings: dict) -> float:
    """The roofline floor of a case: the larger of its memory time and its matmul time."""
    mem = n_bytes / (ceilings["copy_TBps"] * 1e6)
    compute = flops / (ceilings["bf16_mm_TFLOPs"] * 1e6)
    return max(mem, compute)
