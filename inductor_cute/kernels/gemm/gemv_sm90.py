"""Decode GEMM ("GEMV": M <= 16 tokens) for Hopper (sm_90a) in CuTe DSL: a pure weight stream.

    D[m, n] = epilogue_fn(acc = sum_k A[m, k] * W[n, k], alpha, beta, bias[n], C[m, n])

W is an nn.Linear weight (N, K), row-major; it is read from memory exactly once, A (tiny) is
re-read from L2 once per CTA. Same epilogue hook as the GEMM (kernels.gemm.sm90.make_epilogue or
an epilogue program).

Design:
  * Swapped operands: the mma.sync m16n8k16 computes D^T = W A^T, with 16 rows of W as the MMA's
    M and up to 8 tokens as its N, so M = 1..8 wastes nothing (two token tiles cover M <= 16).
  * No shuffles and no ldmatrix: a dot product does not care in which order K is summed, so each
    lane (g = lane / 4, t = lane % 4) takes 8 *consecutive* K elements, one 16-byte vector, of W
    rows g and g + 8 and of A row g, for every 32 K; the first 4 feed one MMA's k slots
    {2t, 2t+1, 2t+8, 2t+9}, the other 4 a second MMA's. Both operands are plain vector loads.
    With `vecs` = 2 a step is 64 K deep and each lane takes vectors t and t + 4 of the step in
    each row (4 MMAs): a warp's two copy instructions per row read 64 contiguous bytes each
    (whole sectors), back to back a whole 128-byte L2 line rather than half of one: for DRAM
    efficiency at large N (perf notes, twelfth session).
  * W streams through a private per-thread cp.async ring in shared memory (`stages` deep): each
    thread waits only for its own copies (cp.async.wait_group), so the mainloop has no barrier.
    The CTA's A slice (8 * m_tiles rows x k_slice) is copied to shared memory once, with the
    first W stage; rows past M repeat row M - 1 (their outputs are never stored), K past the end
    is zero in both A and W.
  * Grid = (N blocks of 16 * warps rows, K splits of k_slice). With one split the CTA applies
    the epilogue itself. Otherwise every CTA writes its fp32 fragments to `partials`, and the
    last CTA to arrive on its N block's counter (atomic, acq_rel, gpu scope) sums all splits'
    fragments in split order (deterministic, run to run) and applies the epilogue; it resets the
    counter to zero, so the counters never need clearing between calls. One kernel, no combine
    launch: a second launch would cost about as much as the whole reduction (~2 us).
  * Several weights sharing A (`weights` = 2 or 3: q/k/v, gate/up of a decode step) in one launch,
    since each launch pays ~4-5 us of ramp on top of its weight stream: the grid's N blocks walk
    W_0's, then W_1's, then W_2's, and a branch on the block runs the one-weight code on its own
    W_i and D_i (so each weight's result is bitwise the one-weight kernel's with the same config).
    Partials and counters span the concatenated block range. Plain epilogue only (no bias or C).

Exported function (TVM-FFI, launches on the current torch stream):

    f(a, w, d, c_or_None, bias_or_None, partials, counters, alpha: float, beta: float)

  a: (M, K) row-major, 16-byte aligned rows    w: (N, K) row-major (the nn.Linear weight)
  d: (M, N) with unit column stride            c: (M, N) with unit column stride (any row
  stride, 0 broadcasts one row)                bias: (N,) contiguous; c, bias in d's dtype
  partials: fp32 (P,), counters: int32 (N blocks,), sized by gemv_config.workspace_sizes and the
  counters zeroed once at allocation. One workspace serves any sequence of calls on one stream;
  calls that may run concurrently (other streams) need their own.
  With several weights, w and d are tuples (w_0, w_1[, w_2]) and (d_0, d_1[, d_2]) of the same
  K and M, each N_i its own; c and bias are None.
"""
from typing import Callable, Optional, Union

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_tensor

from ..common import dependent_launch
from .config import GemmProblem
from .sm90 import CUTE_DTYPES, make_epilogue
from .gemv_config import MAX_REGISTERS, GemvConfig, smem_bytes, unsupported_reason

VEC = 8  # elements per 16-byte vector


