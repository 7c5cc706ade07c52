"""Split-KV attention decoding for Hopper (sm_90a) in CuTe DSL: the FlexAttention decode path.

    out[b, h, i] = softmax(scale * q[b, h, i] . k[b, h // G]^T) v[b, h // G]     (G = q_per_kv)

Two kernels launched back to back by one exported function:

  * split kernel, one CTA per (64 packed query rows, KV split, batch * KV head). The rows are
    the G * Lq queries that share a KV head (row p is query head p % G of the group, query
    position p // G: pack_gqa.py), so K and V are read once per split. Warp group 0 is the producer: one
    warp streams (K, V) blocks of the split's KV range into a `stages`-deep TMA ring. The
    consumer warp groups compute S = Q K^T with WGMMA (Q in shared memory), an online softmax
    in fp32 registers with exp2 (softmax.py; scale * log2(e) folded into one multiply), and O += P V with
    P taken straight from registers (RS WGMMA). Each consumer owns head_dim_v / v_warpgroups
    output columns and recomputes S itself: cheaper than passing P between warp groups.
    Partial results go to an fp32 workspace: O_s normalised by its own row sum, and
    lse_s = log2(sum_j exp2(x_j)) in log2 units (x = scaled score * log2(e)).
  * combine kernel (combine.py), one warp per output row: lse = log2(sum_s 2^lse_s),
    out = sum_s 2^(lse_s - lse) O_s, and lse returned in natural-log units (lse * ln 2), the
    units torch.nn.attention.flex_attention returns. Rows with nothing to attend (kv_len 0)
    get out = 0 and lse = -inf, as flex_attention gives.

With a score program (programs/score.py, the flex_attention score_mod; applied by mask.py) the
scores are x = program(score = s * scale, b, h, q, kv) * log2(e) instead of s * scale * log2(e).

With a block mask (sparse_block > 0, flex_attention's BlockMask; block_sparse.py) a CTA walks a list of KV
blocks instead of the whole sequence: the partial blocks kv_indices[z, hm, 0, :kv_num_blocks]
then the full blocks full_kv_indices[z, hm, 0, :full_kv_num_blocks] (z = b % Z, hm = hg % H, as
torch indexes a broadcast mask; query block 0), each mask block cut into sparse_block / kv_block
kernel blocks, the list dealt over splits like the contiguous range. A mask program (the
mask_mod) sets x = -inf where it is False, on partial blocks only (every block without a block
mask); keys at and past the sequence end are masked in any block.

A block mask per query head under GQA (gqa_unpacked) cannot share one block list among a KV
head's query heads: then each CTA serves one query head (its Lq rows; hg, the CTA's head index,
is that query head) and reads K/V head hg // G, once per query head, the query heads of one KV
head running side by side so that L2 serves the repeats. Packed, hg is the KV head.

Tensor conventions (torch order, any strides with the last dim contiguous, 16-byte aligned):
    q (B, Hq, Lq, Dqk)   k (B, Hkv, Lkv, Dqk)   v (B, Hkv, Lkv, Dv)   kv_len (B,) int32 or None
    o_part (S, B, Hq, Lq, Dv) fp32 and lse_part (S, B, Hq, Lq) fp32: workspace, S = #splits
    out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) fp32, both contiguous
    t0..t3: the score program's captured tensors (contiguous 1-D), None past its count
    kv_num_blocks, full_kv_num_blocks (Z, H, Qb) and kv_indices, full_kv_indices (Z, H, Qb, C),
    int32: the block mask (None without one); m0..m3: the mask program's captured tensors
Exported entry: kernel(q, k, v, kv_len_or_None, o_part, lse_part, out, lse, scale_log2, scale,
t0, t1, t2, t3, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, m0, m1, m2, m3);
scale_log2 = scale * log2(e) is used without a score program, scale with one.
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

from ..common import barriers, dependent_launch
from .accumulator import acc_as_operand_a, check_acc_layout, row_half
from ..common.tma_pipeline import stage_bytes, tma_pipeline
from . import fake_operands as fake
from .block_sparse import BlockSparse, deal_over_splits
from .combine import SplitCombine
from .fake_operands import CUTE_DTYPES
from .flex_decode_config import (ROWS, FlexDecodeConfig, FlexDecodeProblem, config_error, from_params, pack_factor,
                                 q_copy_threads_per_row, smem_bytes)
from .mask import ScoreMods, mask_past_end
from .pack_gqa import PackGQA
from .softmax import online_softmax, softmax_finalize, softmax_state


class FlexDecodeSm90:
    def __init__(self, problem: FlexDecodeProblem, config: FlexDecodeConfig):
        self.problem, self.config = problem, config
        self.dtype = CUTE_DTYPES[problem.dtype_name]
        self.dqk, self.dv, self.kvb = problem.head_dim_qk, problem.head_dim_v, config.kv_block
        self.wgs = config.v_warpgroups
        self.consumer_threads = 128 * self.wgs
        self.producer_regs = 40
        self.consumer_regs = 232 if self.wgs == 2 else 240
        self.rows = PackGQA(pack_factor(problem))
        self.mods = ScoreMods(problem.score_program, problem.score_dtypes, problem.mask_program, problem.mask_dtypes,
                              self.kvb, self.rows)
        self.blocks = BlockSparse(problem.sparse_block, self.kvb)
        self.combine = SplitCombine(self.dtype, self.dv)

    def _setup(self):
        dt, st = self.dtype, self.config.stages
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        self.mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32, (1, 1, 1),
                                                        tiler_mn=(ROWS, self.kvb))
        # P is the A operand straight from registers; the consumers split V's columns (N)
        self.mma_pv = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32, (1, self.wgs, 1),
                                                        tiler_mn=(ROWS, self.dv // self.wgs),
                                                        a_source=warpgroup.OperandSource.RMEM)
        self.sQ_layout = cute.slice_(sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (ROWS, self.kvb, self.dqk), dt, 1), (None, None, 0))
        self.sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (ROWS, self.kvb, self.dqk), dt, st)
        self.sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (ROWS, self.dv, self.kvb), dt, st)

        @cute.struct
        class SharedStorage:
            kv_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]

        self.shared_storage = SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKvLen: Optional[cute.Tensor],
                 mOp: cute.Tensor, mLp: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor,
                 scale_log2: Float32, scale: Float32, mT0: Optional[cute.Tensor], mT1: Optional[cute.Tensor],
                 mT2: Optional[cute.Tensor], mT3: Optional[cute.Tensor], mKvNum: Optional[cute.Tensor],
                 mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor], mFullIdx: Optional[cute.Tensor],
                 mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor], mM2: Optional[cute.Tensor],
                 mM3: Optional[cute.Tensor], stream: cuda.CUstream):
        self._setup()
        # config_error budgets with smem_bytes
        assert self.shared_storage.size_in_bytes() == smem_bytes(self.problem, self.config)
        check_acc_layout(self.mma_qk, (ROWS, self.kvb))
        check_acc_layout(self.mma_pv, (ROWS, self.dv // self.wgs))
        # TMA views with the contiguous dim where each operand's MMA wants it:
        # K as (Lkv, Dqk, Hkv, B) (K-major B of S = Q K^T), V as (Dv, Lkv, Hkv, B) (MN-major B of O = P V)
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[2, 3, 1, 0]))
        mV_t = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 2, 1, 0]))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, gK = cpasync.make_tiled_tma_atom(g2s, mK_t, cute.slice_(self.sK_layout, (None, None, 0)),
                                                (self.kvb, self.dqk))
        tma_v, gV = cpasync.make_tiled_tma_atom(g2s, mV_t, cute.slice_(self.sV_layout, (None, None, 0)),
                                                (self.dv, self.kvb))
        batch, q_len = mQ.shape[0], mQ.shape[2]
        row_tiles = cute.ceil_div(self.rows.rows(q_len), ROWS)
        self.split_kernel(mQ, tma_k, gK, tma_v, gV, mKvLen, mOp, mLp, scale_log2, scale, mT0, mT1, mT2, mT3,
                          mKvNum, mKvIdx, mFullNum, mFullIdx, mM0, mM1, mM2, mM3, self.mma_qk, self.mma_pv,
                          self.sQ_layout, self.sK_layout, self.sV_layout
                          ).launch(grid=[row_tiles, mOp.shape[0], batch * (mQ.shape[1] // self.rows.group)],
                                   block=[128 + self.consumer_threads, 1, 1], min_blocks_per_mp=1, stream=stream,
                                   **dependent_launch.LAUNCH)
        rows = batch * mQ.shape[1] * q_len
        self.combine_kernel(mOp, mLp, mOut, mLse).launch(
            grid=self.combine.grid(rows), block=self.combine.block(), stream=stream, **dependent_launch.LAUNCH)

    # ------------------------------------------------------------------------------ split kernel
    @cute.kernel
    def split_kernel(self, mQ: cute.Tensor, tma_k: cute.CopyAtom, gK_full: cute.Tensor, tma_v: cute.CopyAtom,
                     gV_full: cute.Tensor, mKvLen: Optional[cute.Tensor], mOp: cute.Tensor, mLp: cute.Tensor,
                     scale_log2: Float32, scale: Float32, mT0: Optional[cute.Tensor], mT1: Optional[cute.Tensor],
                     mT2: Optional[cute.Tensor], mT3: Optional[cute.Tensor], mKvNum: Optional[cute.Tensor],
                     mKvIdx: Optional[cute.Tensor], mFullNum: Optional[cute.Tensor], mFullIdx: Optional[cute.Tensor],
                     mM0: Optional[cute.Tensor], mM1: Optional[cute.Tensor], mM2: Optional[cute.Tensor],
                     mM3: Optional[cute.Tensor], mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
                     sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        row_tile, split, bh = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        cta_heads = mQ.shape[1] // self.rows.group
        b, hg = bh // cta_heads, bh % cta_heads  # hg: the KV head, or unpacked the query head
        hkv = hg
        if const_expr(self.problem.gqa_unpacked):
            hkv = hg // self.problem.q_per_kv
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        kv_pipe = tma_pipeline(storage.kv_bars, self.config.stages, stage_bytes(self.dtype, sK_layout, sV_layout),
                               4 * self.wgs)
        cute.arch.mbarrier_init_fence()
        dependent_launch.wait_then_release()  # the set-up above overlaps the previous kernel's tail

        # The split's KV blocks: this batch's length cut into blocks (or the block mask's list of
        # partial then full blocks), dealt out evenly over splits.
        seq_len = gK_full.shape[0]
        if const_expr(self.problem.has_kv_len):
            seq_len = cutlass.max(cutlass.min(mKvLen[b], seq_len), 0)
        n_blocks = cute.ceil_div(seq_len, self.kvb)
        n_partial = Int32(0)
        zm, hm = b, hg
        if const_expr(self.blocks.enabled):  # query block 0: every query of a decode CTA is in it
            zm, hm = self.blocks.mask_row(mKvNum, b, hg)
            n_partial, n_blocks = self.blocks.count(mKvNum, mFullNum, zm, hm, 0)
        first_block, my_blocks = deal_over_splits(n_blocks, mOp.shape[0], split)
        cute.arch.sync_threads()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                gK = cute.local_tile(gK_full, (self.kvb, self.dqk), (None, None, None, None))
                gV = cute.local_tile(gV_full, (self.dv, self.kvb), (None, None, None, None))
                tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                   cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                                   cute.group_modes(gV, 0, 2))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
                kv_b = b  # the batch K and V are read from: 0 when every query batch shares one cache
                if const_expr(self.problem.kv_batch_broadcast):
                    kv_b = Int32(0)
                for i in range(my_blocks):
                    blk, _ = self.blocks.block_at(first_block + i, n_partial, zm, hm, 0, mKvIdx, mFullIdx)
                    kv_pipe.producer_acquire(state)
                    bar = kv_pipe.producer_get_barrier(state)
                    cute.copy(tma_k, tKgK[(None, blk, 0, hkv, kv_b)], tKsK[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_v, tVgV[(None, 0, blk, hkv, kv_b)], tVsV[(None, state.index)], tma_bar_ptr=bar)
                    kv_pipe.producer_commit(state)
                    state.advance()

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128  # thread index among the consumers
            n_rows = self.rows.rows(mQ.shape[2])
            row0 = row_tile * ROWS
            self._load_q(mQ, sQ, ctid, b, hg, row0, n_rows)

            thr_qk = mma_qk.get_slice(ctid % 128)  # every consumer computes all of S
            thr_pv = mma_pv.get_slice(ctid)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV))
            tScS = thr_qk.partition_C(cute.make_identity_tensor((ROWS, self.kvb)))
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((ROWS, self.dv)))
            acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
            acc_o = cute.make_rmem_tensor(tOcO.shape, Float32)
            acc_o.fill(0.0)
            r_p = cute.make_rmem_tensor(tScS.shape, self.dtype)
            tOrP = cute.make_tensor(r_p.iterator, acc_as_operand_a(acc_s.layout))
            # Each thread holds two rows of S and O (r and r + 8 of its warp's 16); value v of a
            # fragment belongs to row half (v // 2) % 2 (checked at trace time in __call__).
            row_max, row_sum = softmax_state()

            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.stages)
            for i in range(my_blocks):
                blk, partial = self.blocks.block_at(first_block + i, n_partial, zm, hm, 0, mKvIdx, mFullIdx)
                kv_pipe.consumer_wait(state)
                if const_expr(self.problem.has_kv_len):
                    if (blk + 1) * self.kvb > seq_len:  # a mask's block may lie wholly past the end
                        self._zero_v_tail(sV, state.index, cutlass.max(seq_len - blk * self.kvb, 0), ctid)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    mma_qk.set(warpgroup.Field.ACCUMULATE, kb != 0)
                    cute.gemm(mma_qk, acc_s, tSrQ[(None, None, kb)], tSrK[(None, None, kb, state.index)], acc_s)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mods.apply(acc_s, tScS, scale_log2, scale, b, hg, row0, n_rows, blk, partial,
                                (mT0, mT1, mT2, mT3), (mM0, mM1, mM2, mM3))
                mask_past_end(acc_s, tScS, self.kvb, blk, seq_len)
                online_softmax(acc_s, acc_o, row_max, row_sum)

                r_p.store(acc_s.load().to(self.dtype))
                warpgroup.fence()
                mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(mma_pv, acc_o, tOrP[(None, None, kb)], tOrV[(None, None, kb, state.index)], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                kv_pipe.consumer_release(state)
                state.advance()

            self._store_partials(acc_o, tOcO, row_max, row_sum, mOp, mLp, split, b, hg, row0, n_rows)

    @cute.jit
    def _zero_v_tail(self, sV: cute.Tensor, stage: Int32, valid: Int32, ctid: Int32):
        """Zero the stage's V rows at and past `valid`: with a per-batch kv_len they hold real
        memory (the tensor's bound is the padded length), and P = 0 times a NaN or Inf there
        would still give NaN."""
        sV_stage = sV[(None, None, stage)]
        n_tail = (self.kvb - valid) * self.dv
        for idx in cutlass.range(ctid, n_tail, self.consumer_threads):
            sV_stage[(idx % self.dv, valid + idx // self.dv)] = self.dtype(0.0)
        # generic-proxy stores, read next by WGMMA through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(barrier_id=barriers.ATTENTION_CONSUMERS,
                              num_threads=self.consumer_threads).arrive_and_wait()

    @cute.jit
    def _load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, ctid: Int32, b: Int32, hg: Int32, row0: Int32,
                n_rows: Int32):
        """Gather the tile's packed query rows into shared memory with 16-byte cp.async; rows past
        the last query keep stale data: their outputs are never written."""
        vec = 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
        tpr = q_copy_threads_per_row(self.dqk)
        copy = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((self.consumer_threads // tpr, tpr), order=(1, 0)),
                                       cute.make_layout((1, vec)))
        thr = copy.get_slice(ctid)
        tQsQ = thr.partition_D(sQ)
        tQcQ = thr.partition_D(cute.make_identity_tensor((ROWS, self.dqk)))
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            p = row0 + tQcQ[(0, m, 0)][0]
            if p < n_rows:
                head, pos = self.rows.unpack(p, hg)
                row = mQ[(b, head, pos, None)]
                row = cute.make_tensor(cute.make_ptr(self.dtype, row.iterator.toint(), cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout(self.dqk))
                row_vecs = cute.tiled_divide(row, (vec,))
                for k in cutlass.range_constexpr(cute.size(tQsQ, mode=[2])):
                    cute.copy(atom, row_vecs[(None, tQcQ[(0, 0, k)][1] // vec)], tQsQ[(None, m, k)])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        # cp.async writes through the generic proxy; WGMMA reads through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(barrier_id=barriers.ATTENTION_CONSUMERS,
                              num_threads=self.consumer_threads).arrive_and_wait()

    @cute.jit
    def _store_partials(self, acc_o: cute.Tensor, tOcO: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                        mOp: cute.Tensor, mLp: cute.Tensor, split: Int32, b: Int32, hg: Int32, row0: Int32,
                        n_rows: Int32):
        """O_s = acc / rowsum and lse_s = m + log2(rowsum) for the tile's real rows; an empty row
        (empty split, or everything masked) gives O_s = 0 and lse_s = -inf."""
        for h in cutlass.range_constexpr(2):
            inv, lse2 = softmax_finalize(row_max, row_sum, h)
            p = row0 + tOcO[0][0] + 8 * h
            if p < n_rows:
                head, pos = self.rows.unpack(p, hg)
                o_row = mOp[(split, b, head, pos, None)]
                for v in row_half(cute.size(acc_o), h):
                    o_row[tOcO[v][1]] = acc_o[v] * inv
                if tOcO[0][1] == 0:  # one thread per row, in the first consumer warp group
                    mLp[(split, b, head, pos)] = lse2

    # ------------------------------------------------------------------------------ combine kernel
    @cute.kernel
    def combine_kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor):
        dependent_launch.wait_then_release()
        self.combine.run(mOp, mLp, mOut, mLse)


def build(**params):
    """(jit function, fake arguments) for cute.compile from a spec's parameters (flex_decode_config.spec);
    see the module docstring for conventions."""
    problem, config = from_params(params)
    err = config_error(config, problem)
    if err:
        raise ValueError(err)
    head_dim_qk, head_dim_v = problem.head_dim_qk, problem.head_dim_v
    dt = CUTE_DTYPES[problem.dtype_name]
    # One symbol per extent shared by every tensor, so the FFI checks that they agree.
    B, Hq, Hkv, Lq, Lkv, S = (cute.sym_int() for _ in range(6))

    q = fake.strided(dt, (B, Hq, Lq, head_dim_qk))
    B_kv = 1 if problem.kv_batch_broadcast else B  # one cache shared by every query batch
    k = fake.strided(dt, (B_kv, Hkv, Lkv, head_dim_qk))
    v = fake.strided(dt, (B_kv, Hkv, Lkv, head_dim_v))
    kv_len = fake.compact(Int32, (B,)) if problem.has_kv_len else None
    o_part = fake.compact(Float32, (S, B, Hq, Lq, head_dim_v), aligned=True)
    lse_part = fake.compact(Float32, (S, B, Hq, Lq))
    out = fake.compact(dt, (B, Hq, Lq, head_dim_v), aligned=True)
    lse = fake.compact(Float32, (B, Hq, Lq))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return FlexDecodeSm90(problem, config), (q, k, v, kv_len, o_part, lse_part, out, lse, Float32(1.0),
                                             Float32(1.0), *fake.captured(problem.score_dtypes),
                                             *fake.block_mask(problem.sparse_block > 0),
                                             *fake.captured(problem.mask_dtypes), stream)
