"""Sweep RMSNorm launch configurations on the GPU: which threads-per-row / rows-per-CTA win where.

    python3 benchmarks/sweep_rmsnorm.py            (on the H200, DSL staged; prints a table)
"""

import itertools

import torch

from inductor_cute.bench.timing import time_us
from inductor_cute.kernels.norm.rmsnorm_config import RMSNormConfig, default_config, rmsnorm_spec
from inductor_cute.runtime import get_kernel, precompile

SHAPES = [(256, 8192), (1024, 8192), (4096, 4096), (16384, 4096), (4096, 7168), (32768, 2048)]


def configs(n, vec=8):
    for tpr, rows in itertools.product((32, 64, 128, 256, 512, 1024), (1, 2, 4)):
        if tpr * rows <= 1024 and tpr * vec <= n:
            yield RMSNormConfig(tpr * rows, rows, vec)


def main():
    plan = {(m, n): list(configs(n)) for m, n in SHAPES}
    specs = {(n, c): rmsnorm_spec(n, "bfloat16", c) for (m, n), cs in plan.items() for c in cs}
    failed = [r for r in precompile(list(specs.values())) if r.status == "failed"]
    print(f"{len(specs)} configs, {len(failed)} failed to compile")
    for (m, n), cs in plan.items():
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        bound = 2 * x.numel() * 2 / 4.25e6
        default = default_config(n, "bfloat16")
        rows = []
        for c in cs:
            k = get_kernel(specs[n, c])
            rows.append((time_us(lambda: k(x, w, y, 1e-6)), c))
        rows.sort(key=lambda r: r[0])
        print(f"M{m} N{n}: bound {bound:.1f} us")
        for t, c in rows[:4] + [r for r in rows if r[1] == default]:
            mark = " (default)" if c == default else ""
            print(f"   {t:7.1f} us  tpr {c.threads_per_row:4} rows {c.rows_per_cta}{mark}")


if __name__ == "__main__":
    main()
