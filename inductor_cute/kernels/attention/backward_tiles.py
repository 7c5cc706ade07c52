"""Pieces the attention backward kernels share: transposed views of shared-memory tiles, WGMMA
issue helpers and the store of a gradient accumulator.

A tile stored with its head dim contiguous (Q, dO, K) is read both K-major (as the B of S = Q K^T
or of S^T = K Q^T) and MN-major (as the B of dK += dS^T Q, dV += P^T dO or dQ += dS K): the same
swizzled bytes under a transposed layout, what WGMMA's MN-major descriptors expect.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """`t` (rows, cols, ...) in shared memory seen as (cols, rows, ...), no data moved."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


# Traced inline (not @cute.jit), each call on an MMA object made for it: the accumulate flag it
# sets must stay a value of the caller's loop body (see flex_prefill_sm90._qk).
def gemm_ss(mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, stage=None, a_stage=None):
    """Issue acc = A B^T over every k-block, A resident in shared memory (or in buffer `a_stage`),
    B in ring stage `stage` (None: B resident too) (not committed)."""
    warpgroup.fence()
    for kb in range(cute.size(tA, mode=[2])):  # unrolled at trace time
        mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
        a = tA[(None, None, kb)] if a_stage is None else tA[(None, None, kb, a_stage)]
        b = tB[(None, None, kb)] if stage is None else tB[(None, None, kb, stage)]
        cute.gemm(mma, acc, a, b, acc)


def gemm_rs(mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, stage):
    """Issue acc += A B^T, A from registers, B in ring stage `stage` (not committed)."""
    warpgroup.fence()
    mma.set(warpgroup.Field.ACCUMULATE, True)
    for kb in range(cute.size(tA, mode=[2])):
        cute.gemm(mma, acc, tA[(None, None, kb)], tB[(None, None, kb, stage)], acc)


@cute.jit
def store_rows(acc: cute.Tensor, tAcA: cute.Tensor, factor: cutlass.Float32, dtype, out: cute.Tensor, b, head, row0,
               n_rows):
    """acc * factor, converted to `dtype`, into out[b, head, row0 + r, c] for each value at tile
    coordinate (r, c) with row0 + r < n_rows."""
    for v in cutlass.range(cute.size(acc), unroll_full=True):
        acc[v] = acc[v] * factor
    converted = cute.make_rmem_tensor(acc.shape, dtype)
    converted.store(acc.load().to(dtype))
    for v in cutlass.range(cute.size(acc), unroll_full=True):
        row = row0 + tAcA[v][0]
        if row < n_rows:
            out[(b, head, row, tAcA[v][1])] = converted[v]