class HopperGemv:
    def __init__(self, cfg: GemvConfig, ab_dtype, d_dtype, has_bias: bool, has_c: bool, epilogue_fn: Callable,
                 weights: int = 1):
        self.cfg, self.ab_dtype, self.d_dtype, self.weights = cfg, ab_dtype, d_dtype, weights
        self.has_bias, self.has_c, self.epilogue_fn = has_bias, has_c, epilogue_fn
        self.threads, self.n_block = cfg.threads, cfg.n_block
        self.m_pad = 8 * cfg.m_tiles
        self.vecs = cfg.vecs  # 16-byte vectors per thread, W row and step, K-adjacent
        self.steps = cfg.k_slice // cfg.k_step  # pipeline steps of one full split
        self.frag = 4 * cfg.m_tiles  # fp32 accumulators per thread

    def _shared_storage(self):
        ring = self.cfg.stages * 2 * self.threads * VEC * self.vecs
        a_slice = self.steps * self.m_pad * 4 * VEC * self.vecs

        @cute.struct
        class SharedStorage:
            sW: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, ring], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, a_slice], 16]
            last: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        return SharedStorage

    @cute.jit
    def __call__(self, mA: cute.Tensor, mW: Union[cute.Tensor, tuple], mD: Union[cute.Tensor, tuple],
                 mC: Optional[cute.Tensor], mBias: Optional[cute.Tensor], mPartial: cute.Tensor, mCount: cute.Tensor,
                 alpha: Float32, beta: Float32, stream: cuda.CUstream):
        self.shared_storage = self._shared_storage()
        assert self.shared_storage.size_in_bytes() == smem_bytes(self.cfg, self.ab_dtype.width // 8)
        if const_expr(self.weights == 1):
            n_blocks = cute.ceil_div(mW.shape[0], self.n_block)
            splits = cute.ceil_div(mW.shape[1], self.cfg.k_slice)
        else:  # one grid over every weight's N blocks, in order
            n_blocks = cute.ceil_div(mW[0].shape[0], self.n_block)
            for i in cutlass.range_constexpr(1, self.weights):
                n_blocks = n_blocks + cute.ceil_div(mW[i].shape[0], self.n_block)
            splits = cute.ceil_div(mA.shape[1], self.cfg.k_slice)
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.ab_dtype, Float32, (16, 8, 16)))
        self.kernel(mA, mW, mD, mC, mBias, mPartial, mCount, alpha, beta, mma).launch(
            grid=[n_blocks, splits, 1], block=[self.threads, 1, 1],
            min_blocks_per_mp=65536 // (MAX_REGISTERS * self.threads), preferred_smem_carveout=100, stream=stream,
            **dependent_launch.LAUNCH)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mW: Union[cute.Tensor, tuple], mD: Union[cute.Tensor, tuple],
               mC: Optional[cute.Tensor], mBias: Optional[cute.Tensor], mPartial: cute.Tensor, mCount: cute.Tensor,
               alpha: Float32, beta: Float32, mma: cute.TiledMma):
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)  # once: CTAs run one branch
        dependent_launch.wait_then_release()  # before the first global access (see dependent_launch)
        if const_expr(self.weights == 1):
            self._n_block(mA, mW, mD, mC, mBias, mPartial, mCount, alpha, beta, mma, storage, None)
        else:
            # the grid's N blocks walk W_0's, then W_1's, then W_2's; each branch binds its own
            # weight and output and runs the single-weight code on them
            n_blk = cute.arch.block_idx()[0]
            first1 = cute.ceil_div(mW[0].shape[0], self.n_block)
            common = (mPartial, mCount, alpha, beta, mma, storage)
            if n_blk < first1:
                self._n_block(mA, mW[0], mD[0], None, None, *common, None)
            else:
                if const_expr(self.weights == 2):
                    self._n_block(mA, mW[1], mD[1], None, None, *common, first1)
                else:
                    first2 = first1 + cute.ceil_div(mW[1].shape[0], self.n_block)
                    if n_blk < first2:
                        self._n_block(mA, mW[1], mD[1], None, None, *common, first1)
                    else:
                        self._n_block(mA, mW[2], mD[2], None, None, *common, first2)

    @cute.jit
    def _n_block(self, mA: cute.Tensor, mW: cute.Tensor, mD: cute.Tensor, mC: Optional[cute.Tensor],
                 mBias: Optional[cute.Tensor], mPartial: cute.Tensor, mCount: cute.Tensor,
                 alpha: Float32, beta: Float32, mma: cute.TiledMma, storage, first_blk):
        """One CTA's work: one N block of W over one K split. The block is the grid's less
        `first_blk`, W's first block in the grid (None: 0); partials and arrival counters are
        indexed by the grid's block."""
        tidx, _, _ = cute.arch.thread_idx()
        n_blk, split, _ = cute.arch.block_idx()
        n_splits = cute.arch.grid_dim()[1]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g, t = lane // 4, lane % 4
        M, K = mA.shape
        N = mW.shape[0]

        # W ring: (vector element, vector, row g / g + 8, thread, stage); a warp's 32 vectors of
        # one (vector, row half) are 512 contiguous bytes, so its 16-byte accesses never conflict.
        V = self.vecs
        plane = VEC * self.threads
        sW = storage.sW.get_tensor(cute.make_layout(
            (VEC, V, 2, self.threads, self.cfg.stages),
            stride=(1, plane, V * plane, VEC, 2 * V * plane)))
        # A slice: (vector element, lane t, row, vector, step): lane t's vector u holds K vector
        # 4u + t of the step, as its W vectors do; for each u, lanes (g, t) read 512 contiguous
        # bytes (no bank conflict)
        sA = storage.sA.get_tensor(cute.make_layout(
            (VEC, 4, self.m_pad, V, self.steps),
            stride=(1, VEC, 4 * VEC, 4 * VEC * self.m_pad, 4 * VEC * self.m_pad * V)))

        # 16-byte vectors of the operands: (element, row, vector index along K)
        gW = cute.flat_divide(mW, (1, VEC))[(0, None, None, None)]
        gA = cute.flat_divide(mA, (1, VEC))[(0, None, None, None)]
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                  self.ab_dtype, num_bits_per_copy=128)

        step0 = split * self.steps
        n_steps = cutlass.min(cute.ceil_div(K, self.cfg.k_step) - step0, self.steps)
        k_vecs = K // VEC
        # this thread's two W rows; rows past N re-read row N - 1 (their outputs are dropped)
        w_blk = n_blk
        if const_expr(first_blk is not None):
            w_blk = n_blk - first_blk
        row0 = w_blk * self.n_block + warp_idx * 16 + g
        rows = (cutlass.min(row0, N - 1), cutlass.min(row0 + 8, N - 1))

        # ---- prologue: the A slice rides in the first group, with W step 0
        a_vecs = self.steps * self.m_pad * 4 * V
        for i in cutlass.range_constexpr(-(-a_vecs // self.threads)):
            v = tidx + i * self.threads
            if v < a_vecs:
                # in shared memory order: lane slot, row, vector, step
                vt, vrow = v % 4, (v // 4) % self.m_pad
                vu, vstep = (v // (4 * self.m_pad)) % V, v // (4 * self.m_pad * V)
                kv = (step0 + vstep) * (4 * V) + 4 * vu + vt
                dst = sA[(None, vt, vrow, vu, vstep)]
                if kv < k_vecs:
                    cute.copy(g2s, gA[(None, cutlass.min(vrow, M - 1), kv)], dst)
                else:
                    dst.fill(0)
        for s in cutlass.range_constexpr(self.cfg.stages - 1):
            if s < n_steps:
                self._load_w(g2s, gW, sW, rows, step0 + s, s, t, tidx, k_vecs)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(self.cfg.stages - 2)
        cute.arch.sync_threads()  # every thread's share of the A slice has landed

        # ---- mainloop: one K step (32 * vecs deep) per iteration, no barrier
        rW = cute.make_rmem_tensor(cute.make_layout((VEC, V, 2)), self.ab_dtype)
        rA = cute.make_rmem_tensor(cute.make_layout((VEC, V, self.cfg.m_tiles)), self.ab_dtype)
        acc = cute.make_rmem_tensor(cute.make_layout(self.frag), Float32)
        acc.fill(0.0)
        # register views in mma.sync fragment order (see the module docstring): MMA (u, j) of a
        # step takes elements 4j..4j+3 of vector u (K vector 4u + t of the step) of each operand
        quad = cute.make_layout(((2, 2, 2), 1, 1), stride=((1, VEC * V, 2), 0, 0))  # (k pair, row + 8, k + 8)
        frag_a = [cute.make_tensor(rW.iterator + VEC * u + 4 * j, quad) for u in range(V) for j in range(2)]
        pair = cute.make_layout(((2, 2), 1, 1), stride=((1, 2), 0, 0))
        frag_b = [[cute.make_tensor(rA.iterator + VEC * V * mt + VEC * u + 4 * j, pair)
                   for u in range(V) for j in range(2)] for mt in range(self.cfg.m_tiles)]
        frag_c = [cute.make_tensor(acc.iterator + 4 * mt, pair) for mt in range(self.cfg.m_tiles)]
        for i in range(n_steps):
            cute.arch.cp_async_wait_group(self.cfg.stages - 2)
            slot = i % self.cfg.stages
            cute.autovec_copy(sW[(None, None, None, tidx, slot)], rW)
            for mt in cutlass.range_constexpr(self.cfg.m_tiles):
                cute.autovec_copy(sA[(None, t, g + 8 * mt, None, i)], rA[(None, None, mt)])
            # refill the slot read one iteration ago (its registers were consumed by that MMA)
            if i + self.cfg.stages - 1 < n_steps:
                self._load_w(g2s, gW, sW, rows, step0 + i + self.cfg.stages - 1,
                             (i + self.cfg.stages - 1) % self.cfg.stages, t, tidx, k_vecs)
            cute.arch.cp_async_commit_group()
            for mt in cutlass.range_constexpr(self.cfg.m_tiles):
                for j in cutlass.range_constexpr(2 * V):
                    cute.gemm(mma, frag_c[mt], frag_a[j], frag_b[mt][j], frag_c[mt])
        cute.arch.cp_async_wait_group(0)

        # ---- split-K: the last CTA of this N block sums every split's fragments in split order
        is_last = cutlass.Boolean(True)
        if n_splits > 1:
            part = cute.flat_divide(mPartial, (self.frag,))  # (fragment, thread slot)
            n_blocks = cute.arch.grid_dim()[0]
            cute.autovec_copy(acc, part[(None, (split * n_blocks + n_blk) * self.threads + tidx)])
            cute.arch.fence_acq_rel_gpu()  # publish the partials before the arrival below
            cute.arch.sync_threads()
            flag = storage.last.get_tensor(cute.make_layout(1))
            if tidx == 0:
                arrived = cute.arch.atomic_add(mCount.iterator + n_blk, Int32(1), sem="acq_rel", scope="gpu")
                flag[0] = Int32(0)
                if arrived == n_splits - 1:
                    flag[0] = Int32(1)
                    mCount[n_blk] = Int32(0)  # ready for the next call; no other CTA touches it now
            cute.arch.sync_threads()
            is_last = flag[0] == 1
            if is_last:
                cute.arch.fence_acq_rel_gpu()
                g2r = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128,
                                          load_cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)  # L2, never a stale L1
                r = cute.make_rmem_tensor_like(acc)
                acc.fill(0.0)
                for s in range(n_splits):
                    cute.copy(g2r, part[(None, (s * n_blocks + n_blk) * self.threads + tidx)], r)
                    acc.store(acc.load() + r.load())
        if is_last:
            self._epilogue(acc, mD, mC, mBias, alpha, beta, row0, g, t, M, N)

    @cute.jit
    def _load_w(self, g2s, gW, sW, rows, step, slot, t, tidx, k_vecs):
        """Copy this thread's W vectors of K step `step` (vectors t, t + 4, ... of the step in each
        of its two rows) into ring slot `slot`; zeros past K."""
        for h in cutlass.range_constexpr(2):
            for u in cutlass.range_constexpr(self.vecs):
                kv = step * (4 * self.vecs) + 4 * u + t
                dst = sW[(None, u, h, tidx, slot)]
                if kv < k_vecs:
                    cute.copy(g2s, gW[(None, rows[h], kv)], dst)
                else:
                    dst.fill(0)

    @cute.jit
    def _epilogue(self, acc: cute.Tensor, mD: cute.Tensor, mC: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                  alpha: Float32, beta: Float32, row0: Int32, g: Int32, t: Int32, M: Int32, N: Int32):
        """Fragment value 4 * mt + 2 * h + e is (token 8 * mt + 2 * t + e, W row row0 + 8 * h)."""
        def coord(v):
            return 8 * (v // 4) + 2 * t + v % 2, row0 + 8 * ((v // 2) % 2)

        bias_val = c_val = None
        if const_expr(self.has_bias):
            rBias = cute.make_rmem_tensor_like(acc)
            for v in cutlass.range_constexpr(self.frag):
                m, n = coord(v)
                rBias[v] = Float32(0.0)
                if n < N:
                    rBias[v] = mBias[n].to(Float32)
            bias_val = rBias.load()
        if const_expr(self.has_c):
            rC = cute.make_rmem_tensor_like(acc)
            for v in cutlass.range_constexpr(self.frag):
                m, n = coord(v)
                rC[v] = Float32(0.0)
                if m < M and n < N:
                    rC[v] = mC[m, n].to(Float32)
            c_val = rC.load()
        out = cute.make_rmem_tensor(acc.layout, self.d_dtype)
        out.store(self.epilogue_fn(acc.load(), alpha=alpha, beta=beta, bias=bias_val, c=c_val).to(self.d_dtype))
        for v in cutlass.range_constexpr(self.frag):
            m, n = coord(v)
            if m < M and n < N:
                mD[m, n] = out[v]


def build(dtype_name, out_dtype_name, a_major, b_major, has_bias, has_c, activation, warps, k_slice, stages,
          m_tiles, epilogue="", epilogue_fn=None, weights=1, vecs=1):
    """(jit function, fake arguments) for cute.compile; see the module docstring for conventions
    (both operands K-major: a_major = b_major = "k"). With `weights` > 1, w and d are tuples of
    that many tensors sharing A (see the module docstring)."""
    problem = GemmProblem(dtype_name, out_dtype_name, a_major, b_major, has_bias, has_c, activation, epilogue)
    cfg = GemvConfig(warps, k_slice, stages, m_tiles, vecs)
    err = unsupported_reason(problem, cfg, weights=weights)
    if err:
        raise ValueError(err)
    ab_t, d_t = CUTE_DTYPES[dtype_name], CUTE_DTYPES[out_dtype_name]
    # one symbol per extent, shared by all tensors, so the FFI checks that they agree
    M, N, K = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    Ns = [N] + [cute.sym_int(divisibility=8) for _ in range(1, weights)]

    def ld():
        return cute.sym_int64(divisibility=8)  # 16-byte aligned rows

    a = make_fake_tensor(ab_t, (M, K), stride=(ld(), 1), assumed_align=16)
    ws = [make_fake_tensor(ab_t, (n, K), stride=(ld(), 1), assumed_align=16) for n in Ns]
    ds = [make_fake_tensor(d_t, (M, n), stride=(cute.sym_int64(), 1)) for n in Ns]
    w, d = (ws[0], ds[0]) if weights == 1 else (tuple(ws), tuple(ds))
    c = make_fake_tensor(d_t, (M, N), stride=(cute.sym_int64(), 1)) if has_c else None
    bias = make_fake_tensor(d_t, (N,), stride=(1,)) if has_bias else None
    partials = make_fake_tensor(Float32, (cute.sym_int(divisibility=8),), stride=(1,), assumed_align=16)
    counters = make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fast = out_dtype_name == "bfloat16"
    if epilogue:
        from ..common.programs.epilogue import make_epilogue_fn

        epilogue_fn = make_epilogue_fn(epilogue, fast)
    epilogue_fn = epilogue_fn or make_epilogue(activation, fast=fast)
    fn = HopperGemv(cfg, ab_t, d_t, has_bias, has_c, epilogue_fn, weights)
    return fn, (a, w, d, c, bias, partials, counters, Float32(1.0), Float32(0.0), stream)
