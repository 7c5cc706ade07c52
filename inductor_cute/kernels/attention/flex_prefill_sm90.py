"""Attention prefill forward for Hopper (sm_90a) in CuTe DSL: the FlexAttention prefill path.

    out[b, h, i] = softmax(scale * q[b, h, i] . k[b, h // G]^T) v[b, h // G]     (G = Hq // Hkv)

Tiles of (128 query rows, query head, batch), numbered longest-first within sections of (head,
batch) pairs whose K/V fits in L2 (tile_order.py): one CTA per tile, or (config.persistent_ctas)
that many CTAs each taking every persistent_ctas-th tile (or, config.dynamic_tiles, claiming its
next one from a global counter: tile_claims.py), so that a CTA's producer loads the next
tile's first K/V blocks while its consumers finish the last one (Q follows once O has left Q's
buffer; with config.q_stages = 2 the next Q loads first, into the other of two Q buffers, and O is
staged in a buffer of its own).
384 threads in three warp groups:

  * warp group 0, the producer, gives registers back (setmaxnreg) and one warp issues TMA loads:
    each tile's Q, then (K, V) of each of its KV blocks into a `stages`-deep ring
    (PipelineTmaAsync; K and V of a block share a stage and its mbarrier).
  * warp groups 1 and 2, the consumers, own 64 query rows each (one m64 WGMMA row tile). Per KV
    block j a consumer issues S_j = Q K_j^T (SS WGMMA) and O += P_{j-1} V_{j-1} (RS WGMMA: P
    straight from registers, accumulator.py) back to back, waits for S_j only and turns it into
    P_j while P_{j-1} V_{j-1} runs: score_mod / mask_mod on partial blocks (mask.py), keys past
    the end masked, the online softmax in fp32 registers with exp2 (softmax.py); then it waits for
    P_{j-1} V_{j-1}, frees stage j - 1 and rescales O (ptxas issues that wait before the
    exponentials unless config.early_exps holds it behind the first ones). The two consumers also
    take turns at issuing their WGMMAs (named barriers, ping-pong), so one's softmax runs under the
    other's matmuls. (prefill_consumer.py; with config.overlap_tiles a persistent CTA issues the
    next tile's S_0 with this tile's last P V.)
  * the epilogue (prefill_epilogue.py) normalises O by the row sums and stores it with TMA, in two
    halves of 64 rows (each consumer's own with two Q buffers), and the logsumexp per row in
    natural-log units, (m + log2 l) * ln 2, as flex_attention returns it. Rows with nothing to
    attend get out 0 and lse -inf.

A block mask (sparse_block > 0; block_sparse.py): the CTA walks kv_indices[z, hm, r,
:kv_num_blocks] then full_kv_indices[z, hm, r, :full_kv_num_blocks] (z = b % Z, hm = h % H, r the
mask query block of the CTA's rows), each mask block cut into sparse_block / kv_block kernel
blocks; the mask program runs on partial blocks only. Without a block mask every KV block is
walked and is partial. Causal attention is a block mask (with a mask program for the diagonal).

Tensor conventions (torch order, last dim contiguous, 16-byte aligned, other strides multiples
of 8 elements):
    q (B, Hq, Lq, Dqk)   k (B, Hkv, Lkv, Dqk)   v (B, Hkv, Lkv, Dv)   (k, v of batch 1 with
    kv_batch_broadcast: one cache shared by every query batch)
    out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) fp32, both contiguous
    t0..t3, m0..m3: the score and mask programs' captured tensors (contiguous 1-D), None past
    their count; kv_num_blocks, full_kv_num_blocks (Z, H, Qb) and kv_indices, full_kv_indices
    (Z, H, Qb, C), int32: the block mask (None without one)
    tile_counter: int32 (2,), zero before the launch and left zero (config.dynamic_tiles; None
    without: tile_claims.py)
Exported entry: kernel(q, k, v, out, lse, scale_log2, scale, t0, t1, t2, t3, kv_num_blocks,
kv_indices, full_kv_num_blocks, full_kv_indices, m0, m1, m2, m3, tile_counter); scale_log2 =
scale * log2(e) is used without a score program, scale with one.
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

from .accumulator import acc_as_operand_a, check_acc_layout
from ..common.tma_pipeline import stage_bytes, tma_pipeline
from . import fake_operands as fake
from .block_sparse import BlockSparse
from .fake_operands import CUTE_DTYPES
from .flex_prefill_config import (CONSUMER_WARPGROUPS, M_BLOCK, TILE_CLAIM_STAGES, FlexPrefillConfig,
                                  FlexPrefillProblem, config_error, from_params, smem_bytes)
from .mask import ScoreMods
from .pack_gqa import PackGQA
from .prefill_consumer import PrefillConsumer
from .prefill_epilogue import PrefillEpilogue
from .softmax import softmax_state
from .tile_claims import claim_next, claim_ring, publish, receive, retire
from .tile_order import LongestFirst, section_width



class FlexPrefillSm90(PrefillConsumer):
    def __init__(self, problem: FlexPrefillProblem, config: FlexPrefillConfig):
        self.problem, self.config = problem, config
        self.dtype = CUTE_DTYPES[problem.dtype_name]
        self.dqk, self.dv, self.kvb = problem.head_dim_qk, problem.head_dim_v, config.kv_block
        self.consumer_threads = 128 * CONSUMER_WARPGROUPS
        # The CTA launches with 168 registers per thread (64512 for 384 threads) and setmaxnreg
        # only moves them between warp groups: 24 * 128 + 240 * 256 = 64512, or the consumers'
        # increase would wait for registers nobody gives back.
        self.producer_regs = 24
        self.consumer_regs = 240
        # rows are not packed: a tile's rows are query positions of one head (group 1)
        self.mods = ScoreMods(problem.score_program, problem.score_dtypes, problem.mask_program, problem.mask_dtypes,
                              self.kvb, PackGQA(1))
        self.blocks = BlockSparse(problem.sparse_block, self.kvb)
        # S stays raw until the softmax's exponent (softmax.online_softmax_scores)
        self.fold_scale = not problem.score_program and problem.positive_scale
        self.epilogue = PrefillEpilogue(self.dtype, self.dv, config.q_stages > 1,
                                        lambda: self._make_mma_pv(warpgroups=1))

    # Each consumer warp group owns 64 of the 128 rows. _qk and _pv make their own MMA objects:
    # setting the accumulate flag on one the kernel holds would make it a value carried through
    # the main loop, which the DSL cannot thread out of the loop's nested regions.
    def _make_mma_qk(self):
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, k_major, Float32,
                                                 (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.kvb))

    def _make_mma_pv(self, warpgroups: int = CONSUMER_WARPGROUPS):
        # P is the A operand straight from registers; V is MN-major
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
                                                 cute.nvgpu.OperandMajorMode.MN, Float32, (warpgroups, 1, 1),
                                                 tiler_mn=(64, self.dv), a_source=warpgroup.OperandSource.RMEM)

    def _setup(self):
        dt, st = self.dtype, self.config.stages
        self.mma_qk, self.mma_pv = self._make_mma_qk(), self._make_mma_pv()
        qs = self.config.q_stages
        self.sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (M_BLOCK, self.kvb, self.dqk), dt, qs)
        if const_expr(qs == 1):
            self.sQ_layout = cute.slice_(self.sQ_layout, (None, None, 0))
        self.sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (M_BLOCK, self.kvb, self.dqk), dt, st)
        self.sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (M_BLOCK, self.dv, self.kvb), dt, st)
        # O staged as one (64, Dv) half per consumer warp group (the TMA store's box)
        self.sO_layout = sm90_utils.make_smem_layout_epi(dt, LayoutEnum.ROW_MAJOR, (64, self.dv), CONSUMER_WARPGROUPS)

        split, dynamic = self.config.split_kv, self.config.dynamic_tiles

        @cute.struct
        class SharedStorage:
            kv_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]  # K's ring with split_kv
            if split:
                v_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * qs]
            if dynamic:  # the claimed tiles' ring (tile_claims.py)
                tile_bars: cute.struct.MemRange[cutlass.Int64, 2 * TILE_CLAIM_STAGES]
                tile_ids: cute.struct.MemRange[Int32, TILE_CLAIM_STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sQ_layout)], 1024]
            if qs > 1:  # two Q buffers: O staged in a buffer of its own
                sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]

        self.shared_storage = SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor,
                 scale_log2: Float32, scale: Float32, mT0: Optional[cute.Tensor], mT1: Optional[cute.Tensor],
                 mT2: Optional[cute.Tensor], mT3: Optional[cute.Tensor], mKvNum: Optional[cute.Tensor],
                 mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor], mFullIdx: Optional[cute.Tensor],
                 mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor], mM2: Optional[cute.Tensor],
                 mM3: Optional[cute.Tensor], mTileCounter: Optional[cute.Tensor], stream: cuda.CUstream):
        self._setup()
        # config_error budgets with smem_bytes
        assert self.shared_storage.size_in_bytes() == smem_bytes(self.problem, self.config)
        check_acc_layout(self.mma_qk, (M_BLOCK, self.kvb))
        check_acc_layout(self.mma_pv, (M_BLOCK, self.dv))
        assert cute.cosize(self.sO_layout) <= cute.cosize(self._one_q_layout(self.sQ_layout))  # O may use Q's buffer
        # TMA views with the contiguous dim where each operand's MMA wants it: Q, K and O as
        # (L, D, H, B) (K-major), V as (Dv, Lkv, Hkv, B) (MN-major B of O = P V)
        def rows_major(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

        mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 2, 1, 0]))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, gQ = cpasync.make_tiled_tma_atom(g2s, rows_major(mQ), self._one_q_layout(self.sQ_layout),
                                                (M_BLOCK, self.dqk))
        tma_k, gK = cpasync.make_tiled_tma_atom(g2s, rows_major(mK), cute.slice_(self.sK_layout, (None, None, 0)),
                                                (self.kvb, self.dqk))
        tma_v, gV = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.slice_(self.sV_layout, (None, None, 0)),
                                                (self.dv, self.kvb))
        tma_o, gO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), rows_major(mOut),
                                                cute.slice_(self.sO_layout, (None, None, 0)), (64, self.dv))
        tiles = LongestFirst(cute.ceil_div(mQ.shape[2], M_BLOCK), mQ.shape[1], mQ.shape[0])
        ctas = tiles.count()
        if const_expr(self.config.persistent_ctas > 0):
            ctas = cutlass.min(ctas, self.config.persistent_ctas)
        self.kernel(tma_q, gQ, tma_k, gK, tma_v, gV, tma_o, gO, mLse, scale_log2, scale, mT0, mT1, mT2, mT3,
                    mKvNum, mKvIdx, mFullNum, mFullIdx, mM0, mM1, mM2, mM3, mTileCounter, self.mma_qk, self.mma_pv,
                    self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout
                    ).launch(grid=[ctas, 1, 1], block=[self.config.threads, 1, 1], min_blocks_per_mp=1,
                             stream=stream)

    def _one_q_layout(self, sQ_layout):
        """One Q buffer's layout (sQ_layout has a stage mode with two)."""
        if const_expr(self.config.q_stages == 1):
            return sQ_layout
        return cute.slice_(sQ_layout, (None, None, 0))

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, gQ_full: cute.Tensor, tma_k: cute.CopyAtom, gK_full: cute.Tensor,
               tma_v: cute.CopyAtom, gV_full: cute.Tensor, tma_o: cute.CopyAtom, gO_full: cute.Tensor,
               mLse: cute.Tensor, scale_log2: Float32, scale: Float32, mT0: Optional[cute.Tensor],
               mT1: Optional[cute.Tensor], mT2: Optional[cute.Tensor], mT3: Optional[cute.Tensor],
               mKvNum: Optional[cute.Tensor], mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor],
               mFullIdx: Optional[cute.Tensor], mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor],
               mM2: Optional[cute.Tensor], mM3: Optional[cute.Tensor], mTileCounter: Optional[cute.Tensor],
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        first_tile, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        q_len, heads, batch = gQ_full.shape[0], gQ_full.shape[2], gQ_full.shape[3]
        seq_len, kv_heads = gK_full.shape[0], gK_full.shape[2]
        q_per_kv = heads // kv_heads
        width = section_width(seq_len, (self.dqk + self.dv) * self.dtype.width // 8, q_per_kv)
        m_blocks = cute.ceil_div(q_len, M_BLOCK)
        n_tiles = LongestFirst(m_blocks, heads, batch).count()  # (the DSL carries no Python object into ifs)
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.config.q_stages == 1):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # O is staged where Q was
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        consumer_warps = 4 * CONSUMER_WARPGROUPS
        if const_expr(self.config.split_kv):  # K's ring and V's, as kv_pipe and v_pipe
            kv_pipe = tma_pipeline(storage.kv_bars, self.config.stages, stage_bytes(self.dtype, sK_layout),
                                   consumer_warps)
            v_pipe = tma_pipeline(storage.v_bars, self.config.stages, stage_bytes(self.dtype, sV_layout),
                                  consumer_warps)
        else:
            kv_pipe = tma_pipeline(storage.kv_bars, self.config.stages, stage_bytes(self.dtype, sK_layout, sV_layout),
                                   consumer_warps)
            v_pipe = kv_pipe
        q_bytes = cute.size_in_bytes(self.dtype, self._one_q_layout(sQ_layout))
        q_pipe = tma_pipeline(storage.q_bars, self.config.q_stages, q_bytes, consumer_warps)
        ring, tile_ids = None, None
        if const_expr(self.config.dynamic_tiles):
            ring = claim_ring(storage.tile_bars, self.consumer_threads)
            tile_ids = storage.tile_ids.get_tensor(cute.make_layout(TILE_CLAIM_STAGES))
        cute.arch.mbarrier_init_fence()

        cute.arch.sync_threads()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                gQ = cute.local_tile(gQ_full, (M_BLOCK, self.dqk), (None, None, None, None))
                gK = cute.local_tile(gK_full, (self.kvb, self.dqk), (None, None, None, None))
                gV = cute.local_tile(gV_full, (self.dv, self.kvb), (None, None, None, None))
                tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                   cute.group_modes(gQ, 0, 2))
                tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                   cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                   cute.group_modes(gV, 0, 2))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.q_stages)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
                claims = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_CLAIM_STAGES)
                tile = first_tile
                while tile < n_tiles:
                    m_block, head, b = LongestFirst(m_blocks, heads, batch, width).coord(tile)
                    hkv = head // q_per_kv
                    b_kv = Int32(0) if const_expr(self.problem.kv_batch_broadcast) else b  # one shared cache
                    # A CTA's first Q goes first. Later, with one Q buffer, the ring's first
                    # `stages` blocks of a tile load as the last tile's blocks are freed, under its
                    # epilogue; Q then waits for that epilogue (O leaves through Q's buffer), and
                    # must come before any later block: the consumers free those only once they
                    # have Q. With two Q buffers the other one is free: Q always goes first.
                    later = tile != first_tile
                    if const_expr(self.config.q_stages > 1):
                        later = cutlass.Boolean(False)
                    if not later:  # (before the block mask's counts: Q's load need not wait for them)
                        self._load_q(q_pipe, q_state, tma_q, tQgQ, tQsQ, m_block, head, b)
                        q_state.advance()
                    n_partial, n_blocks, zm, hm, r = self._kv_walk(mKvNum, mFullNum, seq_len, m_block, head, b)
                    prev_blk = Int32(0)  # split_kv: the block whose V follows the next K
                    for j in range(n_blocks):
                        if later and j == self.config.stages:
                            self._load_q(q_pipe, q_state, tma_q, tQgQ, tQsQ, m_block, head, b)
                            q_state.advance()
                        blk, _ = self.blocks.block_at(j, n_partial, zm, hm, r, mKvIdx, mFullIdx)
                        kv_pipe.producer_acquire(state)
                        bar = kv_pipe.producer_get_barrier(state)
                        cute.copy(tma_k, tKgK[(None, blk, 0, hkv, b_kv)], tKsK[(None, state.index)], tma_bar_ptr=bar)
                        if const_expr(not self.config.split_kv):
                            cute.copy(tma_v, tVgV[(None, 0, blk, hkv, b_kv)], tVsV[(None, state.index)],
                                      tma_bar_ptr=bar)
                        kv_pipe.producer_commit(state)
                        state.advance()
                        if const_expr(self.config.split_kv):  # V_{j-1} after K_j: the order they are used
                            if j > 0:
                                self._load_v(v_pipe, v_state, tma_v, tVgV, tVsV, prev_blk, hkv, b_kv)
                                v_state.advance()
                            prev_blk = blk
                    if const_expr(self.config.split_kv):
                        if n_blocks > 0:
                            self._load_v(v_pipe, v_state, tma_v, tVgV, tVsV, prev_blk, hkv, b_kv)
                            v_state.advance()
                    if later and n_blocks <= self.config.stages:
                        self._load_q(q_pipe, q_state, tma_q, tQgQ, tQsQ, m_block, head, b)
                        q_state.advance()
                    if const_expr(self.config.dynamic_tiles):  # the next tile, for the consumers too
                        tile = claim_next(mTileCounter, ctas)
                        publish(ring, claims, tile_ids, tile)
                        claims.advance()
                    else:
                        tile += ctas
                if const_expr(self.config.dynamic_tiles):
                    retire(mTileCounter, ctas)

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            slot = wg_idx - 1
            ctid = tidx - 128  # thread index among the consumers: slot s owns rows 64 s .. 64 s + 63
            thr_qk = mma_qk.get_slice(ctid)
            thr_pv = mma_pv.get_slice(ctid)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV))
            tScS = thr_qk.partition_C(cute.make_identity_tensor((M_BLOCK, self.kvb)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((M_BLOCK, self.dv)))
            acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_o = cute.make_rmem_tensor(tOcO.shape, Float32)
            r_p = cute.make_rmem_tensor(tScS.shape, self.dtype)
            tOrP = cute.make_tensor(r_p.iterator, acc_as_operand_a(acc_s.layout))
            row_max, row_sum = softmax_state()
            correction = cute.make_rmem_tensor((2,), Float32)  # per row half: 2^(m_old - m) for O
            score_tensors, mask_tensors = (mT0, mT1, mT2, mT3), (mM0, mM1, mM2, mM3)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.q_stages)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
            tile_args = ((m_blocks, heads, batch, width), (q_len, seq_len), (mKvNum, mKvIdx, mFullNum, mFullIdx),
                         (q_pipe, kv_pipe, v_pipe), slot, (tSrQ, tSrK, tOrV, tScS, tOcO),
                         (acc_s, acc_o, r_p, tOrP, row_max, row_sum, correction), scale_log2, scale,
                         score_tensors, mask_tensors, (sO, tma_o, gO_full, mLse), ctid, warp_idx)
            if const_expr(self.config.dynamic_tiles):
                claims = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_CLAIM_STAGES)
                tile = first_tile
                while tile < n_tiles:
                    states = [q_state, read, release]
                    self._consume_tile(tile, states, *tile_args)
                    q_state, read, release = states
                    tile = receive(ring, claims, tile_ids)
                    claims.advance()
            elif const_expr(self.config.overlap_tiles):
                states = [q_state, read, release]
                self._consume_overlapped(first_tile, ctas, n_tiles, states, *tile_args)
                q_state, read, release = states
            elif const_expr(self.config.persistent_ctas > 0):
                for tile in range(first_tile, n_tiles, ctas):
                    # the tile's dynamic ifs and loops rebind its pipeline states to new objects,
                    # so they come back through `states`; assigned here, the loop carries them
                    states = [q_state, read, release]
                    self._consume_tile(tile, states, *tile_args)
                    q_state, read, release = states
            if const_expr(self.config.persistent_ctas > 0 and self.config.q_stages > 1):
                if warp_idx == 4 + 4 * slot:
                    cute.arch.cp_async_bulk_wait_group(0)  # the last O store, before the CTA ends
            if const_expr(self.config.persistent_ctas == 0):
                self._consume_tile(first_tile, [q_state, read, release], *tile_args)

    @cute.jit
    def _kv_walk(self, mKvNum: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor], seq_len: Int32,
                 m_block: Int32, head: Int32, b: Int32):
        """(partial blocks, blocks in all, mask batch, mask head, mask row block) of a tile's KV
        walk: the whole sequence, every block partial, or the block mask's partial then full
        blocks of the mask query block that holds the tile's rows."""
        n_blocks = cute.ceil_div(seq_len, self.kvb)
        n_partial = Int32(0)
        zm, hm, r = b, head, m_block * M_BLOCK // self.problem.sparse_q_block
        if const_expr(self.blocks.enabled):
            zm, hm = self.blocks.mask_row(mKvNum, b, head)
            n_partial, n_blocks = self.blocks.count(mKvNum, mFullNum, zm, hm, r)
        return n_partial, n_blocks, zm, hm, r

    def _load_q(self, q_pipe, q_state, tma_q: cute.CopyAtom, tQgQ: cute.Tensor, tQsQ: cute.Tensor, m_block: Int32,
                head: Int32, b: Int32):
        """The tile's Q into Q's buffer, once the consumers handed it back (producer warp). The
        caller advances q_state: a dynamic if or loop carries only the objects named in its own
        body (assigned, or their methods called), not those a helper advances."""
        q_pipe.producer_acquire(q_state)
        if const_expr(self.config.q_stages > 1):
            tQsQ = tQsQ[(None, q_state.index)]
        cute.copy(tma_q, tQgQ[(None, m_block, 0, head, b)], tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

    def _load_v(self, v_pipe, v_state, tma_v: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor, blk: Int32,
                hkv: Int32, b_kv: Int32):
        """Block `blk`'s V into V's ring (split_kv; producer warp). The caller advances v_state."""
        v_pipe.producer_acquire(v_state)
        cute.copy(tma_v, tVgV[(None, 0, blk, hkv, b_kv)], tVsV[(None, v_state.index)],
                  tma_bar_ptr=v_pipe.producer_get_barrier(v_state))
        v_pipe.producer_commit(v_state)

def build(**params):
    """(jit function, fake arguments) for cute.compile from a spec's parameters (flex_prefill_config.spec);
    see the module docstring for conventions."""
    problem, config = from_params(params)
    err = config_error(config, problem)
    if err:
        raise ValueError(err)
    dqk, dv = problem.head_dim_qk, problem.head_dim_v
    dt = CUTE_DTYPES[problem.dtype_name]
    # One symbol per extent shared by every tensor, so the FFI checks that they agree.
    B, Hq, Hkv, Lq, Lkv = (cute.sym_int() for _ in range(5))

    q = fake.strided(dt, (B, Hq, Lq, dqk))
    B_kv = 1 if problem.kv_batch_broadcast else B  # one cache shared by every query batch
    k = fake.strided(dt, (B_kv, Hkv, Lkv, dqk))
    v = fake.strided(dt, (B_kv, Hkv, Lkv, dv))
    out = fake.compact(dt, (B, Hq, Lq, dv), aligned=True)
    lse = fake.compact(Float32, (B, Hq, Lq))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return FlexPrefillSm90(problem, config), (q, k, v, out, lse, Float32(1.0), Float32(1.0),
                                              *fake.captured(problem.score_dtypes),
                                              *fake.block_mask(problem.sparse_block > 0),
                                              *fake.captured(problem.mask_dtypes),
                                              fake.compact(Int32, (2,)) if config.dynamic_tiles else None, stream)
