"""First speed probe of the flex prefill and grouped GEMM kernels (eager calls, device time, L2
flushed by triton's do_bench), beside the baselines a user has: SDPA (flash where it runs) and
compiled stock flex_attention with the BlockMask create_block_mask builds; torch._grouped_mm.
A probe, not the issues' suites: a few cases, to see where the kernels stand before tuning.

    python3 benchmarks/probe_prefill_grouped.py [prefill] [grouped]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench


def _us(fn) -> float:
    try:
        fn()
        return do_bench(fn, warmup=25, rep=200) * 1e3
    except Exception as e:  # a baseline that cannot run this case
        print(f"    ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
        return float("nan")


def prefill() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from inductor_cute.host.flex_prefill import flex_prefill
    from inductor_cute.kernels.common.programs import score as sp

    causal_program = sp.dumps([["o", "ge", "q", "kv"]])
    flex = torch.compile(flex_attention)
    cases = [("llama B4 H32/8 S4096 causal", 4, 32, 8, 4096, 128, 128, True),
             ("dsv3-mla B1 H128 S4096 causal", 1, 128, 128, 4096, 192, 128, True),
             ("llama B2 H32/8 S16384 noncausal", 2, 32, 8, 16384, 128, 128, False),
             ("vit B32 H16 S1024 noncausal", 32, 16, 16, 1024, 64, 64, False)]
    print("case | ours us | triton flex us | sdpa us | ours TFLOP/s (unmasked work)")
    for name, b, hq, hkv, s, dqk, dv, causal in cases:
        q = torch.randn(b, hq, s, dqk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, dqk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16)
        kw = {}
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b_, h, m, n: m >= n, None, None, s, s, device="cuda")
            kw = dict(mask_mod=causal_program, kv_num_blocks=block_mask.kv_num_blocks, kv_indices=block_mask.kv_indices,
                      full_kv_num_blocks=block_mask.full_kv_num_blocks, full_kv_indices=block_mask.full_kv_indices)
        ours = _us(lambda: flex_prefill(q, k, v, **kw))
        stock = _us(lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv))
        sdpa = _us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv))
        flops = 2 * b * hq * s * s * (dqk + dv) * (0.5 if causal else 1.0)
        print(f"{name} | {ours:.1f} | {stock:.1f} | {sdpa:.1f} | {flops / ours / 1e6:.0f}")


def grouped() -> None:
    from inductor_cute.host.grouped_gemm import grouped_mm

    gen = torch.Generator().manual_seed(0)

    def uneven(groups: int, tokens: int) -> list[int]:
        w = torch.rand(groups, generator=gen) ** 2
        sizes = (w / w.sum() * tokens).long()
        sizes[0] += tokens - sizes.sum()
        return sizes.tolist()

    cases = [("8 equal x4096 N4096 K7168", [4096] * 8, 4096, 7168),
             ("dsv3-like 32 uneven /8192 N4096 K7168", uneven(32, 8192), 4096, 7168),
             ("qwen3-like 128 uneven /16384 N1536 K2048", uneven(128, 16384), 1536, 2048)]
    print("case | ours us | torch._grouped_mm us | ours TFLOP/s | eager TFLOP/s")
    for name, sizes, n, k in cases:
        tokens = sum(sizes)
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (E, K, N) K-major
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
        ref = torch._grouped_mm(a, b, offs)
        got = grouped_mm(a, b, offs)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        ours = _us(lambda: grouped_mm(a, b, offs))
        eager = _us(lambda: torch._grouped_mm(a, b, offs))
        flops = 2 * tokens * n * k
        print(f"{name} | {ours:.1f} | {eager:.1f} | {flops / ours / 1e6:.0f} | {flops / eager / 1e6:.0f} "
              f"(rel err vs eager {err:.1e})")


if __name__ == "__main__":
    parts = sys.argv[1:] or ["prefill", "grouped"]
    for part in parts:
        {"prefill": prefill, "grouped": grouped}[part]()
