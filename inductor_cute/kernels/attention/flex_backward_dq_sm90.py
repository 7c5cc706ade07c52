"""Attention backward for Hopper (sm_90a) in CuTe DSL, dQ (flex_backward_config.py has the whole
schedule and why dQ has its own kernel).

    dQ[i] = scale sum_k dS[i, k] K[k]    dS = P (dO[i] . V[k] - delta[i])    P = 2^(x - lse2[i])

One CTA per (DQ_Q_BLOCK = 128 query rows, query head, batch), 384 threads in three warp groups,
laid out as the forward's (flex_prefill_sm90.py):

  * warp group 0, the producer, gives registers back; one warp loads the CTA's Q and dO tiles once
    (TMA, one mbarrier), then (K, V) of each KV block of DQ_KV_STEP keys into a `dq_stages`-deep ring.
  * warp groups 1 and 2, the consumers, own 64 query rows each and keep their dQ in fp32
    registers. Per KV block: S = Q K^T and dP = dO V^T (SS WGMMA), the scores masked as in the
    forward (mask.py ScoreMods.apply: the mask program on partial blocks, keys past the end at
    -inf), P = 2^(x - lse2) and dS = P (dP - delta) in place, dS converted to 16 bits as the A
    operand of dQ += dS K (RS WGMMA, K read MN-major from the same shared memory).
  * the epilogue scales dQ by `scale` and stores the rows below the query length.

A first version: by default the products and the elementwise math run one after the other;
with config.dq_overlap block j's S and dP are issued with block j - 1's dQ product and j's math
runs under it.

A block mask (sparse_block > 0): the forward's lists, kv_indices[z, hm, r, :kv_num_blocks] then
full_kv_indices (r the mask query block of the CTA's rows), each mask block cut into
sparse_block / DQ_KV_STEP kernel blocks.

Tensor conventions: as flex_backward_sm90.py, and dq (B, Hq, Lq, Dqk) contiguous in q's dtype;
kv_num_blocks, full_kv_num_blocks (Z, H, Qb) and kv_indices, full_kv_indices (Z, H, Qb, C) int32.
Exported entry: kernel(q, k, v, grad_out, lse2, delta, dq, scale_log2, scale, kv_num_blocks,
kv_indices, full_kv_num_blocks, full_kv_indices, m0, m1, m2, m3, s0, s1, s2, s3).
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

from .accumulator import acc_as_operand_a, check_acc_layout, row_half, wait_after_all
from .backward_tiles import gemm_rs, gemm_ss, store_rows, transpose_view
from ..common.tma_pipeline import stage_bytes, tma_pipeline
from . import fake_operands as fake
from .block_sparse import BlockSparse
from .flex_backward_config import (CONSUMER_WARPGROUPS, DQ_KV_STEP, DQ_Q_BLOCK, FlexBackwardConfig,
                                   FlexBackwardProblem, config_error, from_params, smem_bytes)
from .fake_operands import CUTE_DTYPES
from .mask import ScoreGrad, ScoreMods, mask_past_end
from .pack_gqa import PackGQA

K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN


class FlexBackwardDqSm90:
    def __init__(self, problem: FlexBackwardProblem, config: FlexBackwardConfig):
        self.problem, self.config = problem, config
        self.dtype = CUTE_DTYPES[problem.dtype_name]
        self.dqk, self.dv = problem.head_dim_qk, problem.head_dim_v
        self.producer_regs = 24  # as the forward: 24 * 128 + 240 * 256 = 168 * 384
        self.consumer_regs = 240
        self.mods = ScoreMods("", (), problem.mask_program, problem.mask_dtypes, DQ_KV_STEP, PackGQA(1))
        self.score_grad = ScoreGrad(problem.score_program, problem.score_dtypes) if problem.score_program else None
        self.exp_under_dp = config.exp_under_dp  # (config_error: no score program, sequential schedule)
        self.blocks = BlockSparse(problem.sparse_block, DQ_KV_STEP)

    def _make_mma_s(self):
        """S = Q K^T and dP = dO V^T: (DQ_Q_BLOCK x DQ_KV_STEP), both operands K-major."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                 (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, DQ_KV_STEP))

    def _make_mma_dq(self):
        """dQ += dS K: dS from registers, K MN-major."""
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                 (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.dqk),
                                                 a_source=warpgroup.OperandSource.RMEM)

    def _setup(self):
        dt, st = self.dtype, self.config.dq_stages

        def resident(d):
            return cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (DQ_Q_BLOCK, DQ_KV_STEP, d), dt, 1),
                               (None, None, 0))

        self.sQ_layout, self.sdO_layout = resident(self.dqk), resident(self.dv)
        self.sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (DQ_Q_BLOCK, DQ_KV_STEP, self.dqk), dt,
                                                       st)
        self.sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (DQ_Q_BLOCK, DQ_KV_STEP, self.dv), dt, st)

        @cute.struct
        class SharedStorage:
            kv_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            q_bars: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]

        self.shared_storage = SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLse2: cute.Tensor,
                 mDelta: cute.Tensor, mdQ: cute.Tensor, scale_log2: Float32, scale: Float32,
                 mKvNum: Optional[cute.Tensor], mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor],
                 mFullIdx: Optional[cute.Tensor], mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor],
                 mM2: Optional[cute.Tensor], mM3: Optional[cute.Tensor], mS0: Optional[cute.Tensor],
                 mS1: Optional[cute.Tensor], mS2: Optional[cute.Tensor], mS3: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        self._setup()
        assert self.shared_storage.size_in_bytes() == smem_bytes(self.problem, self.config, "dq")
        check_acc_layout(self._make_mma_s(), (DQ_Q_BLOCK, DQ_KV_STEP))
        check_acc_layout(self._make_mma_dq(), (DQ_Q_BLOCK, self.dqk))

        def rows_major(t):  # TMA views (L, D, H, B)
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

        g2s = cpasync.CopyBulkTensorTileG2SOp()

        def atom(t, layout, rows, d):
            return cpasync.make_tiled_tma_atom(g2s, rows_major(t), layout, (rows, d))

        tma_q, gQ = atom(mQ, self.sQ_layout, DQ_Q_BLOCK, self.dqk)
        tma_do, gdO = atom(mdO, self.sdO_layout, DQ_Q_BLOCK, self.dv)
        tma_k, gK = atom(mK, cute.slice_(self.sK_layout, (None, None, 0)), DQ_KV_STEP, self.dqk)
        tma_v, gV = atom(mV, cute.slice_(self.sV_layout, (None, None, 0)), DQ_KV_STEP, self.dv)
        grid = [cute.ceil_div(mQ.shape[2], DQ_Q_BLOCK), mQ.shape[1], mQ.shape[0]]
        self.kernel(tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV, mLse2, mDelta, mdQ, scale_log2, scale,
                    mKvNum, mKvIdx, mFullNum, mFullIdx, mM0, mM1, mM2, mM3, mS0, mS1, mS2, mS3,
                    self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout
                    ).launch(grid=grid, block=[self.config.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, gQ_full: cute.Tensor, tma_do: cute.CopyAtom, gdO_full: cute.Tensor,
               tma_k: cute.CopyAtom, gK_full: cute.Tensor, tma_v: cute.CopyAtom, gV_full: cute.Tensor,
               mLse2: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, scale_log2: Float32, scale: Float32,
               mKvNum: Optional[cute.Tensor], mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor],
               mFullIdx: Optional[cute.Tensor], mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor],
               mM2: Optional[cute.Tensor], mM3: Optional[cute.Tensor], mS0: Optional[cute.Tensor],
               mS1: Optional[cute.Tensor], mS2: Optional[cute.Tensor], mS3: Optional[cute.Tensor],
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        q_len, heads = gQ_full.shape[0], gQ_full.shape[2]
        seq_len, kv_heads = gK_full.shape[0], gK_full.shape[2]
        hkv = head // (heads // kv_heads)
        if warp_idx == 0:
            for a in (tma_q, tma_do, tma_k, tma_v):
                cpasync.prefetch_descriptor(a)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        consumer_warps = 4 * CONSUMER_WARPGROUPS
        q_pipe = tma_pipeline(storage.q_bars, 1, cute.size_in_bytes(self.dtype, sQ_layout) +
                              cute.size_in_bytes(self.dtype, sdO_layout), consumer_warps)
        kv_pipe = tma_pipeline(storage.kv_bars, self.config.dq_stages, stage_bytes(self.dtype, sK_layout, sV_layout),
                               consumer_warps)
        cute.arch.mbarrier_init_fence()

        # the CTA's KV blocks: the whole sequence, or the block mask's partial then full blocks of
        # the mask query block holding the CTA's rows
        n_blocks = cute.ceil_div(seq_len, DQ_KV_STEP)
        n_partial = Int32(0)
        zm, hm, r = b, head, m_block * DQ_Q_BLOCK // self.problem.sparse_q_block
        if const_expr(self.blocks.enabled):
            zm, hm = self.blocks.mask_row(mKvNum, b, head)
            n_partial, n_blocks = self.blocks.count(mKvNum, mFullNum, zm, hm, r)
        cute.arch.sync_threads()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                def partition(a, s, g, rows, d):
                    return cpasync.tma_partition(a, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                                 cute.group_modes(cute.local_tile(g, (rows, d), (None,) * 4), 0, 2))

                tQsQ, tQgQ = partition(tma_q, sQ, gQ_full, DQ_Q_BLOCK, self.dqk)
                tdOsdO, tdOgdO = partition(tma_do, sdO, gdO_full, DQ_Q_BLOCK, self.dv)
                tKsK, tKgK = partition(tma_k, sK, gK_full, DQ_KV_STEP, self.dqk)
                tVsV, tVgV = partition(tma_v, sV, gV_full, DQ_KV_STEP, self.dv)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                q_pipe.producer_acquire(q_state)
                bar = q_pipe.producer_get_barrier(q_state)
                cute.copy(tma_q, tQgQ[(None, m_block, 0, head, b)], tQsQ, tma_bar_ptr=bar)
                cute.copy(tma_do, tdOgdO[(None, m_block, 0, head, b)], tdOsdO, tma_bar_ptr=bar)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.dq_stages)
                for j in range(n_blocks):
                    blk, _ = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                    kv_pipe.producer_acquire(state)
                    bar = kv_pipe.producer_get_barrier(state)
                    cute.copy(tma_k, tKgK[(None, blk, 0, hkv, b)], tKsK[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_v, tVgV[(None, blk, 0, hkv, b)], tVsV[(None, state.index)], tma_bar_ptr=bar)
                    kv_pipe.producer_commit(state)
                    state.advance()

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            row0 = m_block * DQ_Q_BLOCK
            mma_s, mma_dq = self._make_mma_s(), self._make_mma_dq()
            thr_s, thr_dq = mma_s.get_slice(ctid), mma_dq.get_slice(ctid)
            tSrQ = mma_s.make_fragment_A(thr_s.partition_A(sQ))
            tSrK = mma_s.make_fragment_B(thr_s.partition_B(sK))
            tPrdO = mma_s.make_fragment_A(thr_s.partition_A(sdO))
            tPrV = mma_s.make_fragment_B(thr_s.partition_B(sV))
            tQrK = mma_dq.make_fragment_B(thr_dq.partition_B(transpose_view(sK)))
            tScS = thr_s.partition_C(cute.make_identity_tensor((DQ_Q_BLOCK, DQ_KV_STEP)))
            tQcQ = thr_dq.partition_C(cute.make_identity_tensor((DQ_Q_BLOCK, self.dqk)))
            acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_dp = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_dq = cute.make_rmem_tensor(tQcQ.shape, Float32)
            acc_dq.fill(0.0)
            r_ds = cute.make_rmem_tensor(tScS.shape, self.dtype)
            tQrdS = cute.make_tensor(r_ds.iterator, acc_as_operand_a(acc_dp.layout))
            # the thread's two rows' lse2 and delta (padded: no bounds check)
            lse2 = cute.make_rmem_tensor((2,), Float32)
            delta = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                lse2[h] = mLse2[(b, head, row0 + tScS[0][0] + 8 * h)]
                delta[h] = mDelta[(b, head, row0 + tScS[0][0] + 8 * h)]
            mask_tensors = (mM0, mM1, mM2, mM3)
            score_tensors = (mS0, mS1, mS2, mS3)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_pipe.consumer_wait(q_state)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.dq_stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.dq_stages)
            operands = (tSrQ, tSrK, tPrdO, tPrV, tQrdS, tQrK)
            if const_expr(not self.config.dq_overlap):
                for j in range(n_blocks):
                    blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                    kv_pipe.consumer_wait(read)
                    if const_expr(self.exp_under_dp):  # P while dP still computes
                        gemm_ss(self._make_mma_s(), acc_s, operands[0], operands[1], read.index)  # Q, K
                        warpgroup.commit_group()
                        gemm_ss(self._make_mma_s(), acc_dp, operands[2], operands[3], read.index)  # dO, V
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)  # S
                        self._scores_grad(acc_s, acc_dp, tScS, scale_log2, b, head, row0, q_len, blk, partial,
                                          seq_len, mask_tensors, lse2, delta, scale, score_tensors, "p")
                        wait_after_all(acc_s)  # ptxas would wait for dP before the exponentials
                        warpgroup.wait_group(0)  # dP
                        self._scores_grad(acc_s, acc_dp, tScS, scale_log2, b, head, row0, q_len, blk, partial,
                                          seq_len, mask_tensors, lse2, delta, scale, score_tensors, "ds")
                    else:
                        self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        self._scores_grad(acc_s, acc_dp, tScS, scale_log2, b, head, row0, q_len, blk, partial,
                                          seq_len, mask_tensors, lse2, delta, scale, score_tensors)
                    r_ds.store(acc_dp.load().to(self.dtype))
                    self._issue_dq(acc_dq, operands, read.index)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    kv_pipe.consumer_release(read)
                    read.advance()
            else:
                # block j's S and dP are issued with block j - 1's dQ product, j's math under it
                if n_blocks > 0:
                    blk, partial = self.blocks.block_at(0, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                    kv_pipe.consumer_wait(read)
                    self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    self._scores_grad(acc_s, acc_dp, tScS, scale_log2, b, head, row0, q_len, blk, partial, seq_len,
                                      mask_tensors, lse2, delta, scale, score_tensors)
                    r_ds.store(acc_dp.load().to(self.dtype))
                    read.advance()
                    for j in range(1, n_blocks):
                        blk, partial = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                        kv_pipe.consumer_wait(read)
                        self._issue_s_dp(acc_s, acc_dp, operands, read.index)
                        warpgroup.commit_group()
                        self._issue_dq(acc_dq, operands, release.index)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)  # S and dP of block j
                        self._scores_grad(acc_s, acc_dp, tScS, scale_log2, b, head, row0, q_len, blk, partial,
                                          seq_len, mask_tensors, lse2, delta, scale, score_tensors)
                        warpgroup.wait_group(0)  # dQ of block j - 1: r_ds and its stage are free
                        kv_pipe.consumer_release(release)
                        release.advance()
                        r_ds.store(acc_dp.load().to(self.dtype))
                        read.advance()
                    self._issue_dq(acc_dq, operands, release.index)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    kv_pipe.consumer_release(release)
            store_rows(acc_dq, tQcQ, scale, self.dtype, mdQ, b, head, row0, q_len)

    def _issue_s_dp(self, acc_s, acc_dp, operands: tuple, stage):
        """Issue S = Q K^T and dP = dO V^T of the (K, V) block in ring stage `stage`."""
        tSrQ, tSrK, tPrdO, tPrV = operands[:4]
        gemm_ss(self._make_mma_s(), acc_s, tSrQ, tSrK, stage)
        gemm_ss(self._make_mma_s(), acc_dp, tPrdO, tPrV, stage)

    def _issue_dq(self, acc_dq, operands: tuple, stage):
        """Issue dQ += dS K (dS in registers) of the K block in ring stage `stage`."""
        tQrdS, tQrK = operands[4:]
        gemm_rs(self._make_mma_dq(), acc_dq, tQrdS, tQrK, stage)

    @cute.jit
    def _scores_grad(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, tScS: cute.Tensor, scale_log2: Float32, b: Int32,
                     head: Int32, row0: Int32, q_len: Int32, blk: Int32, partial, seq_len: Int32, mask_tensors: tuple,
                     lse2: cute.Tensor, delta: cute.Tensor, scale: Float32, score_tensors: tuple,
                     half: cutlass.Constexpr = ""):
        """S of KV block `blk` masked as in the forward (score program, mask program on partial
        blocks, keys past the end), then dP becomes dS = P (dP - delta) with P = 2^(x - lse2),
        times the score program's derivative if there is one (0 where P is). exp_under_dp (no
        score program) takes it in two halves: `half` "p" turns S into P in place, while dP still
        computes, then "ds" dP into dS from that P."""
        if const_expr(half == "ds"):
            for h in cutlass.range_constexpr(2):
                for v in row_half(cute.size(acc_s), h):
                    acc_dp[v] = acc_s[v] * (acc_dp[v] - delta[h])
            return
        if const_expr(self.score_grad is not None):
            tensors = [t for t in score_tensors if t is not None]
            for h in cutlass.range_constexpr(2):
                for v in row_half(cute.size(acc_s), h):
                    self.score_grad.element(acc_s, acc_dp, v, scale, b, head, row0 + tScS[v][0],
                                            blk * DQ_KV_STEP + tScS[v][1], delta[h], tensors)
        # the scores are in log2 units already with a score program (scale_later keeps them)
        self.mods.apply(acc_s, tScS, scale_log2, scale, b, head, row0, q_len, blk, partial, (None,) * 4,
                        mask_tensors, scale_later=self.score_grad is not None)
        mask_past_end(acc_s, tScS, DQ_KV_STEP, blk, seq_len)
        for h in cutlass.range_constexpr(2):
            for v in row_half(cute.size(acc_s), h):
                p = cute.math.exp2(acc_s[v] - lse2[h], fastmath=True)
                if const_expr(half == "p"):
                    acc_s[v] = p
                elif const_expr(self.score_grad is None):
                    acc_dp[v] = p * (acc_dp[v] - delta[h])
                else:  # a masked element's derivative may be inf or NaN: its dS is 0
                    acc_dp[v] = cutlass.select_(p == Float32(0.0), Float32(0.0), p * acc_dp[v])


def build(**params):
    """(jit function, fake arguments) for cute.compile from a dQ spec's parameters
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
    dq = fake.compact(dt, (B, Hq, Lq, dqk), aligned=True)
    block_mask = fake.block_mask(problem.sparse_block > 0)
    masks = fake.captured(problem.mask_dtypes)
    score_tensors = fake.captured(problem.score_dtypes)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return FlexBackwardDqSm90(problem, config), (q, k, v, grad_out, lse2, delta, dq, Float32(1.0), Float32(1.0),
                                                 *block_mask, *masks, *score_tensors, stream)
