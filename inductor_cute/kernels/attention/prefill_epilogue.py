"""The prefill forward's epilogue: each consumer warp group's O, normalised by its row sums, staged
in shared memory and written out with TMA, and its logsumexp.

O is staged in two halves of 64 x Dv (stmatrix), one per consumer warp group. With one Q buffer O
is staged in Q's buffer: both warp groups first meet (each past its last S = Q K^T, which reads
Q), and warp 4 stores both halves and waits for the TMA unit to have read them before Q's buffer
is handed back. With O in a buffer of its own (two Q buffers) each warp group stages and stores
alone behind a barrier of its 128 threads: its first warp issues the store and waits for the TMA
unit to have read that half only before the next tile's staging, so neither the other warp group
nor the next tile waits for it (the kernel waits for the last stores before the CTA ends). The
logsumexp goes out per row in natural-log units, (m + log2 l) * ln 2, after the proxy fence
(`fence.proxy.async` would wait for those global stores).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from ..common import barriers
from ..common.units import LN2
from .accumulator import row_half
from .flex_prefill_config import CONSUMER_WARPGROUPS, M_BLOCK
from .softmax import softmax_finalize


class PrefillEpilogue:
    def __init__(self, dtype, head_dim_v: int, own_buffer: bool, make_mma_pv):
        """`own_buffer`: O staged in a buffer of its own (two Q buffers), not in Q's;
        `make_mma_pv()`: the P V MMA of one warp group (whose accumulator layout acc_o has)."""
        self.dtype, self.dv, self.own_buffer, self.make_mma_pv = dtype, head_dim_v, own_buffer, make_mma_pv

    @cute.jit
    def run(self, acc_o: cute.Tensor, tOcO: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
            sO: cute.Tensor, tma_o: cute.CopyAtom, gO_full: cute.Tensor, mLse: cute.Tensor, ctid: Int32,
            warp_idx: Int32, slot: Int32, m_block: Int32, head: Int32, b: Int32, q_len: Int32):
        """Consumer warp group `slot`'s rows of the tile (m_block, head, b): acc_o / l through its
        half of sO (the (64, Dv, 2) staging layout) to out with tma_o (a (64, Dv) box); its lse."""
        lse = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            inv, lse2 = softmax_finalize(row_max, row_sum, h)
            for v in row_half(cute.size(acc_o), h):
                acc_o[v] = acc_o[v] * inv
            lse[h] = lse2 * LN2
        own = self.own_buffer
        store_warp = 4 + 4 * slot if const_expr(own) else 4
        if const_expr(own):
            if warp_idx == store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # this half's last store has read it
            staged = pipeline.NamedBarrier(barrier_id=barriers.attention_epilogue(slot), num_threads=128)
        else:
            staged = pipeline.NamedBarrier(barrier_id=barriers.ATTENTION_CONSUMERS, num_threads=128 * CONSUMER_WARPGROUPS)
        staged.arrive_and_wait()
        # the accumulator in stmatrix-shaped pieces (a layout-only atom), stored with the store op
        # the row-major staging layout wants
        atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
        r2s = cute.make_tiled_copy_S(sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32),
                                     cute.make_tiled_copy_C_atom(atom, self.make_mma_pv()))
        thr_r2s = r2s.get_slice(ctid % 128)
        tRS_acc = r2s.retile(acc_o)
        r_o = cute.make_rmem_tensor(thr_r2s.partition_S(cute.make_identity_tensor((64, self.dv))).shape, Float32)
        for v in cutlass.range(cute.size(r_o), unroll_full=True):
            r_o[v] = tRS_acc[v]
        r_out = cute.make_rmem_tensor(r_o.shape, self.dtype)
        r_out.store(r_o.load().to(self.dtype))
        cute.copy(r2s, r_out, thr_r2s.partition_D(sO[(None, None, slot)]))
        # generic-proxy smem writes, read next by the TMA unit
        cute.arch.fence_proxy("async.shared", space="cta")
        staged.arrive_and_wait()
        # the lse after the fence, which would otherwise wait for these global stores
        for h in cutlass.range_constexpr(2):
            row = m_block * M_BLOCK + tOcO[0][0] + 8 * h
            if row < q_len and tOcO[0][1] == 0:  # one thread of the row's quad
                mLse[(b, head, row)] = lse[h]
        if warp_idx == store_warp:
            gO = cute.local_tile(gO_full, (64, self.dv), (None, None, None, None))
            for half in cutlass.range_constexpr(1 if own else CONSUMER_WARPGROUPS):
                rows = slot if const_expr(own) else half
                tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1),
                                                   cute.group_modes(sO[(None, None, rows)], 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                if (2 * m_block + rows) * 64 < q_len:  # a half wholly past the last query stores nothing
                    cute.copy(tma_o, tOsO, tOgO[(None, 2 * m_block + rows, 0, head, b)])
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not own):
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # Q's buffer stays valid until read
                # the store's lane waited; lane 0 hands the Q buffer back (q_pipe.consumer_release) after it
                cute.arch.sync_warp()
