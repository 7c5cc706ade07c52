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
    return time_side_by_side({0: fn}, reps, rounds=1, warmup=warmup)[0]


def time_side_by_side(fns: dict, reps: int = 100, rounds: int = 5, warmup: int = 10) -> dict:
    """Median GPU time in microseconds of each `fns[key]()`, the runs interleaved: `rounds`
    rounds, each timing reps/rounds runs of every function in turn (the order rotating), so every
    function meets the same clocks. On the H200 the SM clock follows power and temperature: one
    8192^3 GEMM config read 1385 us and then 1573 us a minute later in one run
    (benchmarks/results/gemm-h200-20261202.md), more than the differences being compared."""
    keys = list(fns)
    for key in keys:
        for _ in range(warmup):
            fns[key]()
    torch.cuda.synchronize()
    flush = _flush_buffer()
    per_round = max(1, reps // rounds)
    samples = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            samples[key] += _device_times_ms(fns[key], per_round, flush)
    return {key: sorted(t)[len(t) // 2] * 1e3 for key, t in samples.items()}


def _flush_buffer() -> torch.Tensor:
    return torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")


def _device_times_ms(fn, reps: int, flush: torch.Tensor) -> list[float]:
    """Device times of `reps` runs of `fn()`, each after an L2 flush, queued behind a GPU sleep."""
    import time

    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    host_per_call_us = (time.perf_counter() - start) * 1e6
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    head_start_us = 2 * reps * (host_per_call_us + 20) + 1000
    torch.cuda._sleep(int(head_start_us * 2000))  # ~2000 cycles per us at H200 clocks; more is harmless
    for i in range(reps):
        flush.sum()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


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

    def copy_time_us():  # its 4 GiB of buffers are freed on return
        src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        return time_us(lambda: dst.copy_(src))

    copy_us = copy_time_us()
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
