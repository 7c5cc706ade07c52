"""Attention backward for Hopper (sm_90a) in CuTe DSL, dK and dV: the FlexAttention backward's
main kernel (flex_backward_config.py has the whole schedule).

    dV[k] = sum_i P[i, k] dO[i]    dK[k] = scale sum_i dS[i, k] Q[i]    over the query rows i of
    every query head of the KV head, with P = 2^(x - lse2) and dS = P (dO . V[k] - delta[i])

One CTA per (KV_BLOCK = 128 keys, KV head, batch), 384 threads in three warp groups:

  * warp group 0, the producer, gives registers back (setmaxnreg); one warp loads the CTA's K and
    V tiles once (TMA, one mbarrier) and then (Q, dO) of each query block of Q_STEP rows into a
    `stages`-deep ring, query head by query head of the KV head.
  * warp groups 1 and 2, the consumers, own 64 keys each and keep dK and dV of them in fp32
    registers. Per query block: S^T = K Q^T and dP^T = V dO^T (SS WGMMA, keys as rows), then per
    element x = s * scale_log2, or score_mod(s * scale) * log2(e) with a score program (the
    mask program on partial blocks, as the query head's mask_mod(b, h, q, kv)), P^T =
    2^(x - lse2[q]) and dS^T = P^T (dP^T - delta[q]) (times the score_mod's derivative) in place,
    converted to 16 bits as the A operands of dV += P^T dO and dK += dS^T Q (RS WGMMA, dO and Q
    read MN-major from the same shared memory, backward_tiles.transpose_view).
  * the epilogue scales dK by `scale` and stores dK and dV rows below the sequence length.

A first version: by default the two SS products, the softmax-gradient math and the two RS
products run one after the other. With config.overlap (64/64 only: 128/128 spills) block j's SS
products are issued together with block j - 1's RS products and j's math runs under the latter,
as in the forward; the two consumers never take turns.

With config.dq_reduce the CTA computes dQ too (the five-product schedule): per query block,
before the dK and dV products are issued, each consumer writes dS^T of its keys into shared
memory (sdS, the CTA's 128 keys x Q_STEP queries, queries contiguous); once both halves are
there, warp group s computes at 128/128 dQ[:, 64 s .. 64 s + 63] = dS K[:, 64 s ..] over all 128
keys, at 64/64 all of dQ over its own 64 keys (SS WGMMA, both operands MN-major), stages it
times `scale` in shared memory (fp32, in strips of 8 columns, so the stores are free of bank
conflicts) and one of its warps adds it to the fp32 workspace dq_acc (B, Hq, Lpad, Dqk) with one
TMA reduce per strip. With one sdS (config.ds_buffers 1) two consumer barriers per block keep it
whole: one before it is written (both warp groups' previous dQ products are done), one before it
is read. With two (one per block parity) a warp group writes its half, issues its dV and dK
products and only then meets the other (the buffer is whole), issues dQ and reduces it: the
earlier warp group's products run while the later one's math finishes.

lse2 and delta come from the preprocess kernel, padded (lse2 +inf, delta 0) to at least every
query block the CTA walks, so padding rows give P = 0 without bounds checks; Q and dO rows past
the end are zero-filled by TMA.

A block mask (sparse_block > 0; block_sparse.py): the CTA walks the backward lists q_indices[z,
hm, r, :q_num_blocks] then full_q_indices[z, hm, r, :full_q_num_blocks] (z = b % Z, hm = h % H
for query head h, r the mask KV block holding the CTA's keys), each mask query block cut into
sparse_q_block / Q_STEP kernel blocks; the mask program runs on partial blocks only. Without one,
every query block is walked and is partial.

Tensor conventions (torch order, last dim contiguous, 16-byte aligned, other strides multiples
of 8 elements):
    q (B, Hq, Lq, Dqk)   k (B, Hkv, Lkv, Dqk)   v (B, Hkv, Lkv, Dv)   grad_out (B, Hq, Lq, Dv)
    lse2, delta (B, Hq, Lpad) fp32 contiguous; dk (B, Hkv, Lkv, Dqk), dv (B, Hkv, Lkv, Dv)
    contiguous in q's dtype; m0..m3 the mask program's captured tensors (contiguous 1-D), None
    past their count; q_num_blocks, full_q_num_blocks (Z, H, KVb) and q_indices, full_q_indices
    (Z, H, KVb, C), int32 (None without a block mask); dq_acc (B, Hq, Lpad, Dqk) fp32 contiguous,
    zeroed (dq_reduce; None otherwise)
Exported entry: kernel(q, k, v, grad_out, lse2, delta, dk, dv, scale_log2, scale, q_num_blocks,
q_indices, full_q_num_blocks, full_q_indices, m0, m1, m2, m3, s0, s1, s2, s3, dq_acc), s0..s3 the
score program's captured tensors (None past their count).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .accumulator import acc_as_operand_a, check_acc_layout, wait_after_all
from .backward_tiles import gemm_rs, gemm_ss, store_rows, transpose_view
from ..common import barriers
from ..common.tma_pipeline import stage_bytes, tma_pipeline
from ..common.units import NEG_INF
from . import fake_operands as fake
from .block_sparse import BlockSparse
from .flex_backward_config import (CONSUMER_WARPGROUPS, KV_BLOCK, Q_STEP, FlexBackwardConfig, FlexBackwardProblem,
                                   config_error, dq_reduce_split, from_params, smem_bytes)
from .fake_operands import CUTE_DTYPES
from .mask import ScoreGrad, ScoreMods
from .pack_gqa import PackGQA

K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN


class FlexBackwardSm90:
    def __init__(self, problem: FlexBackwardProblem, config: FlexBackwardConfig):
        self.problem, self.config = problem, config
        self.dtype = CUTE_DTYPES[problem.dtype_name]
        self.dqk, self.dv = problem.head_dim_qk, problem.head_dim_v
        # as the forward: 24 * 128 + 240 * 256 = 168 * 384, the registers the CTA launches with
        self.producer_regs = 24
        self.consumer_regs = 240
        self.mods = ScoreMods("", (), problem.mask_program, problem.mask_dtypes, KV_BLOCK, PackGQA(1))
        self.score_grad = ScoreGrad(problem.score_program, problem.score_dtypes) if problem.score_program else None
        self.exp_under_dp = config.exp_under_dp  # (config_error: no score program, sequential schedule)
        # the backward lists, in Q_STEP blocks (sparse_block 0: no block mask)
        self.blocks = BlockSparse(problem.sparse_q_block if problem.sparse_block else 0, Q_STEP)
        # dq_reduce: each consumer warp group's dQ product, (Q_STEP x dq_cols) over dq_keys keys
        self.dq_cols, self.dq_keys = dq_reduce_split(self.dqk)

    # keys as rows: warp group s owns keys 64 s .. 64 s + 63 of the CTA's block
    def _make_mma_t(self):
        """S^T = K Q^T and dP^T = V dO^T: (KV_BLOCK x Q_STEP), both operands K-major."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                 (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, Q_STEP))

    def _make_mma_grad(self, head_dim: int):
        """dV += P^T dO (head_dim Dv) and dK += dS^T Q (Dqk): A from registers, B MN-major."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                 (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, head_dim),
                                                 a_source=warpgroup.OperandSource.RMEM)

    def _make_mma_dq(self):
        """dq_reduce: one warp group's dQ[:, cols] = dS[:, keys] K[keys, cols], (Q_STEP x dq_cols)
        over dq_keys keys, dS and K both MN-major from shared memory."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 1, 1),
                                                 tiler_mn=(Q_STEP, self.dq_cols))

    def _setup(self):
        dt, st = self.dtype, self.config.stages

        def resident(d):
            return cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (KV_BLOCK, Q_STEP, d), dt, 1),
                               (None, None, 0))

        self.sK_layout, self.sV_layout = resident(self.dqk), resident(self.dv)
        self.sQ_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (KV_BLOCK, Q_STEP, self.dqk), dt, st)
        self.sdO_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (KV_BLOCK, Q_STEP, self.dv), dt, st)
        self.sdS_layout = self.sdQ_layout = None
        dq_reduce = self.config.dq_reduce
        if dq_reduce:
            # dS as the A of dQ = dS K: (Q_STEP queries, KV_BLOCK keys), queries contiguous
            # (config.ds_buffers of them: a third mode when two)
            self.sdS_layout = sm90_utils.make_smem_layout_a(
                LayoutEnum.COL_MAJOR, (Q_STEP, self.dq_cols, KV_BLOCK), dt, self.config.ds_buffers)
            if self.config.ds_buffers == 1:
                self.sdS_layout = cute.slice_(self.sdS_layout, (None, None, 0))
            # each warp group's dQ product, fp32, in column strips of 8 (32-byte rows, the TMA
            # reduce's box): a warp's accumulator store (8 rows x 8 columns) then covers 64
            # consecutive words, 2 wavefronts; whole 256-byte rows put those 8 rows on the same
            # banks (8 wavefronts), and a swizzle costs address registers the kernel lacks
            strip = 8
            self.sdQ_layout = cute.make_layout(
                (Q_STEP, (strip, self.dq_cols // strip), CONSUMER_WARPGROUPS),
                stride=(strip, (1, Q_STEP * strip), Q_STEP * self.dq_cols))

        @cute.struct
        class SharedStorage:
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            kv_bars: cute.struct.MemRange[cutlass.Int64, 2]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sdO_layout)], 1024]
            if dq_reduce:
                sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sdS_layout)], 1024]
                sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sdQ_layout)], 1024]

        self.shared_storage = SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLse2: cute.Tensor,
                 mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32, scale: Float32,
                 mQNum: Optional[cute.Tensor], mQIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor],
                 mFullIdx: Optional[cute.Tensor], mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor],
                 mM2: Optional[cute.Tensor], mM3: Optional[cute.Tensor], mS0: Optional[cute.Tensor],
                 mS1: Optional[cute.Tensor], mS2: Optional[cute.Tensor], mS3: Optional[cute.Tensor],
                 mdQacc: Optional[cute.Tensor], stream: cuda.CUstream):
        self._setup()
        assert self.shared_storage.size_in_bytes() == smem_bytes(self.problem, self.config, "dkdv")
        check_acc_layout(self._make_mma_t(), (KV_BLOCK, Q_STEP))
        check_acc_layout(self._make_mma_grad(self.dv), (KV_BLOCK, self.dv))

        # TMA views (L, D, H, B): every tile is rows of a head dim
        def rows_major(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

        g2s = cpasync.CopyBulkTensorTileG2SOp()

        def atom(t, layout, rows, d):
            return cpasync.make_tiled_tma_atom(g2s, rows_major(t), layout, (rows, d))

        tma_k, gK = atom(mK, self.sK_layout, KV_BLOCK, self.dqk)
        tma_v, gV = atom(mV, self.sV_layout, KV_BLOCK, self.dv)
        tma_q, gQ = atom(mQ, cute.slice_(self.sQ_layout, (None, None, 0)), Q_STEP, self.dqk)
        tma_do, gdO = atom(mdO, cute.slice_(self.sdO_layout, (None, None, 0)), Q_STEP, self.dv)
        tma_dq, gdQ = None, None
        if const_expr(self.config.dq_reduce):
            check_acc_layout(self._make_mma_dq(), (Q_STEP, self.dq_cols))
            tma_dq, gdQ = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), rows_major(mdQacc),
                                                      cute.slice_(self.sdQ_layout, (None, None, 0)),
                                                      (Q_STEP, self.dq_cols))
        grid = [cute.ceil_div(mK.shape[2], KV_BLOCK), mK.shape[1], mK.shape[0]]
        self.kernel(tma_k, gK, tma_v, gV, tma_q, gQ, tma_do, gdO, mLse2, mDelta, mdK, mdV, scale_log2, scale,
                    mQNum, mQIdx, mFullNum, mFullIdx, mM0, mM1, mM2, mM3, mS0, mS1, mS2, mS3, tma_dq, gdQ,
                    self.sK_layout, self.sV_layout, self.sQ_layout, self.sdO_layout, self.sdS_layout,
                    self.sdQ_layout
                    ).launch(grid=grid, block=[self.config.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    def _walk(self, mQNum, mFullNum, b, head, r, q_len):
        """(mask row z, mask head hm, partial entries, kernel blocks) of query head `head`'s list."""
        zm, hm, n_partial, n_blocks = b, head, Int32(0), cute.ceil_div(q_len, Q_STEP)
        if const_expr(self.blocks.enabled):
            zm, hm = self.blocks.mask_row(mQNum, b, head)
            n_partial, n_blocks = self.blocks.count(mQNum, mFullNum, zm, hm, r)
        return zm, hm, n_partial, n_blocks

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, gK_full: cute.Tensor, tma_v: cute.CopyAtom, gV_full: cute.Tensor,
               tma_q: cute.CopyAtom, gQ_full: cute.Tensor, tma_do: cute.CopyAtom, gdO_full: cute.Tensor,
               mLse2: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32,
               scale: Float32, mQNum: Optional[cute.Tensor], mQIdx: Optional[cute.Tensor],
               mFullNum: Optional[cute.Tensor], mFullIdx: Optional[cute.Tensor], mM0: Optional[cute.Tensor],
               mM1: Optional[cute.Tensor], mM2: Optional[cute.Tensor], mM3: Optional[cute.Tensor],
               mS0: Optional[cute.Tensor], mS1: Optional[cute.Tensor], mS2: Optional[cute.Tensor],
               mS3: Optional[cute.Tensor], tma_dq: Optional[cute.CopyAtom], gdQ_full: Optional[cute.Tensor],
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout,
               sdS_layout: Optional[cute.ComposedLayout], sdQ_layout: Optional[cute.Layout]):
        tidx, _, _ = cute.arch.thread_idx()
        kv_blk, hkv, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        q_len, heads = gQ_full.shape[0], gQ_full.shape[2]
        seq_len, kv_heads = gK_full.shape[0], gK_full.shape[2]
        group = heads // kv_heads
        r = kv_blk * KV_BLOCK // self.problem.sparse_block if const_expr(self.blocks.enabled) else kv_blk
        if warp_idx == 0:
            for a in (tma_k, tma_v, tma_q, tma_do):
                cpasync.prefetch_descriptor(a)
            if const_expr(self.config.dq_reduce):
                cpasync.prefetch_descriptor(tma_dq)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        consumer_warps = 4 * CONSUMER_WARPGROUPS
        kv_pipe = tma_pipeline(storage.kv_bars, 1, cute.size_in_bytes(self.dtype, sK_layout) +
                               cute.size_in_bytes(self.dtype, sV_layout), consumer_warps)
        q_pipe = tma_pipeline(storage.q_bars, self.config.stages, stage_bytes(self.dtype, sQ_layout, sdO_layout),
                              consumer_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                def partition(a, s, g, rows, d):
                    return cpasync.tma_partition(a, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                                 cute.group_modes(cute.local_tile(g, (rows, d), (None,) * 4), 0, 2))

                tKsK, tKgK = partition(tma_k, sK, gK_full, KV_BLOCK, self.dqk)
                tVsV, tVgV = partition(tma_v, sV, gV_full, KV_BLOCK, self.dv)
                tQsQ, tQgQ = partition(tma_q, sQ, gQ_full, Q_STEP, self.dqk)
                tdOsdO, tdOgdO = partition(tma_do, sdO, gdO_full, Q_STEP, self.dv)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_pipe.producer_acquire(kv_state)
                bar = kv_pipe.producer_get_barrier(kv_state)
                cute.copy(tma_k, tKgK[(None, kv_blk, 0, hkv, b)], tKsK, tma_bar_ptr=bar)
                cute.copy(tma_v, tVgV[(None, kv_blk, 0, hkv, b)], tVsV, tma_bar_ptr=bar)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
                for g in range(group):
                    head = hkv * group + g
                    zm, hm, n_partial, n_blocks = self._walk(mQNum, mFullNum, b, head, r, q_len)
                    for j in range(n_blocks):
                        blk, _ = self.blocks.block_at(j, n_partial, zm, hm, r, mQIdx, mFullIdx)
                        q_pipe.producer_acquire(state)
                        bar = q_pipe.producer_get_barrier(state)
                        cute.copy(tma_q, tQgQ[(None, blk, 0, head, b)], tQsQ[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_do, tdOgdO[(None, blk, 0, head, b)], tdOsdO[(None, state.index)],
                                  tma_bar_ptr=bar)
                        q_pipe.producer_commit(state)
                        state.advance()

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            mma_t, mma_dv, mma_dk = self._make_mma_t(), self._make_mma_grad(self.dv), self._make_mma_grad(self.dqk)
            thr_t, thr_dv, thr_dk = mma_t.get_slice(ctid), mma_dv.get_slice(ctid), mma_dk.get_slice(ctid)
            tSrK = mma_t.make_fragment_A(thr_t.partition_A(sK))
            tSrQ = mma_t.make_fragment_B(thr_t.partition_B(sQ))
            tPrV = mma_t.make_fragment_A(thr_t.partition_A(sV))
            tPrdO = mma_t.make_fragment_B(thr_t.partition_B(sdO))
            tVrdO = mma_dv.make_fragment_B(thr_dv.partition_B(transpose_view(sdO)))
            tKrQ = mma_dk.make_fragment_B(thr_dk.partition_B(transpose_view(sQ)))
            tScS = thr_t.partition_C(cute.make_identity_tensor((KV_BLOCK, Q_STEP)))
            tVcV = thr_dv.partition_C(cute.make_identity_tensor((KV_BLOCK, self.dv)))
            tKcK = thr_dk.partition_C(cute.make_identity_tensor((KV_BLOCK, self.dqk)))
            acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_dp = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_dv = cute.make_rmem_tensor(tVcV.shape, Float32)
            acc_dk = cute.make_rmem_tensor(tKcK.shape, Float32)
            acc_dv.fill(0.0)
            acc_dk.fill(0.0)
            r_p = cute.make_rmem_tensor(tScS.shape, self.dtype)
            r_ds = cute.make_rmem_tensor(tScS.shape, self.dtype)
            tVrP = cute.make_tensor(r_p.iterator, acc_as_operand_a(acc_s.layout))
            tKrdS = cute.make_tensor(r_ds.iterator, acc_as_operand_a(acc_dp.layout))
            mask_tensors = (mM0, mM1, mM2, mM3)
            score_tensors = (mS0, mS1, mS2, mS3)
            if const_expr(self.config.dq_reduce):
                wg = wg_idx - 1
                sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
                sdQ_mine = storage.sdQ.get_tensor(sdQ_layout)[(None, None, wg)]
                mma_dq = self._make_mma_dq()
                thr_dq = mma_dq.get_slice(ctid % 128)
                tdSsdS = thr_t.partition_C(transpose_view(sdS))  # where this thread's dS^T values go
                # the warp group's columns of dQ over all keys (128/128), or all columns over its own
                # keys (64/64): tiles of dS (queries, keys) and of K^T (columns, keys)
                split_keys = self.dq_keys < KV_BLOCK
                dq_tile = 0 if split_keys else wg  # the column tile of dq_acc it adds to
                key_tile = wg if split_keys else 0
                ds_tile = (0, key_tile) if const_expr(self.config.ds_buffers == 1) else (0, key_tile, None)
                tQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(cute.local_tile(sdS, (Q_STEP, self.dq_keys), ds_tile)))
                k_cols = cute.local_tile(transpose_view(sK), (self.dq_cols, self.dq_keys), (dq_tile, key_tile))
                tQrK = mma_dq.make_fragment_B(thr_dq.partition_B(k_cols))
                tQsdQ = thr_dq.partition_C(sdQ_mine)
                acc_dq = cute.make_rmem_tensor(tQsdQ.shape, Float32)
                gdQ = cute.local_tile(gdQ_full, (Q_STEP, self.dq_cols), (None, None, None, None))
                tdQs, tdQg = cpasync.tma_partition(tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ_mine, 0, 2),
                                                   cute.group_modes(gdQ, 0, 2))
                consumers = pipeline.NamedBarrier(barrier_id=barriers.ATTENTION_CONSUMERS, num_threads=256)
                stage = pipeline.NamedBarrier(barrier_id=barriers.backward_dq_stage(wg), num_threads=128)

            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_pipe.consumer_wait(kv_state)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
            operands = (tSrK, tSrQ, tPrV, tPrdO, tVrP, tVrdO, tKrdS, tKrQ)
            for g in range(group):
                head = hkv * group + g
                zm, hm, n_partial, n_blocks = self._walk(mQNum, mFullNum, b, head, r, q_len)
                if const_expr(not self.config.overlap):
                    for j in range(n_blocks):
                        blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mQIdx, mFullIdx)
                        q_pipe.consumer_wait(read)
                        if const_expr(self.exp_under_dp):  # P^T while dP^T still computes
                            gemm_ss(self._make_mma_t(), acc_s, operands[0], operands[1], read.index)  # K, Q
                            warpgroup.commit_group()
                            gemm_ss(self._make_mma_t(), acc_dp, operands[2], operands[3], read.index)  # V, dO
                            warpgroup.commit_group()
                            warpgroup.wait_group(1)  # S^T
                            self._softmax_grad(acc_s, acc_dp, tScS, scale_log2, mLse2, mDelta, b, head, kv_blk,
                                               seq_len, blk, q_len, partial, mask_tensors, scale, score_tensors, "p")
                            wait_after_all(acc_s)  # ptxas would wait for dP before the exponentials
                            warpgroup.wait_group(0)  # dP^T
                            self._softmax_grad(acc_s, acc_dp, tScS, scale_log2, mLse2, mDelta, b, head, kv_blk,
                                               seq_len, blk, q_len, partial, mask_tensors, scale, score_tensors, "ds")
                        else:
                            self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            self._softmax_grad(acc_s, acc_dp, tScS, scale_log2, mLse2, mDelta, b, head, kv_blk,
                                               seq_len, blk, q_len, partial, mask_tensors, scale, score_tensors)
                        if const_expr(self.config.dq_reduce):
                            zero_past_end(acc_dp, tScS, kv_blk * KV_BLOCK, seq_len)
                        r_p.store(acc_s.load().to(self.dtype))
                        r_ds.store(acc_dp.load().to(self.dtype))
                        if const_expr(self.config.dq_reduce and self.config.ds_buffers == 2):
                            # dS^T into this block parity's buffer: both warp groups' dQ products of
                            # two blocks ago read it before either passed the last block's meeting
                            buf = read.count % 2
                            cute.autovec_copy(r_ds, tdSsdS[(None, None, None, buf)])
                            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, WGMMA reads
                            self._issue_dv_dk(acc_dv, acc_dk, operands, read.index)
                            warpgroup.commit_group()
                            consumers.arrive_and_wait()  # the buffer holds both warp groups' keys
                            gemm_ss(self._make_mma_dq(), acc_dq, tQrdS, tQrK, a_stage=buf)
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            self._reduce_dq(acc_dq, scale, tQsdQ, stage, tma_dq, tdQs, tdQg, warp_idx, blk, dq_tile,
                                            head, b)
                        elif const_expr(self.config.dq_reduce):
                            # dS^T into shared memory for this block's dQ (scaled at its staging)
                            consumers.arrive_and_wait()  # both warp groups' previous dQ products are done
                            cute.autovec_copy(r_ds, tdSsdS)
                            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, WGMMA reads
                            # dQ first, so that its staging and reduce run under dV and dK (groups
                            # complete in order: waiting for dQ alone needs it committed first)
                            consumers.arrive_and_wait()  # sdS holds both warp groups' keys
                            gemm_ss(self._make_mma_dq(), acc_dq, tQrdS, tQrK)
                            warpgroup.commit_group()
                            self._issue_dv_dk(acc_dv, acc_dk, operands, read.index)
                            warpgroup.commit_group()
                            warpgroup.wait_group(1)  # dQ
                            self._reduce_dq(acc_dq, scale, tQsdQ, stage, tma_dq, tdQs, tdQg, warp_idx, blk, dq_tile,
                                            head, b)
                        else:
                            self._issue_dv_dk(acc_dv, acc_dk, operands, read.index)
                            warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        q_pipe.consumer_release(read)
                        read.advance()
                else:
                    # block j's S^T and dP^T are issued with block j - 1's dV and dK; j's
                    # elementwise math runs while those accumulate (fp32 in place: P^T and dS^T
                    # of j - 1 stay in r_p and r_ds until their products are done)
                    if n_blocks > 0:
                        blk, partial = self.blocks.block_at(0, n_partial, zm, hm, r, mQIdx, mFullIdx)
                        q_pipe.consumer_wait(read)
                        self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        self._softmax_grad(acc_s, acc_dp, tScS, scale_log2, mLse2, mDelta, b, head, kv_blk, seq_len,
                                           blk, q_len, partial, mask_tensors, scale, score_tensors)
                        r_p.store(acc_s.load().to(self.dtype))
                        r_ds.store(acc_dp.load().to(self.dtype))
                        read.advance()
                        for j in range(1, n_blocks):
                            blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mQIdx, mFullIdx)
                            q_pipe.consumer_wait(read)
                            self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                            warpgroup.commit_group()
                            self._issue_dv_dk(acc_dv, acc_dk, operands, release.index)
                            warpgroup.commit_group()
                            warpgroup.wait_group(1)  # S^T and dP^T of block j
                            self._softmax_grad(acc_s, acc_dp, tScS, scale_log2, mLse2, mDelta, b, head, kv_blk,
                                               seq_len, blk, q_len, partial, mask_tensors, scale, score_tensors)
                            warpgroup.wait_group(0)  # dV and dK of block j - 1: r_p, r_ds and its stage are free
                            q_pipe.consumer_release(release)
                            release.advance()
                            r_p.store(acc_s.load().to(self.dtype))
                            r_ds.store(acc_dp.load().to(self.dtype))
                            read.advance()
                        self._issue_dv_dk(acc_dv, acc_dk, operands, release.index)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        q_pipe.consumer_release(release)
                        release.advance()
            if const_expr(self.config.dq_reduce):
                if warp_idx % 4 == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # the last reduces are done
            row0 = kv_blk * KV_BLOCK
            store_rows(acc_dk, tKcK, scale, self.dtype, mdK, b, hkv, row0, seq_len)
            store_rows(acc_dv, tVcV, Float32(1.0), self.dtype, mdV, b, hkv, row0, seq_len)

    def _issue_s_dp(self, acc_s, acc_dp, operands: tuple, stage):
        """Issue S^T = K Q^T and dP^T = V dO^T of the (Q, dO) block in ring stage `stage`."""
        tSrK, tSrQ, tPrV, tPrdO = operands[:4]
        gemm_ss(self._make_mma_t(), acc_s, tSrK, tSrQ, stage)
        gemm_ss(self._make_mma_t(), acc_dp, tPrV, tPrdO, stage)

    def _issue_dv_dk(self, acc_dv, acc_dk, operands: tuple, stage):
        """Issue dV += P^T dO and dK += dS^T Q (P^T, dS^T in registers) of ring stage `stage`."""
        tVrP, tVrdO, tKrdS, tKrQ = operands[4:]
        gemm_rs(self._make_mma_grad(self.dv), acc_dv, tVrP, tVrdO, stage)
        gemm_rs(self._make_mma_grad(self.dqk), acc_dk, tKrdS, tKrQ, stage)

    @cute.jit
    def _reduce_dq(self, acc_dq: cute.Tensor, scale: Float32, tQsdQ: cute.Tensor, stage: pipeline.NamedBarrier,
                   tma_dq: cute.CopyAtom, tdQs: cute.Tensor, tdQg: cute.Tensor, warp_idx: Int32, blk: Int32,
                   dq_tile: Int32, head: Int32, b: Int32):
        """This warp group's dQ product, times scale, into its staging tile, added to dq_acc by one
        TMA reduce."""
        for v in cutlass.range(cute.size(acc_dq), unroll_full=True):
            acc_dq[v] = acc_dq[v] * scale
        leader = warp_idx % 4 == 0
        if leader:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous reduce has read the tile
        stage.arrive_and_wait()
        cute.autovec_copy(acc_dq, tQsdQ)
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, read by the TMA unit
        stage.arrive_and_wait()
        if leader:
            cute.copy(tma_dq, tdQs, tdQg[(None, blk, dq_tile, head, b)])
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _softmax_grad(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, tScS: cute.Tensor, scale_log2: Float32,
                      mLse2: cute.Tensor, mDelta: cute.Tensor, b: Int32, head: Int32, kv_blk: Int32, seq_len: Int32,
                      blk: Int32, q_len: Int32, partial, mask_tensors: tuple, scale: Float32, score_tensors: tuple,
                      half: cutlass.Constexpr = ""):
        """S^T becomes P^T = 2^(x - lse2[q]) (0 where masked) and dP^T becomes dS^T = P^T (dP^T -
        delta[q]), in place; x = s scale_log2, or with a score program score_mod(s scale) log2(e),
        and then dS^T is also multiplied by the score_mod's derivative (0 where P is). exp_under_dp
        (no score program) takes it in two halves: `half` "p" only P^T, while dP^T still computes,
        then "ds" dS^T from that P^T."""
        q0 = blk * Q_STEP
        if const_expr(half == "ds"):
            for v in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_dp[v] = acc_s[v] * (acc_dp[v] - mDelta[(b, head, q0 + tScS[v][1])])
            return
        if const_expr(self.score_grad is None):
            acc_s.store(acc_s.load() * scale_log2)
        else:
            tensors = [t for t in score_tensors if t is not None]
            key0 = kv_blk * KV_BLOCK
            for v in cutlass.range(cute.size(acc_s), unroll_full=True):
                q = q0 + tScS[v][1]
                self.score_grad.element(acc_s, acc_dp, v, scale, b, head, q, key0 + tScS[v][0],
                                        mDelta[(b, head, q)], tensors)
                # padding queries: the score_mod of their zero rows may not be finite, and their
                # P must be 0 (dK and dV of real keys sum over them)
                acc_s[v] = cutlass.select_(q < q_len, acc_s[v], Float32(NEG_INF))
        if const_expr(self.mods.mask_fn is not None):
            if partial:
                self.mods.mask_transposed(acc_s, tScS, b, head, kv_blk * KV_BLOCK, seq_len, q0, q_len, mask_tensors)
        for v in cutlass.range(cute.size(acc_s), unroll_full=True):
            q = q0 + tScS[v][1]
            p = cute.math.exp2(acc_s[v] - mLse2[(b, head, q)], fastmath=True)
            acc_s[v] = p
            if const_expr(half != "p"):  # (with "p", dS^T comes later)
                if const_expr(self.score_grad is None):
                    acc_dp[v] = p * (acc_dp[v] - mDelta[(b, head, q)])
                else:  # a masked element's derivative may be inf or NaN: its dS is 0
                    acc_dp[v] = cutlass.select_(p == Float32(0.0), Float32(0.0), p * acc_dp[v])


