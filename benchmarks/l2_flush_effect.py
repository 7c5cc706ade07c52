"""How the L2 flush between timed runs moves small, memory-bound GEMMs (H200).

    python3 benchmarks/l2_flush_effect.py

The harness flushed L2 by writing 256 MB before each run, which leaves L2 full of dirty lines
that the timed kernel must write back while it reads. This compares three ways to start cold:
a write flush, a read flush (L2 left holding clean lines) and rotating input copies (no flush).
"""

import torch

from inductor_cute import ops
from inductor_cute.kernels.gemm.config import GemmConfig as G
from inductor_cute.runtime import precompile

SHAPES = [(16, 4096, 4096), (128, 14336, 4096), (128, 4096, 14336), (4096, 4096, 4096)]
CONFIGS = [None, G(64, 32, 128, 1, 1, 8, 1, False), G(128, 128, 64, 1, 1, 6, 2, False)]


def timed(fn_of_set, sets, flush, reps=60):
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    big_f = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    for i in range(5):
        fn_of_set(sets[i % len(sets)])
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(reps):
        if flush == "write":
            big.zero_()
        elif flush == "read":
            big_f.sum()
        ev[i][0].record()
        fn_of_set(sets[i % len(sets)])
        ev[i][1].record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) for s, e in ev)
    return t[len(t) // 2] * 1e3


def main():
    for m, n, k in SHAPES:
        copies = max(1, (200 << 20) // (2 * (m * k + n * k)))
        sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()) for _ in range(copies)]
        cfgs = [c for c in CONFIGS if c is None or c.tile_m >= 64]
        precompile([ops.gemm_spec_for(*sets[0], config=c) for c in cfgs])
        floor = 2 * (m * k + k * n + m * n) / 4.27e6
        print(f"{m}x{n}x{k} (B K-major) bytes floor at 4.27 TB/s: {floor:.1f} us; {copies} input copies")
        variants = {"cuBLAS": lambda s: torch.mm(*s), "w.sum() read of B": lambda s: s[1].sum()}
        for c in cfgs:
            variants[f"ours {c and (c.tile_m, c.tile_n, c.tile_k, c.stages) or 'default'}"] = \
                (lambda c: lambda s: ops.mm(*s, config=c))(c)
        for name, fn in variants.items():
            row = [timed(fn, sets[:1], "write"), timed(fn, sets[:1], "read"), timed(fn, sets, "none")]
            print(f"  {name:34} write-flush {row[0]:7.1f}  read-flush {row[1]:7.1f}  rotate {row[2]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
