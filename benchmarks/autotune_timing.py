"""Does Inductor's autotuning time our GEMM choices at their device time? (issue 11: within 10%)

For decode-size GEMMs of a Llama-3.1-8B layer (M = 8), every config we offer and cuBLAS are timed
three ways, side by side in one process:
  inductor: torch._inductor's benchmarker (`benchmark_gpu`, as autotuning calls a choice: a
            write flush of L2, CUDA events around each call, the minimum)
  device:   bench.timing.time_us (a read flush, the host queued ahead behind a GPU sleep, median)
  wall:     back-to-back calls, wall time per call (the host cost when it exceeds the device's)
In the models suite's autotuning logs (sixth session) our GEMV read 65.7 us where its sweep read
34.6 us, and cuBLAS in the model ran the same GEMM in 29.2 us.

    python3 benchmarks/autotune_timing.py [--m 8]
"""

from __future__ import annotations

import argparse

import torch

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (N, K): q/o, k/v, gate/up, down


def main() -> None:
    from torch._inductor.runtime.benchmarking import benchmarker

    from inductor_cute.bench.timing import host_overhead_us, time_us
    from inductor_cute.inductor.gemm import runtime
    from inductor_cute.kernels.gemm import config as gemm_config
    from inductor_cute.kernels.gemm import gemv_config
    from inductor_cute.kernels.gemm.config import GemmProblem
    from inductor_cute.kernels.gemm.family import as_tuple

    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=8)
    args = p.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k")
    print(f"M={args.m}; us per call: inductor (autotuning's benchmarker) / device / wall")
    for n, k in SHAPES:
        a = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
        configs = gemv_config.candidates(problem, args.m, n, k, 1, num_sms) + \
            gemm_config.candidates(problem, args.m, n, k, 1, num_sms)[:2]
        fns = {"cuBLAS": lambda: torch.mm(a, w.t(), out=out)}
        for cfg in configs:
            fns[cfg.describe()] = (lambda c: lambda: runtime.gemm(a, w.t(), out=out, op="mm", config=c))(as_tuple(cfg))
        print(f"-- {args.m}x{n}x{k} (floor {2 * n * k / 4.29e6:.1f} us at 4.29 TB/s)")
        for name, fn in fns.items():
            fn()
            ind = benchmarker.benchmark_gpu(fn) * 1e3
            dev = time_us(fn)
            wall = host_overhead_us(fn, calls=500)
            print(f"{ind:8.1f} {dev:8.1f} {wall:8.1f}  {name}")


if __name__ == "__main__":
    main()