@cute.jit
def zero_past_end(acc: cute.Tensor, tScS: cute.Tensor, row0: Int32, seq_len: Int32):
    """dS^T of keys past the end set to 0 (dq_reduce: their zero-filled K rows would turn a
    non-finite P of a zero score into NaN in dQ)."""
    if row0 + KV_BLOCK > seq_len:
        for v in cutlass.range(cute.size(acc), unroll_full=True):
            if row0 + tScS[v][0] >= seq_len:
                acc[v] = Float32(0.0)


def build(**params):
    """(jit function, fake arguments) for cute.compile from a dK/dV spec's parameters
    (flex_backward_config.specs); see the module docstring for conventions."""
    problem, config = from_params(params)
    err = config_error(config, problem)
    if err:
        raise ValueError(err)
    dqk, dv = problem.head_dim_qk, problem.head_dim_v
    dt = CUTE_DTYPES[problem.dtype_name]
    B, Hq, Hkv, Lq, Lkv, Lpad = (cute.sym_int() for _ in range(6))

    q = fake.strided(dt, (B, Hq, Lq, dqk))
    k = fake.strided(dt, (B, Hkv, Lkv, dqk))
    v = fake.strided(dt, (B, Hkv, Lkv, dv))
    grad_out = fake.strided(dt, (B, Hq, Lq, dv))
    lse2 = fake.compact(Float32, (B, Hq, Lpad))
    delta = fake.compact(Float32, (B, Hq, Lpad))
    dk = fake.compact(dt, (B, Hkv, Lkv, dqk), aligned=True)
    dv_ = fake.compact(dt, (B, Hkv, Lkv, dv), aligned=True)
    block_mask = fake.block_mask(problem.sparse_block > 0)
    masks = fake.captured(problem.mask_dtypes)
    score_tensors = fake.captured(problem.score_dtypes)
    dq_acc = fake.compact(Float32, (B, Hq, Lpad, dqk), aligned=True) if config.dq_reduce else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return FlexBackwardSm90(problem, config), (q, k, v, grad_out, lse2, delta, dk, dv_, Float32(1.0), Float32(1.0),
                                               *block_mask, *masks, *score_tensors, dq_acc, stream)
