"""Warp-specialized Hopper (sm_90a) GEMM in CuTe DSL with a pluggable pointwise epilogue.

    D[l, m, n] = epilogue_fn(acc = sum_k A[l, m, k] * B[l, k, n], alpha, beta, bias[n], C[l, m, n])

Design (one CTA):
  * warp group 0 is the producer: after shrinking its register budget, warp 0 streams
    A/B k-tiles with TMA into a `stages`-deep swizzled smem ring (PipelineTmaAsync
    full/empty mbarriers); when C is present, warp 1 walks the same tiles and streams C
    epilogue subtiles through a second small TMA pipeline, so that A/B loads never wait
    for an epilogue to drain C.
  * warp groups 1..W are consumers: they grow their register budget, issue WGMMA on the
    ring (one wgmma batch kept in flight), then run the epilogue subtile by subtile:
    registers -> epilogue_fn in fp32 -> convert -> stmatrix to smem -> TMA store.
  * cooperative schedule (default): all consumer warp groups share each tile, 64 rows each.
    Ping-pong (config.pingpong, 2 consumers): warp group 1 + s owns the CTA's tiles j with
    j % 2 == s whole. Named "turn" barriers make the two alternate their mainloops and their
    epilogues, so one's epilogue overlaps the other's mainloop and the tensor cores stay busy.
    Both read the one A/B ring (each stage by one warp group) and the one C pipeline in tile
    order; each has its own D staging buffers, bias row, epilogue barrier and store warp.
  * tiles are dealt by the tile scheduler (kernels/common/tile_scheduler.py) in a grouped
    ("swizzled") raster; with persistent=True the grid is sized to the SM count and each CTA
    loops over tiles, otherwise each CTA gets one tile. Every role walks them with one loop.
  * clusters (cluster_m, cluster_n) multicast B along M and A along N.

Tensor conventions (mode order used by the jit function, all 3-D with batch last):
  a: (M, K, L)   b: (N, K, L)   d, c: (M, N, L) with stride(n) == 1   bias: (N,)
From torch tensors with logical shapes A (L, M, K), B (L, K, N), D/C (L, M, N):
  a = A.permute(1, 2, 0)   b = B.permute(2, 1, 0)   d = D.permute(1, 2, 0)   c = C.permute(1, 2, 0)
(for nn.Linear weight W (N, K): B = W.t(), i.e. b = W.unsqueeze(-1); b_major="k").
Optional C / bias are passed as None when the kernel was built without them. With
--enable-tvm-ffi and the env-stream fake stream, the compiled/exported function is
    f(a, b, d, c_or_None, bias_or_None, alpha: float, beta: float)
and launches on the current torch stream. Non-unit strides must be multiples of 8 elements.
"""
from typing import Callable, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.cute.runtime import make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

from ..common import barriers
from ..common.activations import activations
from ..common.tile_scheduler import GroupedRaster, TileScheduler
from .config import (C_STAGES, EPI_N, EPI_STAGES, SM_COUNT, GemmConfig, GemmProblem, smem_bytes,
                     unsupported_reason)

CUTE_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


# ----------------------------------------------------------------------------- epilogue
def make_epilogue(activation: str = "identity", fast: bool = False) -> Callable:
    """Default hook: act(alpha * acc + bias + beta * C). All operands are fp32 TensorSSA
    fragments of one subtile (bias already broadcast along M); bias / c are None when absent."""
    act = activations(fast)[activation]

    def epilogue_fn(acc, *, alpha, beta, bias=None, c=None):
        x = acc * alpha
        if bias is not None:
            x = x + bias
        if c is not None:
            x = x + c * beta
        return act(x)

    return epilogue_fn


