"""The grouped GEMM's epilogue stores (grouped_sm90.py and the weight gradient's kernel), a mixin of
their CTA: a consumer thread's stmatrix-shaped pieces, one output subtile stored by TMA through a
staging buffer, a partial tile's subtile staged and copied in 16-byte row pieces, and the choice
between them for one subtile. Uses the CTA's epi_tile, epi_threads, d_dtype, d_layout and
grouped_cfg."""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp

from .config import EPI_STAGES


class GroupedStores:
    def _epilogue_fragments(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, sD: cute.Tensor, ctid):
        """A consumer thread's epilogue pieces: the stmatrix-shaped register-to-smem copy, its
        smem destination, the accumulator retiled for it, each value's (m, n) in a subtile, and
        fp32 / output-dtype registers of one subtile."""
        c_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
        tiled_copy_c = cute.make_tiled_copy_C_atom(c_atom, tiled_mma)
        r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, Float32), tiled_copy_c)
        thr_r2s = r2s.get_slice(ctid)
        tRS_cD = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
        return (r2s, thr_r2s.partition_D(sD), r2s.retile(acc), tRS_cD,
                cute.make_rmem_tensor(tRS_cD.shape, Float32), cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype))

    @cute.jit
    def _tma_store_subtile(self, r2s: cute.TiledCopy, tRS_rOut: cute.Tensor, tRS_sD_buf: cute.Tensor,
                           tma_d: cute.CopyAtom, bsD_buf: cute.Tensor, bgD_e: cute.Tensor,
                           epi_barrier: pipeline.NamedBarrier, store_pipe: pipeline.PipelineTmaStore,
                           is_store_warp):
        """Registers -> staging buffer (stmatrix) -> one TMA store by the store warp."""
        cute.copy(r2s, tRS_rOut, tRS_sD_buf)
        # make the generic-proxy smem writes visible to the TMA unit
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if is_store_warp:
            cute.copy(tma_d, bsD_buf, bgD_e)
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_barrier.arrive_and_wait()

    @cute.jit
    def _staged_store_subtile(self, r2s: cute.TiledCopy, tRS_rOut: cute.Tensor, tRS_sD_buf: cute.Tensor,
                              sD_buf: cute.Tensor, mD: cute.Tensor, r_base: Int32, c_base: Int32, row_end: Int32,
                              n_cols: Int32, ctid: Int32, epi_barrier: pipeline.NamedBarrier):
        """A partial tile's subtile (config staged_partial): registers -> staging buffer (stmatrix),
        then every epilogue thread copies 16-byte row pieces of it to global memory, only rows
        before `row_end` (columns come in whole pieces: N is a multiple of 8). The buffer must be
        free (no TMA store reading it) and is free again after: the last barrier."""
        cute.copy(r2s, tRS_rOut, tRS_sD_buf)
        epi_barrier.arrive_and_wait()  # generic-proxy writes, generic-proxy reads: no proxy fence
        vec = 128 // self.d_dtype.width
        per_row = self.epi_tile[1] // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.d_dtype, num_bits_per_copy=128)
        s2g = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((self.epi_threads // per_row, per_row),
                                                                     order=(1, 0)), cute.make_layout((1, vec)))
        thr = s2g.get_slice(ctid)
        tSsD = thr.partition_S(sD_buf)
        tScD = thr.partition_S(cute.make_identity_tensor(self.epi_tile))
        piece = cute.make_rmem_tensor(cute.make_layout(vec), self.d_dtype)
        for m in cutlass.range_constexpr(cute.size(tSsD, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tSsD, mode=[2])):
                crd = tScD[(0, m, k)]
                r, c = r_base + crd[0], c_base + crd[1]
                if r < row_end and c < n_cols:
                    cute.autovec_copy(tSsD[(None, m, k)], piece)
                    # the piece's address, 16-byte aligned (row strides and c are multiples of 8)
                    dst = mD.iterator + (cutlass.Int64(r) * mD.stride[0] + c)
                    cute.autovec_copy(piece, cute.make_tensor(
                        cute.make_ptr(self.d_dtype, dst.toint(), cute.AddressSpace.gmem, assumed_align=16),
                        cute.make_layout(vec)))
        epi_barrier.arrive_and_wait()  # every thread's reads done before the buffer is written again

    @cute.jit
    def _store_subtile(self, tRS_rOut: cute.Tensor, whole, n_stored: Int32, epi: tuple, bgD_e: cute.Tensor,
                       mD: cute.Tensor, e_coord, first_row: Int32, first_col: Int32, row_end: Int32, col_end: Int32):
        """Output subtile `e_coord` of the tile at (first_row, first_col) from registers: by TMA where
        the tile is whole, else only its rows before `row_end` and columns before `col_end` (staged,
        or predicated stores); the count of TMA-stored subtiles after it."""
        r2s, tRS_sD, sD, tRS_cD, tma_d, bsD, epi_barrier, store_pipe, is_store_warp, ctid = epi
        if whole:
            buf = n_stored % EPI_STAGES
            self._tma_store_subtile(r2s, tRS_rOut, tRS_sD[(None, None, None, buf)], tma_d, bsD[(None, buf)], bgD_e,
                                    epi_barrier, store_pipe, is_store_warp)
            n_stored += 1
        else:
            r_base = first_row + e_coord[0] * self.epi_tile[0]
            c_base = first_col + e_coord[1] * self.epi_tile[1]
            if cutlass.const_expr(self.grouped_cfg.staged_partial):
                # the free staging buffer (the one the next TMA store takes), not advanced; a subtile
                # wholly past the rows or the columns is skipped (the test is the same for every
                # thread: both barriers or neither)
                if r_base < row_end and c_base < col_end:
                    buf = n_stored % EPI_STAGES
                    self._staged_store_subtile(r2s, tRS_rOut, tRS_sD[(None, None, None, buf)], sD[(None, None, buf)],
                                               mD, r_base, c_base, row_end, col_end, ctid, epi_barrier)
            else:
                for v in cutlass.range_constexpr(cute.size(tRS_rOut)):
                    r = r_base + tRS_cD[v][0]
                    c = c_base + tRS_cD[v][1]
                    if r < row_end and c < col_end:
                        mD[r, c] = tRS_rOut[v]
        return n_stored
