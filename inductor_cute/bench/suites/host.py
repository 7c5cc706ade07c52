"""Host cost per call of compiled graphs without CUDA graphs (issue 11): the wall time of calls issued
back to back, where a small kernel's launch path is the whole cost.

Runners:
  inductor_cute  torch.compile(max-autotune-no-cudagraphs) with inductor-cute enabled and only our
                 GEMM backend offered (ICUTE), so the graph calls our kernel whatever autotuning
                 would pick; flex_attention decoding through our lowering
  triton         the same graph compiled stock (ATen and Triton GEMMs; Inductor's flex decoding)
  aten           eager PyTorch
Times are wall microseconds per call (back-to-back calls, one sync at the end), interleaved.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..case import Case
from .models import wall_us

METHOD = ("wall time per call, 200 calls back to back then a sync, median of 5 rounds with the runners "
          "interleaved (the host's cost where it exceeds the device's)")
MM_ROWS = (1, 8, 128, 4096)
GEMV = (16, 14336, 4096)  # M, N, K: a decode batch through a Llama MLP projection
DECODE = (8, 32, 8, 128, 8192)  # B, Hq, Hkv, D, KV
FLEX_VARIANTS = ("plain", "softcap", "block_mask")


def _compiled(fn, args, ours: bool, backends: str | None = None):
    from .gemm_compiled import compile_now

    return compile_now(fn, args, mode="max-autotune-no-cudagraphs", ours=ours,
                       backends=backends if ours else None)


def _mm(x, w):
    return x @ w.t()


def _mm_case(m: int, n: int, k: int, label: str) -> Case:
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    ours = _compiled(_mm, (x, w), True, backends="ICUTE")
    stock = _compiled(_mm, (x, w), False)
    runners = {"inductor_cute": ours.run, "triton": stock.run, "aten": lambda: _mm(x, w)}
    notes = [f"ours: {ours.our_calls} call(s) of our GEMM in output code"]
    return Case(name=f"{label} {m}x{n}x{k}", params={"M": m, "N": n, "K": k, "dtype": "bfloat16"},
                flops=2 * m * n * k, bytes=2 * (m * k + n * k + m * n), matmul=True, runners=runners, notes=notes,
                atol=5e-2, rtol=5e-2, wall_times_us=wall_us(runners, calls=200))


def _flex_case(variant: str) -> Case:
    torch._dynamo.reset()
    b, hq, hkv, d, kv = DECODE
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, hkv, kv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = {}
    if variant == "softcap":
        kw["score_mod"] = lambda s, b_, h, qi, ki: torch.tanh(s / 30.0) * 30.0
    if variant == "block_mask":
        kw["block_mask"] = create_block_mask(lambda b_, h, qi, ki: ki <= qi + kv - 1, None, None, 1, kv)

    def attend(q, k, v):
        return flex_attention(q, k, v, enable_gqa=True, **kw)

    ours = _compiled(attend, (q, k, v), True)
    stock = _compiled(attend, (q, k, v), False)
    flex_calls = ours.code.count("inductor_cute.inductor.flex.runtime.FlexDecodeLauncher(")
    runners = {"inductor_cute": ours.run, "triton": stock.run, "aten": lambda: attend(q, k, v)}
    return Case(name=f"flex decode {variant} B{b} Hq{hq} Hkv{hkv} d{d} KV{kv}",
                params={"B": b, "Hq": hq, "Hkv": hkv, "D": d, "KV": kv, "variant": variant},
                flops=4 * b * hq * kv * d, bytes=2 * 2 * b * hkv * kv * d, matmul=False, runners=runners,
                notes=[f"ours: {flex_calls} call(s) of our flex decode in output code"],
                wall_times_us=wall_us(runners, calls=200))


def cases(quick: bool):
    mm = [functools.partial(_mm_case, m, 4096, 4096, "mm") for m in MM_ROWS]
    gemv = [functools.partial(_mm_case, *GEMV, "gemv")]
    flex = [functools.partial(_flex_case, v) for v in FLEX_VARIANTS]
    if quick:
        return mm[1:2] + flex[:1]
    return mm + gemv + flex