# ----------------------------------------------------------------------------- kernel
class HopperGemm:
    def __init__(self, config: GemmConfig, a_major: str, b_major: str, has_bias: bool,
                 has_c: bool, epilogue_fn: Callable, num_sms: int = SM_COUNT, raster_group: int = 8):
        self.cfg = config
        self.a_layout = LayoutEnum.ROW_MAJOR if a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.ROW_MAJOR
        self.has_bias, self.has_c = has_bias, has_c
        self.epilogue_fn = epilogue_fn
        self.raster_group = raster_group
        self.tile_mnk = (config.tile_m, config.tile_n, config.tile_k)
        self.cluster_mn = (config.cluster_m, config.cluster_n)
        self.cluster_size = config.cluster_m * config.cluster_n
        self.max_clusters = TileScheduler.max_clusters(config.persistent, num_sms, self.cluster_size)
        self.pingpong = config.pingpong
        self.num_consumers = config.consumer_warpgroups
        self.threads = 128 * (1 + self.num_consumers)
        self.tile_wgs = config.tile_warpgroups  # consumer warp groups sharing one tile
        self.epi_threads = 128 * self.tile_wgs
        self.producer_regs = 40
        self.consumer_regs = 232 if self.num_consumers == 2 else 240
        self.epi_tile = (64 * self.tile_wgs, EPI_N)

    def _setup(self):
        tm, tn, tk = self.tile_mnk
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), Float32, (self.tile_wgs, 1, 1),
            tiler_mn=(64, tn))
        st = self.cfg.stages
        self.sA_layout = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, self.ab_dtype, st)
        self.sB_layout = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, self.ab_dtype, st)
        # EPI_STAGES buffers per consumer slot
        self.sD_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile,
                                                         EPI_STAGES * self.cfg.slots)
        self.sC_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile, C_STAGES)
        # A is shared by CTAs of the same cluster row (multicast along N), B along M
        self.mcast_a, self.mcast_b = self.cluster_mn[1], self.cluster_mn[0]

    @staticmethod
    def _load_op(multicast: int):
        """The TMA load of an operand that `multicast` CTAs of a cluster share."""
        return cpasync.CopyBulkTensorTileG2SOp() if multicast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()

    def _ab_pipeline(self, barriers, ab_bytes):
        """The A/B ring over the mbarriers at `barriers`: every warp of the warp groups that read a
        stage releases it once per CTA that wrote into it (barrier init is the caller's to fence)."""
        cm, cn = self.cluster_mn
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers.data_ptr(), num_stages=self.cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     (self.mcast_a + self.mcast_b - 1) * 4 * self.tile_wgs),
            tx_count=ab_bytes, cta_layout_vmnk=cute.make_layout((1, cm, cn, 1)), defer_sync=True)

    def _tma_atoms(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor) -> tuple:
        """(atom, TMA tensor) of A's and B's (tm, tk) and (tn, tk) loads, each multicast to the CTAs
        of the cluster that share it, and of D's subtile stores, flattened."""
        tm, tn, tk = self.tile_mnk
        tma_a, gA = cpasync.make_tiled_tma_atom(self._load_op(self.mcast_a), mA,
                                                cute.slice_(self.sA_layout, (None, None, 0)), (tm, tk),
                                                num_multicast=self.mcast_a)
        tma_b, gB = cpasync.make_tiled_tma_atom(self._load_op(self.mcast_b), mB,
                                                cute.slice_(self.sB_layout, (None, None, 0)), (tn, tk),
                                                num_multicast=self.mcast_b)
        tma_d, gD = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mD,
                                                cute.slice_(self.sD_layout, (None, None, 0)), self.epi_tile)
        return tma_a, gA, tma_b, gB, tma_d, gD

    def _mcast_masks(self, cta_layout, cta_coord):
        """(A's, B's) multicast masks of this CTA: A to its cluster row, B to its column; 0 alone."""
        a_mask = cute.make_layout_image_mask(cta_layout, cta_coord, mode=1) if self.mcast_a > 1 else 0
        b_mask = cute.make_layout_image_mask(cta_layout, cta_coord, mode=0) if self.mcast_b > 1 else 0
        return a_mask, b_mask

    def _shared_storage(self):
        st, lay_a, lay_b, lay_d, lay_c = self.cfg.stages, self.sA_layout, self.sB_layout, self.sD_layout, self.sC_layout
        ab_t, d_t = self.ab_dtype, self.d_dtype
        # without C keep a 16-byte placeholder instead of another 1 KB-aligned buffer
        n_c, c_align = (cute.cosize(lay_c), 1024) if self.has_c else (8, 16)
        n_bias = self.tile_mnk[1] * self.cfg.slots if self.has_bias else 4  # bias rows, as fp32

        @cute.struct
        class SharedStorage:
            ab_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            c_bars: cute.struct.MemRange[cutlass.Int64, 2 * C_STAGES]
            sA: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_a)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_b)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[d_t, cute.cosize(lay_d)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[d_t, n_c], c_align]
            sBias: cute.struct.Align[cute.struct.MemRange[Float32, n_bias], 16]

        return SharedStorage

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor,
                 mC: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
                 alpha: Float32, beta: Float32, stream: cuda.CUstream):
        self.ab_dtype, self.d_dtype = mA.element_type, mD.element_type
        assert LayoutEnum.from_tensor(mA) == self.a_layout and LayoutEnum.from_tensor(mB) == self.b_layout
        self._setup()
        tm, tn, tk = self.tile_mnk
        tma_a, gA, tma_b, gB, tma_d, gD = self._tma_atoms(mA, mB, mD)
        tma_c, gC = None, None
        if cutlass.const_expr(self.has_c):
            tma_c, gC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mC,
                                                    cute.slice_(self.sC_layout, (None, None, 0)), self.epi_tile)
        # grid: (cluster_m, cluster_n, #clusters); z is clamped to the persistent wave size
        cm, cn = self.cluster_mn
        tiles = GroupedRaster.create(cute.ceil_div(mD.shape[0], tm), cute.ceil_div(mD.shape[1], tn), mD.shape[2],
                                     self.cluster_mn, self.raster_group)
        grid_z = TileScheduler.launch_clusters(tiles.count, self.max_clusters)
        self.shared_storage = self._shared_storage()
        # unsupported_reason budgets with smem_bytes: keep it exact
        assert self.shared_storage.size_in_bytes() == smem_bytes(
            self.cfg, self.ab_dtype.width // 8, self.d_dtype.width // 8, self.has_c, self.has_bias)
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, tma_c, gC, mBias, alpha, beta,
                    self.tiled_mma, self.sA_layout, self.sB_layout, self.sD_layout, self.sC_layout
                    ).launch(grid=[cm, cn, grid_z], block=[self.threads, 1, 1],
                             cluster=[cm, cn, 1], min_blocks_per_mp=1, stream=stream)

    @staticmethod
    def _turn(phase: int, slot) -> pipeline.NamedBarrier:
        """Ping-pong turn of consumer `slot` for its mainloop (phase 0) or epilogue (phase 1): that
        warp group syncs on it, the other arrives when it hands the turn over."""
        return pipeline.NamedBarrier(barrier_id=barriers.gemm_turn(phase, slot), num_threads=256)

    @staticmethod
    def _column_groups(coords0, n_vals):
        groups = {}
        for v in range(n_vals):  # trace-time: coords of thread 0 are static ints
            groups.setdefault(int(coords0[v][1]), []).append(v)
        return [g for _, g in sorted(groups.items())]

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_d: cute.CopyAtom, mD: cute.Tensor, tma_c: Optional[cute.CopyAtom],
               mC: Optional[cute.Tensor], mBias: Optional[cute.Tensor], alpha: Float32, beta: Float32,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               sD_layout: cute.ComposedLayout, sC_layout: cute.ComposedLayout):
        tm, tn, tk = self.tile_mnk
        cm, cn = self.cluster_mn
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)
            if cutlass.const_expr(self.has_c):
                cpasync.prefetch_descriptor(tma_c)

        cta_layout = cute.make_layout((cm, cn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord = cta_layout.get_flat_coord(cta_rank)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)

        # --- pipelines (barrier init is fenced and synced once below)
        ab_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sA_layout, (None, None, 0))) + \
            cute.size_in_bytes(self.ab_dtype, cute.slice_(sB_layout, (None, None, 0)))
        ab_pipe = self._ab_pipeline(storage.ab_bars, ab_bytes)
        c_pipe = None
        sC = None
        if cutlass.const_expr(self.has_c):
            sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
            c_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.c_bars.data_ptr(), num_stages=C_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.tile_wgs),
                tx_count=cute.size_in_bytes(self.d_dtype, cute.slice_(sC_layout, (None, None, 0))),
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_arrive_relaxed()

        # --- global tiles: (tile, tile, rest_0, rest_1, L)
        gA = cute.local_tile(mA, (tm, tk), (None, None, None))
        gB = cute.local_tile(mB, (tn, tk), (None, None, None))
        gD = cute.local_tile(mD, (tm, tn), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        tiles = GroupedRaster.create(cute.size(gD, mode=[2]), cute.size(gD, mode=[3]), cute.size(gD, mode=[4]),
                                     self.cluster_mn, self.raster_group)
        scheduler = TileScheduler.create(tiles, cta_coord)

        tAsA, tAgA = cpasync.tma_partition(tma_a, cta_coord[1], cute.make_layout(cn),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, cta_coord[0], cute.make_layout(cm),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        epi_tiles = (tm // self.epi_tile[0], tn // self.epi_tile[1])
        epi_order = cute.make_layout(epi_tiles, stride=(epi_tiles[1], 1))  # n fastest, like the acc
        n_epi = epi_tiles[0] * epi_tiles[1]

        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                a_mask, b_mask = self._mcast_masks(cta_layout, cta_coord)
                ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
                work = scheduler.first()
                while scheduler.valid(work):
                    tile = scheduler.tile(work)
                    tAgA_t = tAgA[(None, tile.m, None, tile.batch)]
                    tBgB_t = tBgB[(None, tile.n, None, tile.batch)]
                    for kt in range(k_tiles):
                        ab_pipe.producer_acquire(ab_state)
                        bar = ab_pipe.producer_get_barrier(ab_state)
                        cute.copy(tma_a, tAgA_t[(None, kt)], tAsA[(None, ab_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=a_mask)
                        cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, ab_state.index)],
                                  tma_bar_ptr=bar, mcast_mask=b_mask)
                        ab_pipe.producer_commit(ab_state)
                        ab_state.advance()
                    work = scheduler.next(work)
                # do not exit while peers may still signal our barriers
                ab_pipe.producer_tail(ab_state)
            if cutlass.const_expr(self.has_c):
                # C needs no tail: only this CTA's consumers arrive on its barriers
                if warp_idx == 1:
                    c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, C_STAGES)
                    work = scheduler.first()
                    while scheduler.valid(work):
                        tile = scheduler.tile(work)
                        gC_t = cute.local_tile(mC, (tm, tn), (tile.m, tile.n, tile.batch))
                        bsC, bgC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                                         cute.zipped_divide(gC_t, self.epi_tile))
                        for e in cutlass.range_constexpr(n_epi):
                            c_pipe.producer_acquire(c_state)
                            cute.copy(tma_c, bgC[(None, epi_order.get_hier_coord(e))],
                                      bsC[(None, c_state.index)], tma_bar_ptr=c_pipe.producer_get_barrier(c_state))
                            c_pipe.producer_commit(c_state)
                            c_state.advance()
                        work = scheduler.next(work)

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # the consumer slot this warp group belongs to (cooperative: all in slot 0)
            slot = Int32(0)
            if cutlass.const_expr(self.pingpong):
                slot = wg_idx - 1
            ctid = tidx - 128 * (1 + slot)  # thread index among the warp groups sharing a tile
            epi_barrier = pipeline.NamedBarrier(barrier_id=barriers.gemm_epilogue(slot), num_threads=self.epi_threads)
            thr_mma = tiled_mma.get_slice(ctid)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(gD[(None, None, 0, 0, 0)]).shape, Float32)
            k_blocks = cute.size(tCrA, mode=[2])

            # epilogue copies: stmatrix-shaped tiling of the accumulator (layout-only atom)
            c_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
            tiled_copy_c = cute.make_tiled_copy_C_atom(c_atom, tiled_mma)
            r2s = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, Float32), tiled_copy_c)
            thr_r2s = r2s.get_slice(ctid)
            tRS_sD = thr_r2s.partition_D(sD)
            tRS_acc = r2s.retile(acc)
            tRS_cD = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))  # (m, n) of each value
            tRS_rD = cute.make_rmem_tensor(tRS_cD.shape, Float32)
            tRS_rOut = cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype)
            n_vals = cute.size(tRS_rD)
            if cutlass.const_expr(self.has_c):
                ld_op = warp.LdMatrix8x8x16bOp(False, 4) if self.d_dtype.width == 16 else cute.nvgpu.CopyUniversalOp()
                s2r = cute.make_tiled_copy_S(cute.make_copy_atom(ld_op, self.d_dtype), tiled_copy_c)
                thr_s2r = s2r.get_slice(ctid)
                tSR_sC = thr_s2r.partition_S(sC)
                tRS_rC = cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype)
                tSR_rC = thr_s2r.retile(tRS_rC)
            if cutlass.const_expr(self.has_bias):
                rBias = cute.make_rmem_tensor(tRS_cD.shape, Float32)
                # a thread's column offsets are the same for every thread (thread 0 starts at
                # column 0), so group fragment slots by column and read each column once
                bias_groups = self._column_groups(r2s.get_slice(0).partition_S(
                    cute.make_identity_tensor(self.epi_tile)), n_vals)
                sBias = storage.sBias.get_tensor(cute.make_layout((tn, self.cfg.slots)))[(None, slot)]
                bias_per_thread = -(-tn // self.epi_threads)
                rBiasRow = cute.make_rmem_tensor(cute.make_layout(bias_per_thread), Float32)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads))
            is_store_warp = warp_idx == 4 * (1 + slot)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, C_STAGES)
            slots = self.cfg.slots
            work = scheduler.first(slot, slots)
            if cutlass.const_expr(self.pingpong):
                # Slot 1 starts at the CTA's second tile, past the first tile's ring stages and C
                # subtiles; slot 0 owns the first tile, so slot 1 hands it both first turns.
                read_state.advance(Int32(slot * k_tiles))
                release_state.advance(Int32(slot * k_tiles))
                c_state.advance(Int32(slot * n_epi))
                if slot == 1:
                    self._turn(0, 0).arrive()
                    self._turn(1, 0).arrive()
            n_done = Int32(0)
            while scheduler.valid(work):
                tile = scheduler.tile(work)
                # a turn is handed over only if the CTA has a next tile, so no arrive is left pending
                has_next = scheduler.has_next(work)
                if cutlass.const_expr(self.has_bias):
                    # Issue the tile's bias loads now; the mainloop hides their latency.
                    for i in cutlass.range_constexpr(bias_per_thread):
                        col = tile.n * tn + ctid + i * self.epi_threads
                        rBiasRow[i] = Float32(0.0)
                        if col < mBias.shape[0] and ctid + i * self.epi_threads < tn:
                            rBiasRow[i] = mBias[col].to(Float32)
                # ---- mainloop: keep one wgmma batch in flight, release the stage behind it
                if cutlass.const_expr(self.pingpong):
                    self._turn(0, slot).arrive_and_wait()
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for kt in range(k_tiles):
                    ab_pipe.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(k_blocks):
                        coord = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    warpgroup.commit_group()
                    read_state.advance()
                    if kt > 0:
                        warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                if cutlass.const_expr(self.pingpong):
                    # all wgmmas are issued: the other warp group may queue its own behind them
                    if has_next:
                        self._turn(0, 1 - slot).arrive()
                warpgroup.wait_group(0)
                if k_tiles > 0:
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                if cutlass.const_expr(self.has_bias):
                    # The previous tile's epilogue ended on a consumer barrier, so the row is free.
                    for i in cutlass.range_constexpr(bias_per_thread):
                        if ctid + i * self.epi_threads < tn:
                            sBias[ctid + i * self.epi_threads] = rBiasRow[i]
                    epi_barrier.arrive_and_wait()

                # ---- epilogue, one (64 * tile_wgs x 32) subtile at a time
                if cutlass.const_expr(self.pingpong):
                    # epilogues run in tile order: the shared C pipeline is consumed in that order
                    self._turn(1, slot).arrive_and_wait()
                gD_t = cute.zipped_divide(gD[(None, None, tile.m, tile.n, tile.batch)], self.epi_tile)
                bsD, bgD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1),
                                                 cute.group_modes(sD, 0, 2), gD_t)
                for e in cutlass.range_constexpr(n_epi):
                    e_coord = epi_order.get_hier_coord(e)
                    for v in cutlass.range_constexpr(n_vals):
                        tRS_rD[v] = tRS_acc[e * n_vals + v]
                    c_val = None
                    if cutlass.const_expr(self.has_c):
                        c_pipe.consumer_wait(c_state)
                        cute.copy(s2r, tSR_sC[(None, None, None, c_state.index)], tSR_rC)
                        c_pipe.consumer_release(c_state)
                        c_state.advance()
                        c_val = tRS_rC.load().to(Float32)
                    bias_val = None
                    if cutlass.const_expr(self.has_bias):
                        n0 = e_coord[1] * self.epi_tile[1]
                        for u in cutlass.range_constexpr(len(bias_groups)):
                            bval = sBias[n0 + tRS_cD[bias_groups[u][0]][1]]  # 0 past the N edge
                            for v in cutlass.range_constexpr(len(bias_groups[u])):
                                rBias[bias_groups[u][v]] = bval
                        bias_val = rBias.load()
                    out = self.epilogue_fn(tRS_rD.load(), alpha=alpha, beta=beta, bias=bias_val, c=c_val)
                    tRS_rOut.store(out.to(self.d_dtype))
                    buf = slot * EPI_STAGES + (n_done * n_epi + e) % EPI_STAGES
                    cute.copy(r2s, tRS_rOut, tRS_sD[(None, None, None, buf)])
                    # make the generic-proxy smem writes visible to the TMA unit
                    cute.arch.fence_proxy("async.shared", space="cta")
                    epi_barrier.arrive_and_wait()
                    if is_store_warp:
                        cute.copy(tma_d, bsD[(None, buf)], bgD[(None, e_coord)])
                        store_pipe.producer_commit()
                        store_pipe.producer_acquire()
                    epi_barrier.arrive_and_wait()
                if cutlass.const_expr(self.pingpong):
                    if has_next:
                        self._turn(1, 1 - slot).arrive()
                    # pass over the other warp group's tile in the shared pipelines
                    read_state.advance(Int32(k_tiles))
                    release_state.advance(Int32(k_tiles))
                    c_state.advance(n_epi)
                n_done += 1
                work = scheduler.next(work, slots)
            store_pipe.producer_tail()


