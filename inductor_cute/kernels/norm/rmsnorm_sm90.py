"""Row-wise RMSNorm forward for Hopper (sm_90a) in CuTe DSL.

    y[m, :] = x[m, :] * rsqrt(mean(x[m, :]^2) + eps) * w[:]    (fp32 math, stored in x's dtype)

N is fixed at compile time and M is symbolic, so one object serves every number of rows. Each CTA
owns `rows_per_cta` rows; a row is spread over `threads_per_row` threads, each holding a few
16-byte vectors of it in registers, so x is read from memory exactly once.

Exported entry: kernel(x, w, y, eps) on torch's current stream (TVM-FFI supplies the stream).
"""

import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .rmsnorm_config import RMSNormConfig

CUTE_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


class RMSNormSm90:
    def __init__(self, n: int, dtype, config: RMSNormConfig):
        self.n, self.dtype, self.cfg = n, dtype, config
        self.tpr = config.threads_per_row
        assert self.tpr * config.rows_per_cta == config.threads_per_cta <= 1024
        assert n % config.vec == 0 and config.vec * dtype.width == 128
        self.chunks = -(-(n // config.vec) // self.tpr)  # 16-byte vectors per thread
        self.tile = (config.rows_per_cta, self.chunks * self.tpr * config.vec)
        self.warps_per_row = max(1, self.tpr // 32)
        # When x and w together exceed one resident CTA's registers per thread, w is loaded only
        # after the reduction so it is not live across it (fp32 at N=32768 spilled otherwise).
        data_regs = 2 * self.chunks * config.vec * dtype.width // 32
        self.late_w = data_regs + 24 > 65536 // config.threads_per_cta

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32, stream: cuda.CUstream):
        # w seen as (rows_per_cta, N) with row stride 0, so it partitions exactly like a tile of x.
        mW2 = cute.make_tensor(mW.iterator, cute.make_layout((self.tile[0], self.n), stride=(0, 1)))
        self.kernel(mX, mW2, mY, eps).launch(
            grid=[cute.ceil_div(mX.shape[0], self.tile[0]), 1, 1],
            block=[self.cfg.threads_per_cta, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rows_total = mX.shape[0]

        # One 128-bit copy atom; threads laid out (rows, threads_per_row), each owning one vector.
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            atom,
            cute.make_ordered_layout((self.tile[0], self.tpr), order=(1, 0)),
            cute.make_layout((1, self.cfg.vec)),
        )
        thr = tiled_copy.get_slice(tidx)

        # The CTA's first element in 64-bit arithmetic (M * N may pass 2^31); the assumption
        # restores the 16-byte alignment that pointer arithmetic would otherwise lose.
        row0 = bidx * self.tile[0]
        tile_layout = cute.make_layout(self.tile, stride=(self.n, 1))
        base = cute.assume(cutlass.Int64(row0) * self.n, divby=self.cfg.vec)
        gX = cute.make_tensor(mX.iterator + base, tile_layout)
        gY = cute.make_tensor(mY.iterator + base, tile_layout)
        tXgX, tXgY = thr.partition_S(gX), thr.partition_D(gY)
        tXgW = thr.partition_S(cute.local_tile(mW, self.tile, (0, 0)))
        tXcX = thr.partition_S(cute.make_identity_tensor(self.tile))
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrW = cute.make_rmem_tensor_like(tXgW)
        tXrY = cute.make_rmem_tensor_like(tXgY)

        # Column mask, one flag per vector, only when the tile is wider than N; vectors always in
        # range get a constant True that the compiler folds away.
        col_mask = None
        if const_expr(self.tile[1] != self.n):
            col_mask = cute.make_rmem_tensor(cute.make_layout((1, 1, self.chunks), stride=(0, 0, 1)), cutlass.Boolean)
            for k in cutlass.range_constexpr(self.chunks):
                if const_expr((k + 1) * self.tpr * self.cfg.vec <= self.n):
                    col_mask[0, 0, k] = True
                else:
                    col_mask[0, 0, k] = cute.elem_less(tXcX[(0, 0), 0, k][1], self.n)
            tXrX.fill(0)  # masked lanes must add nothing to the sum of squares

        row_in_range = tXcX[(0, 0), 0, 0][0] < rows_total - row0
        if row_in_range:
            cute.copy(atom, tXgX, tXrX, pred=col_mask)
        if const_expr(not self.late_w):
            cute.copy(atom, tXgW, tXrW, pred=col_mask)  # w is small and stays in L2

        x = tXrX.load().to(Float32)
        ssq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        ssq = cute.arch.warp_reduction(ssq, operator.add, threads_in_group=min(self.tpr, 32))
        if const_expr(self.warps_per_row > 1):
            # Across warps: each warp's lane 0 parks its partial in shared memory, then every warp
            # reduces the partials of its row again.
            smem = cutlass.memory.SmemAllocator()
            partials = smem.allocate_tensor(
                Float32, cute.make_ordered_layout((self.tile[0], self.warps_per_row), order=(1, 0)), 16)
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            row, col = warp // self.warps_per_row, warp % self.warps_per_row
            if lane == 0:
                partials[row, col] = ssq
            cute.arch.barrier()
            ssq = Float32(0.0)
            if lane < self.warps_per_row:
                ssq = partials[row, lane]
            ssq = cute.arch.warp_reduction(ssq, operator.add)

        if const_expr(self.late_w):
            cute.copy(atom, tXgW, tXrW, pred=col_mask)
        rstd = cute.math.rsqrt(ssq * (1.0 / self.n) + eps, fastmath=True)
        tXrY.store((x * rstd * tXrW.load().to(Float32)).to(self.dtype))
        if row_in_range:
            cute.copy(atom, tXrY, tXgY, pred=col_mask)


def build(N: int, dtype_name: str, threads_per_cta: int, rows_per_cta: int, vec: int):
    """(jit function, fake arguments) for cute.compile: x and y are (M, N) row-major, M symbolic."""
    dtype = CUTE_DTYPES[dtype_name]
    config = RMSNormConfig(threads_per_cta, rows_per_cta, vec)
    rows = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    x = fake(dtype, (rows, N), stride_order=(1, 0), assumed_align=16)
    y = fake(dtype, (rows, N), stride_order=(1, 0), assumed_align=16)
    w = fake(dtype, (N,), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return RMSNormSm90(N, dtype, config), (x, w, y, Float32(0.0), stream)
