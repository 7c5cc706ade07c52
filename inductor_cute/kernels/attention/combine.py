"""The split-KV combine: per output row, the partial results of S splits -> out and lse.

Each split s left O_s (its rows normalised by its own softmax sum) and lse_s (log2 units, -inf
for a split with nothing to attend to). Then lse = log2(sum_s 2^lse_s), out = sum_s 2^(lse_s - lse)
O_s, and lse is returned in natural-log units (lse * ln 2), the units flex_attention returns. A
row no split holds anything for gets out = 0 and lse = -inf. One warp per row, each lane
holding head_dim_v / 32 output columns.

Tensors: o_part (S, B, H, L, Dv) fp32, lse_part (S, B, H, L) fp32, out (B, H, L, Dv) in the
output dtype, lse (B, H, L) fp32. A kernel family wraps `run` in its own @cute.kernel (the
exported symbol then names the family) and launches it with `grid` and `block`.
"""

import operator

import cutlass.cute as cute
from cutlass import Float32

from ..common.units import LN2, NEG_INF


class SplitCombine:
    warps = 4  # rows per CTA

    def __init__(self, dtype, head_dim_v: int):
        self.dtype = dtype  # of out
        self.dv = head_dim_v

    def grid(self, rows):
        return [cute.ceil_div(rows, self.warps), 1, 1]

    def block(self):
        return [32 * self.warps, 1, 1]

    @cute.jit
    def run(self, mOp: cute.Tensor, mLp: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        splits, batch, heads, q_len = mOp.shape[0], mOp.shape[1], mOp.shape[2], mOp.shape[3]
        row = bidx * self.warps + tidx // 32
        if row < batch * heads * q_len:
            pos = row % q_len
            head = (row // q_len) % heads
            b = row // (q_len * heads)
            m = Float32(NEG_INF)
            for s in range(lane, splits, 32):
                m = cute.arch.fmax(m, mLp[(s, b, head, pos)])
            m = cute.arch.warp_reduction(m, cute.arch.fmax)
            base = m
            if m == NEG_INF:
                base = Float32(0.0)
            total = Float32(0.0)
            for s in range(lane, splits, 32):
                total += cute.math.exp2(mLp[(s, b, head, pos)] - base, fastmath=True)
            total = cute.arch.warp_reduction(total, operator.add)
            # weights 2^(lse_s - lse) sum to 1; with no split holding anything, all are 2^-inf = 0
            lse2 = Float32(NEG_INF)
            norm = Float32(0.0)
            if total != 0.0:  # NaN too: it reaches the lse
                lse2 = base + cute.math.log2(total, fastmath=True)
                norm = lse2
            cols = self.dv // 32
            acc = cute.make_rmem_tensor((cols,), Float32)
            acc.fill(0.0)
            for s in range(splits):
                w = cute.math.exp2(mLp[(s, b, head, pos)] - norm, fastmath=True)
                part = cute.local_tile(mOp[(s, b, head, pos, None)], (cols,), (lane,))
                acc.store(acc.load() + part.load() * w)
            out = cute.local_tile(mOut[(b, head, pos, None)], (cols,), (lane,))
            out.store(acc.load().to(self.dtype))
            if lane == 0:
                mLse[(b, head, pos)] = lse2 * LN2