# ----------------------------------------------------------------------------- build
def build(dtype_name, out_dtype_name, a_major, b_major, has_bias, has_c, activation,
          tile_m, tile_n, tile_k, cluster_m, cluster_n, stages, consumer_warpgroups, persistent, pingpong=False,
          num_sms=SM_COUNT, raster_group=8, epilogue="", epilogue_fn=None):
    """(jit function, fake arguments) for cute.compile; see the module docstring for conventions."""
    problem = GemmProblem(dtype_name, out_dtype_name, a_major, b_major, has_bias, has_c, activation, epilogue)
    cfg = GemmConfig(tile_m, tile_n, tile_k, cluster_m, cluster_n, stages, consumer_warpgroups, persistent, pingpong)
    err = unsupported_reason(problem, cfg)
    if err:
        raise ValueError(err)
    ab_t, d_t = CUTE_DTYPES[dtype_name], CUTE_DTYPES[out_dtype_name]
    # One symbol per extent, shared by all tensors, so the FFI checks that they agree; the
    # contiguous extent of every TMA operand must be a multiple of 8 elements (16 bytes).
    M = cute.sym_int(divisibility=8 if a_major == "m" else 1)
    N = cute.sym_int(divisibility=8)
    K = cute.sym_int(divisibility=8 if "k" in (a_major, b_major) else 1)
    L = cute.sym_int()

    def ld():
        return cute.sym_int64(divisibility=8)  # TMA needs 16-byte aligned strides

    a_stride = (ld(), 1, ld()) if a_major == "k" else (1, ld(), ld())
    b_stride = (ld(), 1, ld()) if b_major == "k" else (1, ld(), ld())
    a = make_fake_tensor(ab_t, (M, K, L), stride=a_stride, assumed_align=16)
    b = make_fake_tensor(ab_t, (N, K, L), stride=b_stride, assumed_align=16)
    d = make_fake_tensor(d_t, (M, N, L), stride=(ld(), 1, ld()), assumed_align=16)
    c = make_fake_tensor(d_t, (M, N, L), stride=(ld(), 1, ld()), assumed_align=16) if has_c else None
    bias = make_fake_tensor(d_t, (N,), stride=(1,)) if has_bias else None
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    fast = out_dtype_name == "bfloat16"
    if epilogue:
        from ..common.programs.epilogue import make_epilogue_fn

        epilogue_fn = make_epilogue_fn(epilogue, fast)
    epilogue_fn = epilogue_fn or make_epilogue(activation, fast=fast)
    fn = HopperGemm(cfg, a_major, b_major, has_bias, has_c, epilogue_fn,
                    num_sms=num_sms, raster_group=raster_group)
    return fn, (a, b, d, c, bias, Float32(1.0), Float32(0.0), stream)
