"""Where a compiled graph's host time goes per call (issue 11's `host` suite, the cases ours loses).

    python3 benchmarks/host_profile.py [M N K]      (default: the GEMV case, 16 14336 4096)

Compiles x @ w.t() as the host suite does (ours: only our GEMM backend; stock: ATen and Triton),
times wall per call of each (back-to-back calls, one sync), then profiles 2000 calls of each with
cProfile and prints the functions with the most own time: what our launch path costs beside the
graph's own wrapper and Dynamo's guards, and what stock's launch costs.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from inductor_cute.bench.suites.host import _compiled, _mm
from inductor_cute.bench.timing import host_overhead_us


def main():
    m, n, k = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (16, 14336, 4096)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    runs = {"ours": _compiled(_mm, (x, w), True, backends="ICUTE"), "stock": _compiled(_mm, (x, w), False)}
    for label, compiled in runs.items():
        print(f"{label}: {host_overhead_us(compiled.run):.1f} us per call (wall), {compiled.our_calls} call(s) of ours", flush=True)
    for label, compiled in runs.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            compiled.run()
        profile.disable()
        torch.cuda.synchronize()
        print(f"\n== {label}: own time per call (us), top 15")
        stats = pstats.Stats(profile)
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
        for (file, line, name), (_, calls, tottime, cumtime, _) in rows:
            print(f"{tottime / 2000 * 1e6:8.2f} {cumtime / 2000 * 1e6:8.2f}  {calls // 2000:3d}x  "
                  f"{name} ({file.split('/')[-1]}:{line})")


if __name__ == "__main__":
    main()
