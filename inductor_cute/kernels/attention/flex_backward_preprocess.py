"""Attention backward, step 1: per query row, delta = sum_d dO[d] * O[d] in fp32 and the
logsumexp in log2 units, for the dK/dV and dQ kernels (flex_backward_config.py).

    delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d]
    lse2[b, h, i] = lse[b, h, i] * log2(e), or +inf where lse is -inf (a row with nothing to attend)

Both outputs have Lpad = padded_rows(L) rows; rows i >= L get delta 0 and lse2 +inf, so the
main kernels read whole tiles without bounds checks and recompute P = 2^(x - lse2) = 0 there.
One warp per row: lane l reads elements l, l + 32, ... (64 contiguous bytes per load across
the warp), a warp shuffle adds the parts. Four rows per 128-thread CTA; grid (Lpad / 4, H, B).

Tensor conventions: out, grad_out (B, H, L, Dv) bf16/fp16, last dim contiguous, other strides
multiples of 8 elements; lse (B, H, L) fp32 contiguous; delta, lse2 (B, H, Lpad) fp32 contiguous.
Exported entry: kernel(out, grad_out, lse, delta, lse2).
"""

import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.units import LOG2E, NEG_INF
from . import fake_operands as fake
from .fake_operands import CUTE_DTYPES
from .flex_backward_config import DTYPES

ROWS_PER_CTA = 4  # one warp per row


class FlexBackwardPreprocess:
    def __init__(self, head_dim_v: int, dtype_name: str):
        assert head_dim_v % 32 == 0 and dtype_name in DTYPES
        self.dv = head_dim_v

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLse: cute.Tensor, mDelta: cute.Tensor,
                 mLse2: cute.Tensor, stream: cuda.CUstream):
        padded = mDelta.shape[2]
        self.kernel(mO, mdO, mLse, mDelta, mLse2).launch(
            grid=[cute.ceil_div(padded, ROWS_PER_CTA), mDelta.shape[1], mDelta.shape[0]],
            block=[32 * ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLse: cute.Tensor, mDelta: cute.Tensor,
               mLse2: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, b = cute.arch.block_idx()
        lane = tidx % 32
        row = blk * ROWS_PER_CTA + tidx // 32
        q_len, padded = mO.shape[2], mDelta.shape[2]
        if row < padded:
            part = Float32(0.0)
            lse2 = Float32(-NEG_INF)
            if row < q_len:
                for i in cutlass.range_constexpr(self.dv // 32):
                    d = lane + 32 * i
                    part += Float32(mdO[(b, head, row, d)]) * Float32(mO[(b, head, row, d)])
                lse = mLse[(b, head, row)]
                if lse != NEG_INF:
                    lse2 = lse * LOG2E
            delta = cute.arch.warp_reduction(part, operator.add)
            if lane == 0:
                mDelta[(b, head, row)] = delta
                mLse2[(b, head, row)] = lse2


def build(head_dim_v: int, dtype_name: str):
    """(jit function, fake arguments) for cute.compile from the preprocess spec's parameters."""
    dt = CUTE_DTYPES[dtype_name]
    B, H, L, Lpad = (cute.sym_int() for _ in range(4))

    out = fake.strided(dt, (B, H, L, head_dim_v))
    grad_out = fake.strided(dt, (B, H, L, head_dim_v))
    lse = fake.compact(Float32, (B, H, L))
    delta = fake.compact(Float32, (B, H, Lpad))
    lse2 = fake.compact(Float32, (B, H, Lpad))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return FlexBackwardPreprocess(head_dim_v, dtype_name), (out, grad_out, lse, delta, lse2, stream)
