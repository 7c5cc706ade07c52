"""Does autotuning time GEMM choices at the device time they take in a compiled model? (issue 11:
within 10%)

For decode-size GEMMs of a Llama-3.1-8B layer (M = 8), every config we offer and cuBLAS are timed
five ways, side by side in one process (us per call):
  inductor: torch._inductor's benchmarker (`benchmark_gpu`, as stock autotuning calls a choice: a
            write flush of L2, CUDA events around each call, the minimum)
  graph:    inductor_cute.inductor.choice_timing.graph_time_ms (how autotuning times a choice with
            enable(): calls after a read flush, in a CUDA graph, less the flushes alone)
  device:   bench.timing.time_us (a read flush, events around each call, the host queued ahead
            behind a GPU sleep, median)
  model:    the truth a CUDA-graph decode step meets: one graph of many back-to-back calls, each
            on its own copy of the weight (the copies together 3x L2, so every call reads its
            weight from memory, as a model's layers do), replay time over calls
  wall:     back-to-back calls, wall time per call (the host cost when it exceeds the device's)
Then q/k/v and gate/up as one launch over the weights sharing A (ops.gemv_shared_a) against one
cuBLAS call per weight, in the model column's terms.

    python3 benchmarks/autotune_timing.py [--m 8]   # --m 32: our GEMV with 4 token tiles (explicit configs)
"""

from __future__ import annotations

import argparse
import statistics

import torch

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]  # (N, K): q/o, k/v, gate/up, down, qkv


def model_time_us(make_call, weights, calls: int) -> float:
    """Per-call time of `calls` back-to-back calls in one CUDA graph, call i on weights[i % len]."""
    for w in weights[:2]:
        make_call(w)()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            make_call(weights[i % len(weights)])()
    times = []
    for r in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    from torch._inductor.runtime.benchmarking import benchmarker

    from inductor_cute.bench.timing import host_overhead_us, time_us
    from inductor_cute.inductor.choice_timing import graph_time_ms
    from inductor_cute.inductor.gemm import runtime
    from inductor_cute.kernels.gemm import config as gemm_config
    from inductor_cute.kernels.gemm import gemv_config
    from inductor_cute.kernels.gemm.config import GemmProblem
    from inductor_cute.kernels.gemm.family import as_tuple

    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=8)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k")
    print(f"M={args.m}; us per call: inductor / graph / device / model / wall")
    for n, k in SHAPES:
        a = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-3 * props.L2_cache_size // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        w = weights[0]
        out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
        configs = gemv_config.candidates(problem, args.m, n, k, 1, num_sms) + \
            gemm_config.candidates(problem, args.m, n, k, 1, num_sms)[:2]
        makers = {"cuBLAS": lambda wt: lambda: torch.mm(a, wt.t(), out=out)}
        for cfg in configs:
            makers[cfg.describe()] = (lambda c: lambda wt: lambda: runtime.gemm(a, wt.t(), out=out, op="mm",
                                                                                config=c))(as_tuple(cfg))
        print(f"-- {args.m}x{n}x{k} (floor {2 * n * k / 4.29e6:.1f} us at 4.29 TB/s; {copies} weight copies)")
        for name, make in makers.items():
            fn = make(w)
            fn()
            ind = benchmarker.benchmark_gpu(fn) * 1e3
            with torch.cuda.stream(torch.cuda.Stream()):  # as autotuning calls it, on a side stream
                graph = graph_time_ms(fn, lambda f: float("nan")) * 1e3
            dev = time_us(fn)
            model = model_time_us(make, weights, calls=max(24, copies))
            wall = host_overhead_us(fn, calls=500)
            print(f"{ind:8.1f} {graph:8.1f} {dev:8.1f} {model:8.1f} {wall:8.1f}  {name}")
    grouped(args.m, props.L2_cache_size)


def grouped(m: int, l2_bytes: int) -> None:
    """q/k/v and gate/up of a Llama-3.1-8B layer: our one-launch GEMV over the weights that share A
    (ops.gemv_shared_a) against one cuBLAS call per weight, in the model column's terms."""
    from inductor_cute import ops
    from inductor_cute.kernels.gemm import gemv_config
    from inductor_cute.kernels.gemm.config import GemmProblem

    problem = GemmProblem("bfloat16", "bfloat16", "k", "k")
    for ns, k in (((4096, 1024, 1024), 4096), ((14336, 14336), 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-3 * l2_bytes // (2 * sum(ns) * k)))
        sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in ns] for _ in range(copies)]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n in ns]

        def separate(ws):
            return lambda: [torch.mm(a, w.t(), out=o) for w, o in zip(ws, outs)]

        # past 16 rows the GEMV runs only with an explicit config (more token tiles)
        config = gemv_config.default_config(problem, m, ns, k) if m > gemv_config.MAX_M else None

        def ours(ws):
            return lambda: ops.gemv_shared_a(a, ws, config=config)

        floor = 2 * sum(ns) * k / 4.29e6
        print(f"-- {m}x({'+'.join(map(str, ns))})x{k} (floor {floor:.1f} us): model column, us per set of GEMMs")
        for name, make in (("cuBLAS, one call per weight", separate), ("ops.gemv_shared_a, one launch", ours)):
            print(f"{model_time_us(make, sets, calls=max(24, copies)):8.1f}  {name}")


if __name__ == "__main__":
    main()
