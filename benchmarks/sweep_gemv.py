"""Time decode-GEMV configurations beside cuBLAS and our WGMMA GEMM on decode shapes (H200).

    python3 benchmarks/sweep_gemv.py [quick|all]

D (M, N) = A (M, K) @ W.t() for an nn.Linear weight W (N, K), bf16. One line per (shape, config):
device time (cold L2; and graph-timed, as autotuning times choices in compiled graphs), the
fraction of the bytes floor (W + A + D at the measured copy bandwidth), the K splits and CTAs;
then cuBLAS, ops.mm (our WGMMA GEMM) and a plain read of W (`w.sum()`). "heuristic" marks
gemv_config.default_config's pick. Used to pick defaults; see docs/perf-notes.md.
"""

import sys

import torch

from inductor_cute import ops
from inductor_cute.bench.timing import measure_ceilings, time_us
from inductor_cute.kernels.gemm.config import GemmProblem
from inductor_cute.kernels.gemm.gemv_config import (GemvConfig, default_config, spec, splits, unsupported_reason,
                                                    workspace_sizes)
from inductor_cute.runtime import get_kernel, precompile

DECODE = [(16, 4096, 4096), (8, 4096, 4096), (8, 14336, 4096), (8, 6144, 4096), (8, 4096, 14336), (1, 4096, 4096),
          (32, 4096, 4096), (32, 6144, 4096), (32, 14336, 4096)]  # M = 32: 4 token tiles, explicit configs only
QUICK_SKIPS = {(16, 4096, 4096), (32, 6144, 4096)}  # the grouped q/k/v at M = 32: autotune_timing.py --m 32
BF16 = GemmProblem("bfloat16", "bfloat16", "k", "k")


def candidates(m, n, k, sms, quick):
    """The heuristic's pick and its neighbours: warps, stages and a range of K splits."""
    pick = default_config(BF16, m, n, k, num_sms=sms)
    out = [pick]
    warps, stages = ((4, 8), (4, 8)) if quick else ((4, 8), (3, 4, 6, 8))
    split_counts = (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 12, 16, 24)
    for vecs in (1, 2):  # 16-byte vectors per thread and W row per stage (K-adjacent)
        for w in warps:
            for st in stages:
                for s in split_counts:
                    step = 32 * vecs
                    ks = -(-k // s // step) * step
                    cfg = GemvConfig(w, ks, st, pick.m_tiles, vecs)
                    if cfg not in out and unsupported_reason(BF16, cfg, m=m, k=k) is None:
                        out.append(cfg)
    return pick, out


def graph_us(fn) -> float:
    """Device time per call as autotuning in a compiled graph measures it (choice_timing's CUDA
    graph of calls between L2-flushing reads, on a side stream)."""
    from inductor_cute.inductor.choice_timing import graph_time_ms

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ms = graph_time_ms(fn, lambda f: time_us(f) / 1e3)
    torch.cuda.current_stream().wait_stream(stream)
    return ms * 1e3


def launcher(a, w, out, cfg):
    partials, n_counters = workspace_sizes(w.shape[0], a.shape[1], cfg)
    partials = torch.empty(partials, device="cuda", dtype=torch.float32)
    counters = torch.zeros(n_counters, device="cuda", dtype=torch.int32)
    kernel = get_kernel(spec(BF16, cfg))
    return lambda: kernel(a, w, out, None, None, partials, counters, 1.0, 0.0)


def main(mode):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = measure_ceilings()
    print(f"ceilings {ceil}", flush=True)
    quick = mode == "quick"
    shapes = [s for s in DECODE if not quick or s not in QUICK_SKIPS]
    plans = [(shape, *candidates(*shape, sms, quick)) for shape in shapes]
    precompile(list({spec(BF16, c) for _, _, cfgs in plans for c in cfgs}))
    for (m, n, k), pick, cfgs in plans:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().t()
        floor_us = 2 * (n * k + m * k + m * n) / (ceil["copy_TBps"] * 1e6)
        t_cublas = time_us(lambda: torch.mm(a, w.t()))
        g_cublas = graph_us(lambda: torch.mm(a, w.t()))
        t_gemm = time_us(lambda: ops.mm(a, w.t()))
        t_read = time_us(lambda: w.sum())
        print(f"\n{m}x{n}x{k}: floor {floor_us:.1f} us | cuBLAS {t_cublas:.1f} us (graph {g_cublas:.1f})"
              f" | ops.mm (WGMMA) {t_gemm:.1f} us"
              f" | w.sum() {t_read:.1f} us", flush=True)
        rows = []
        for cfg in cfgs:
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            run = launcher(a, w, out, cfg)
            run()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            rows.append((time_us(run), graph_us(run), cfg, err))
        for t, g, cfg, err in sorted(rows, key=lambda r: r[0]):
            ctas = -(-n // cfg.n_block) * splits(k, cfg)
            tag = "heuristic" if cfg == pick else ""
            print(f"  w{cfg.warps} s{cfg.stages} v{cfg.vecs} k_slice {cfg.k_slice:5d} splits {splits(k, cfg):2d} "
                  f"CTAs {ctas:5d} {t:7.1f} us  floor {floor_us / t:5.1%}  vs cuBLAS {t_cublas / t:5.2f}x  "
                  f"graph {g:5.1f} us vs cuBLAS {g_cublas / g:5.2f}x  relerr {err:.1e} {tag}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
