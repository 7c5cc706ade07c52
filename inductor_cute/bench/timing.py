"""Timing GPU work and measuring this machine's ceilings, in the same run as the cases."""

from __future__ import annotations

import torch


_L2_FLUSH_BYTES = 256 << 20  # larger than any Hopper L2 (50-60 MB)


def time_us(fn, reps: int = 100, warmup: int = 10) -> float:
    """Median GPU time of `fn()` in microseconds, with L2 flushed before each run.

    The flush *reads* a buffer larger than L2, leaving it full of clean lines. A write flush
    (`buffer.zero_()`, as triton's do_bench does) leaves dirty lines that the timed kernel must
    write back while it reads, which added 3-8 us to every memory-bound GEMM below 50 us
    (benchmarks/results/l2-flush-effect-h200-20261202.txt).

    CUDA events bracket each call. The GPU is first held in a sleep long enough for the host to
    queue every run, so events measure device time only and a backend's host overhead (dynamo
    guards, argument conversion) does not leak in; `host_overhead_us` reports that separately.
    """
    import time

    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host_per_call_s = (time.perf_counter() - start) / warmup
    flush = torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    head_start_us = 2 * reps * (host_per_call_s * 1e6 + 20) + 1000
    torch.cuda._sleep(int(head_start_us * 2000))  # ~2000 cycles per us at H200 clocks; more is harmless
    for i in range(reps):
        flush.sum()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2] * 1e3


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
    for _ in range(300):  # ~0.5 s of matmuls first, so the clocks have ramped up before timing
        torch.mm(a, b)
    mm_us = time_us(lambda: torch.mm(a, b))
    return {"copy_TBps": round(2 * n_bytes / copy_us / 1e6, 3),
            "bf16_mm_TFLOPs": round(2 * n**3 / mm_us / 1e6, 1)}


def bound_us(flops: float, n_bytes: float, ceilings: dict) -> float:
    """The roofline floor of a case: the larger of its memory time and its matmul time."""
    mem = n_bytes / (ceilings["copy_TBps"] * 1e6)
    compute = flops / (ceilings["bf16_mm_TFLOPs"] * 1e6)
    return max(mem, compute)
