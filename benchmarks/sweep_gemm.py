"""Time GEMM tile configurations side by side with cuBLAS on chosen shapes (H200).

    python3 benchmarks/sweep_gemm.py [small|large|all] [k|n|kn]

Prints one line per (shape, B layout, config): device time, TFLOP/s, fraction of the bytes
floor, and cuBLAS on the same inputs. Used to pick defaults; see docs/perf-notes.md.
"""

import sys

import torch

from inductor_cute import ops
from inductor_cute.bench.timing import measure_ceilings, time_us
from inductor_cute.kernels.gemm.config import GemmConfig as G
from inductor_cute.runtime import precompile

SMALL = [(16, 4096, 4096), (128, 14336, 4096), (128, 4096, 14336)]
LARGE = [(8192, 8192, 8192), (4096, 4096, 14336)]
SMALL_CONFIGS = [
    G(64, 32, 128, 1, 1, 8, 1, False), G(64, 64, 128, 1, 1, 6, 1, False), G(64, 32, 64, 1, 1, 14, 1, False),
    G(64, 128, 64, 1, 1, 8, 1, False), G(128, 32, 128, 1, 1, 6, 2, False), G(128, 64, 128, 1, 1, 5, 2, False),
    G(128, 128, 64, 1, 1, 6, 2, False), G(128, 96, 64, 1, 1, 7, 2, False),
]
LARGE_CONFIGS = [
    G(128, 256, 64, 2, 1, 4, 2, True), G(128, 256, 64, 1, 2, 4, 2, True), G(256, 128, 64, 2, 1, 4, 2, True),
    G(256, 128, 64, 1, 2, 4, 2, True), G(128, 192, 64, 2, 1, 5, 2, True), G(128, 256, 64, 2, 1, 4, 2, False),
    G(128, 128, 64, 2, 1, 6, 2, True, True), G(128, 128, 64, 1, 2, 6, 2, True, True), G(64, 256, 64, 2, 1, 5, 2, True, True),
    G(128, 128, 64, 1, 1, 6, 2, True, True),
]


def operands(m, n, k, b_major):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_major == "k"
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    return a, b


def main(which, b_majors):
    groups = {"small": [(SMALL, SMALL_CONFIGS)], "large": [(LARGE, LARGE_CONFIGS)]}
    plan = groups.get(which, groups["small"] + groups["large"])
    ceil = measure_ceilings()
    print(f"ceilings {ceil}", flush=True)
    jobs = []
    for shapes, configs in plan:
        for (m, n, k) in shapes:
            for b_major in b_majors:
                a, b = operands(m, n, k, b_major)
                for cfg in configs:
                    try:
                        jobs.append(((m, n, k, b_major, cfg), ops.gemm_spec_for(a, b, config=cfg)))
                    except Exception as e:  # an invalid config for this problem
                        print(f"skip {cfg}: {e}")
    precompile([spec for _, spec in jobs])
    for (m, n, k, b_major, cfg), spec in jobs:
        a, b = operands(m, n, k, b_major)
        ref = a.float() @ b.float()
        try:
            out = ops.mm(a, b, config=cfg)
        except Exception as e:
            print(f"{m}x{n}x{k} B{b_major} {cfg}: FAILED {str(e).splitlines()[0][:120]}")
            continue
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t = time_us(lambda: ops.mm(a, b, config=cfg))
        t_cublas = time_us(lambda: torch.mm(a, b))
        floor_us = 2 * (m * k + k * n + m * n) / (ceil["copy_TBps"] * 1e6)
        tf = 2 * m * n * k / t / 1e6
        c = cfg
        tag = (f"{c.tile_m}x{c.tile_n}x{c.tile_k} c{c.cluster_m}x{c.cluster_n} s{c.stages} w{c.consumer_warpgroups} "
               f"{'P' if c.persistent else 'NP'}{' pingpong' if c.pingpong else ''}")
        print(f"{m}x{n}x{k} B{b_major} {tag:32} {t:8.1f} us {tf:6.1f} TF/s bytes-floor {floor_us / t:5.1%}"
              f" | cuBLAS {t_cublas:8.1f} us  ratio {t_cublas / t:5.3f}  relerr {err:.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all", sys.argv[2] if len(sys.argv) > 2 else "k")
