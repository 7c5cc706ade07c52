"""Grouped GEMM for MoE on Hopper (sm_90a) in CuTe DSL: the forward form of `torch._grouped_mm`,

    out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g]   for every group g (offs[-1] = 0)

in one persistent launch over all groups, with the group sizes read on the device (no host sync).

Built from the dense GEMM (sm90.py): the same warp-specialized CTA (producer warp streaming A/B
k-tiles by TMA into a swizzled ring, cooperative consumer warp groups issuing WGMMA, epilogue
through stmatrix and TMA stores), its smem layouts and MMA (`HopperGemm._setup`), and the same
`TileScheduler` loop, over a different tile map:
  * every CTA first turns `offs` into two shared-memory tables (group row ends, tile prefix) and
    the `GroupedTileMap` finds each work unit's group by binary search (kernels/common/
    grouped_tile_map.py). The grid is one wave of clusters, sized from an upper bound of the work
    units (cluster blocks of tiles) known on the host (`max_work_units`); surplus clusters find
    no work.
  * A is one TMA descriptor over all tokens: a tile's rows start at its first row in the group
    (`domain_offset`; `GroupedTileMap.tile_rows`, asked by producer and consumers alike), so a
    tile that ends past its group reads the next group's rows (or zeros past the last token)
    into accumulator rows that are never written.
  * B is one descriptor over (N, K, E); the group is the batch index.
  * the epilogue stores whole tiles with TMA; a tile that ends past its group's last row (the
    group's last row of tiles) stores from registers with per-element row/column predicates,
    since a TMA store clips only at the tensor's edge, not at the group's. With config
    overlap_last such a tile starts tile_m rows before the group's end instead (when the group
    has that many rows): it recomputes rows of the tile before it and stores them again, the
    same values (two CTAs may store those rows at once: benign only because the values are
    bit-identical, so an epilogue that reads or accumulates into the output cannot use it), and
    every tile of the group is stored whole (routed groups measured 5-60%
    slower than even ones with the predicated stores: grouped_routing.py). With config
    staged_partial a partial tile goes through the staging buffer too (stmatrix), and every
    epilogue thread copies 16-byte pieces of its rows before the group's end to global memory.
    With config half_tiles a consumer warp group whose 64 rows of the tile all lie past the
    group's end (or whose tile lies past N) waits for and releases every stage but issues no
    MMAs, and a last tile with at most half its rows in the group keeps its place (a partial
    tile) instead of moving back: half a tile's MMAs instead of a whole tile's, mostly recomputed.
  * clusters (config cluster_m x cluster_n, up to 2x2): the CTAs of a cluster take one block
    of tiles of one group (the tile map's work unit), so the two row tiles of a 2x1 cluster
    multicast halves of their shared weight tile to each other, and the two column tiles of a
    1x2 cluster halves of their shared token rows; a 2x2 cluster does both, each CTA loading half
    of its weight tile and half of its token rows. A CTA whose tile lies past its group's rows
    or past N loads its half and computes as usual (its peers' stages need its loads and its
    releases) and skips the epilogue.

Gated variant (problem.gate, an activation name; the MoE up projection with gate and up fused in
one weight, as transformers and torchtitan hold it): b[g] has 2F columns, gate in [0, F) and up
in [F, 2F), and d (T, F) = act(a @ b[g][:, :F]) * (a @ b[g][:, F:]) in the epilogue, so the
(T, 2F) product never reaches memory. A CTA's weight tile is two half tiles, tile_n / 2 gate
columns and the same up columns, loaded as two TMA boxes into the two halves of each stage (the
half tiles' smem layout, twice the stages, addresses the stage's memory exactly as the full one
does at tile_k 64: the MMA reads the stage as one tile_n-column operand). Gate and up values of
an output element sit in the same thread's accumulator, tile_n / 2 columns apart.

The gate's gradient (problem.gate_grad; the MoE down projection's input gradient with SwiGLU's
backward fused in): the product y (T, F) is the gradient of act(gate) * up, and the epilogue reads
the saved gate and up (T, F) each at each value's place (plain loads, the row clamped to the
group's) and stores d = [y * up * act'(gate) | y * act(gate)] (T, 2F), each output subtile twice,
F columns apart; y never reaches memory. F must be a multiple of the subtile's 32 columns.

Tensor conventions of the jit function: a (T, K) row-major; b (N, K, E), from torch's b (E, K, N)
as b.permute(2, 1, 0) (b_major "k": b[g] is the transpose of an (N, K) row-major weight; "n": b[g]
is (K, N) row-major); offs int32 (E,); d (T, N) row-major. The compiled function (TVM-FFI, env
stream) is f(a, b, offs, d, rows, gate, up): rows None, or (problem.rows) the int32/int64 index (T,)
that picks a's row for each row of d, a then any number of rows (the gathered A loads by
cp.async); gate and up None, or (problem.gate_grad) the saved halves (T, N) each, d then (T, 2N).
Rows of d past offs[E-1] are not written.
"""
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_tensor

from ..common import barriers
from ..common.device_assert import trap
from ..common.activations import activations, gate_gradients
from ..common.grouped_tile_map import GroupedTileMap, write_tables
from ..common.tile_scheduler import TileScheduler
from .config import EPI_STAGES, SM_COUNT, GemmConfig
from .grouped_config import MAX_GROUPS, GroupedConfig, GroupedProblem, smem_bytes, unsupported_reason
from .grouped_stores import GroupedStores
from .sm90 import CUTE_DTYPES, HopperGemm

INDEX_CUTE_TYPES = {"int32": Int32, "int64": cutlass.Int64}  # of GroupedProblem.rows


class GroupedHopperGemm(GroupedStores, HopperGemm):
    """The dense GEMM's CTA over a grouped tile map; cooperative consumers (the weight-gradient
    subclass also runs ping-pong)."""

    def __init__(self, config: GroupedConfig, b_major: str, num_sms: int = SM_COUNT, a_major: str = "k",
                 gate: str = "", gather: bool = False, gate_grad: str = ""):
        dense = GemmConfig(config.tile_m, config.tile_n, config.tile_k, config.cluster_m, config.cluster_n,
                           config.stages, config.consumer_warpgroups, True, config.pingpong)
        super().__init__(dense, a_major, b_major, False, False, None, num_sms=num_sms)
        self.grouped_cfg = config
        self.gate = gate
        self.gate_grad = gate_grad  # the epilogue turns the product into [gate | up]'s gradient
        self.gather = gather  # a's rows picked by a row-index tensor (the MoE permute fused in)
        if gather and self.num_consumers == 2:
            # the gathering producer spills at 40 and at 48 registers (ptxas, 128x256 tiles); 56 fit
            # beside two consumer warp groups of 224 (128 * 56 + 256 * 224 <= 65536), which do not spill
            self.producer_regs, self.consumer_regs = 56, 224
        elif gather:  # one consumer warp group leaves the register file room
            self.producer_regs = 64
        # output columns of a tile; a TMA box of the weight covers the same columns (gated: per half)
        self.out_tn = config.tile_n // 2 if gate else config.tile_n

    @cute.jit
    def _load_halves(self, mGate: cute.Tensor, mUp: cute.Tensor, tRS_cD: cute.Tensor, e_coord, first_row: Int32,
                     first_col: Int32, row_end: Int32, n_cols: Int32, r_gate: cute.Tensor, r_up: cute.Tensor):
        """This thread's saved gate and up values of output subtile `e_coord` (the gate's gradient),
        each row clamped into the group and a subtile past N moved onto N's last (N is a multiple of
        the subtile's columns): what lies past them is never stored."""
        r_base = first_row + e_coord[0] * self.epi_tile[0]
        c_base = cutlass.min(first_col + e_coord[1] * self.epi_tile[1], n_cols - self.epi_tile[1])
        for v in cutlass.range_constexpr(cute.size(r_gate)):
            r = cutlass.max(cutlass.min(r_base + tRS_cD[v][0], row_end - 1), 0)
            c = c_base + tRS_cD[v][1]
            r_gate[v] = mGate[r, c]
            r_up[v] = mUp[r, c]

    def _out_cols(self, mD: cute.Tensor):
        """The product's columns: d's, or half of them (the gate's gradient: [gate | up]'s)."""
        return mD.shape[1] // 2 if self.gate_grad else mD.shape[1]

    def _tile_rows(self, tiles: GroupedTileMap, tile, mD: cute.Tensor):
        """(first row, end row) of a tile, as producer and consumers must both place it."""
        return tiles.tile_rows(tile, mD.shape[0], self.grouped_cfg.overlap_last, self.grouped_cfg.half_tiles)

    def _gathered_a_pipeline(self, barriers):
        """Gathered A's ring: every producer thread's cp.async copies of a stage arrive on its full
        barrier as they land (noinc), every consumer thread releases it."""
        return pipeline.PipelineCpAsync.create(
            barrier_storage=barriers.data_ptr(), num_stages=self.cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads), defer_sync=True)

    @cute.jit
    def _release(self, ab_pipe, a_pipe, state):
        ab_pipe.consumer_release(state)
        if cutlass.const_expr(self.gather):
            a_pipe.consumer_release(state)

    def _gather_fragments(self, sA: cute.Tensor, tidx):
        """A producer thread's share of a gathered A stage: the 16-byte cp.async atom, its pieces of
        the ring (CPY, row passes, 1, stage) and their (row, column) in the tile. A row's tile_k
        columns are tile_k / 8 pieces; the warp group copies 128 / (tile_k / 8) rows per pass."""
        vec = 128 // self.ab_dtype.width
        per_row = self.tile_mnk[2] // vec
        # cached in L2 only (.cg): a token's row comes back for its other experts' tiles, in other CTAs
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), self.ab_dtype,
                                   num_bits_per_copy=128)
        copy = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((128 // per_row, per_row), order=(1, 0)),
                                       cute.make_layout((1, vec)))
        thr = copy.get_slice(tidx)
        tile = (self.tile_mnk[0], self.tile_mnk[2])
        return atom, thr.partition_D(sA), thr.partition_D(cute.make_identity_tensor(tile))

    @cute.jit
    def _gathered_tokens(self, gather, mRows: cute.Tensor, tokens_a, first_row: Int32, row_end: Int32
                         ) -> cute.Tensor:
        """The token (a's row) of each row this thread copies in the tile starting at `first_row`;
        positions at or past the group's `row_end` read the group's last row's token (their
        products are never stored; the index past offs[-1] is never read). A negative index counts
        from a's end, as torch's indexing does; one outside a's rows stops the kernel (trap), as
        torch's device-side index check does."""
        _, tAsA, tAcA = gather
        passes = cute.size(tAsA, mode=[1])
        last = cutlass.max(row_end - 1, 0)
        tokens = cute.make_rmem_tensor(cute.make_layout(passes), Int32)
        for p in cutlass.range_constexpr(passes):
            token = mRows[cutlass.min(first_row + tAcA[(0, p, 0)][0], last)]
            if token < 0:
                token = token + tokens_a
            if token < 0 or token >= tokens_a:
                trap()
            tokens[p] = Int32(token)
        return tokens

    @cute.jit
    def _copy_gathered(self, gather, mA: cute.Tensor, tokens: cute.Tensor, kt, stage):
        """This thread's cp.async pieces of k-tile `kt` of the tile's gathered rows into `stage`; a
        piece past K (the last k-tile of a K not a multiple of tile_k) is zero-filled, as TMA fills
        the weight's: nothing past a row is read (K is a multiple of 8: a piece is in or out)."""
        atom, tAsA, tAcA = gather
        vec = 128 // self.ab_dtype.width
        col = kt * self.tile_mnk[2] + tAcA[(0, 0, 0)][1]
        # one predicate for the piece's 8 values (the copy's shape, every value the same flag)
        in_k = cute.make_rmem_tensor(cute.make_layout((vec, 1), stride=(0, 0)), cutlass.Boolean)
        in_k[0] = col < mA.shape[1]
        for p in cutlass.range_constexpr(cute.size(tAsA, mode=[1])):
            # 16-byte aligned: row strides and col are multiples of 8 elements
            src = mA.iterator + (cutlass.Int64(tokens[p]) * mA.stride[0] + col)
            piece = cute.make_tensor(cute.make_ptr(self.ab_dtype, src.toint(), cute.AddressSpace.gmem,
                                                   assumed_align=16), cute.make_layout(vec))
            cute.copy(atom, piece, tAsA[(None, p, 0, stage)], pred=in_k)

    def _shared_storage(self):
        st, lay_a, lay_b, lay_d = self.cfg.stages, self.sA_layout, self.sB_layout, self.sD_layout
        ab_t, d_t = self.ab_dtype, self.d_dtype

        @cute.struct
        class SharedStorage:
            ab_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            a_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]  # gathered A's ring (unused otherwise)
            sA: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_a)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_b)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[d_t, cute.cosize(lay_d)], 1024]
            sEnds: cute.struct.Align[cute.struct.MemRange[Int32, MAX_GROUPS + 1], 16]
            sPrefix: cute.struct.Align[cute.struct.MemRange[Int32, MAX_GROUPS + 1], 16]

        return SharedStorage

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOffs: cute.Tensor, mD: cute.Tensor,
                 mRows: Optional[cute.Tensor], mGate: Optional[cute.Tensor], mUp: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        self.ab_dtype, self.d_dtype = mA.element_type, mD.element_type
        self._setup()
        tm, tn, tk = self.tile_mnk
        cm, cn = self.cluster_mn
        tma_a, gA = cpasync.make_tiled_tma_atom(self._load_op(self.mcast_a), mA,
                                                cute.slice_(self.sA_layout, (None, None, 0)), (tm, tk),
                                                num_multicast=self.mcast_a)
        # the weight's TMA boxes: whole stages, or (gated) half stages in a layout of twice the stages
        sB_box_layout = self.sB_layout
        if cutlass.const_expr(bool(self.gate)):
            sB_box_layout = sm90_utils.make_smem_layout_b(self.b_layout, (tm, self.out_tn, tk), self.ab_dtype,
                                                          2 * self.cfg.stages)
        tma_b, gB = cpasync.make_tiled_tma_atom(self._load_op(self.mcast_b), mB,
                                                cute.slice_(sB_box_layout, (None, None, 0)), (self.out_tn, tk),
                                                num_multicast=self.mcast_b)
        tma_d, gD = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mD,
                                                cute.slice_(self.sD_layout, (None, None, 0)), self.epi_tile)
        # the work units are known only on the device: launch for an upper bound (max_work_units),
        # capped at a wave of clusters
        work_bound = cute.ceil_div(cute.ceil_div(self._out_cols(mD), self.out_tn), cn) * (
            cute.ceil_div(mD.shape[0], tm * cm) + mOffs.shape[0])
        grid_z = TileScheduler.launch_clusters(work_bound, self.max_clusters)
        self.shared_storage = self._shared_storage()
        assert self.shared_storage.size_in_bytes() == smem_bytes(
            self.grouped_cfg, self.ab_dtype.width // 8, self.d_dtype.width // 8)
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, mA, mD, mOffs, mRows, mGate, mUp, self.tiled_mma,
                    self.sA_layout, self.sB_layout, sB_box_layout, self.sD_layout
                    ).launch(grid=[cm, cn, grid_z], block=[self.threads, 1, 1], cluster=[cm, cn, 1],
                             min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, tA: cute.Tensor, tma_b: cute.CopyAtom, tB: cute.Tensor,
               tma_d: cute.CopyAtom, tD: cute.Tensor, mA: cute.Tensor, mD: cute.Tensor, mOffs: cute.Tensor,
               mRows: Optional[cute.Tensor], mGate: Optional[cute.Tensor], mUp: Optional[cute.Tensor],
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, sB_box_layout: cute.ComposedLayout, sD_layout: cute.ComposedLayout):
        tm, tn, tk = self.tile_mnk
        out_tn = self.out_tn
        cm, cn = self.cluster_mn
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)
        cta_layout = cute.make_layout((cm, cn, 1))
        cta_coord = cta_layout.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sB_box = storage.sB.get_tensor(sB_box_layout.outer, swizzle=sB_box_layout.inner)  # the producer's view
        sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)
        sEnds = storage.sEnds.get_tensor(cute.make_layout(MAX_GROUPS + 1))
        sPrefix = storage.sPrefix.get_tensor(cute.make_layout(MAX_GROUPS + 1))

        # the TMA ring's bytes per stage: A's and B's, or B's alone where A is gathered (a ring of its
        # own, filled by cp.async)
        a_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sA_layout, (None, None, 0)))
        b_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sB_layout, (None, None, 0)))
        ab_pipe = self._ab_pipeline(storage.ab_bars, b_bytes if self.gather else a_bytes + b_bytes)
        a_pipe = self._gathered_a_pipeline(storage.a_bars) if self.gather else None
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_arrive_relaxed()  # peers must not signal our barriers before they exist

        # group tables from the device offsets, counting cluster blocks of tiles; the CTA-wide sync
        # after them also publishes the pipeline barriers' initialisation
        n_cols = self._out_cols(mD)  # gated: the up half starts at this column of the weight; gate_grad: of d
        write_tables(mOffs, sEnds, sPrefix, cute.ceil_div(cute.ceil_div(n_cols, out_tn), cn), tm * cm, tidx,
                     self.threads)
        cute.arch.sync_threads()
        tiles = GroupedTileMap.create(sEnds, sPrefix, mOffs.shape[0], tm, MAX_GROUPS, (cm, cn))
        scheduler = TileScheduler.create(tiles, cta_coord)

        gB = cute.local_tile(tB, (out_tn, tk), (None, None, None))
        # each CTA of a cluster column (2x1, 2x2) loads half of each shared weight box into both
        tBsB, tBgB = cpasync.tma_partition(tma_b, cta_coord[0], cute.make_layout(cm),
                                           cute.group_modes(sB_box, 0, 2), cute.group_modes(gB, 0, 2))
        tBgB_up = tBgB
        if cutlass.const_expr(bool(self.gate)):
            gB_up = cute.local_tile(cute.domain_offset((n_cols, 0, 0), tB), (out_tn, tk), (None, None, None))
            _, tBgB_up = cpasync.tma_partition(tma_b, cta_coord[0], cute.make_layout(cm),
                                               cute.group_modes(sB_box, 0, 2), cute.group_modes(gB_up, 0, 2))
        k_tiles = cute.size(gB, mode=[3])
        # epilogue subtiles of the output tile, n fastest like the accumulator; gated, the gate
        # values of output subtile (i, j) are the accumulator's subtile (i, j) of the full tile
        # and the up values its subtile (i, j + up_shift)
        epi_tiles = (tm // self.epi_tile[0], out_tn // self.epi_tile[1])
        epi_order = cute.make_layout(epi_tiles, stride=(epi_tiles[1], 1))
        n_epi = epi_tiles[0] * epi_tiles[1]
        acc_epi_n = tn // self.epi_tile[1]  # subtiles per row of the accumulator
        up_shift = out_tn // self.epi_tile[1]

        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_wait()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            # warp 0 loads by TMA; gathered, every producer thread also copies pieces of A's rows
            if warp_idx < (4 if self.gather else 1):
                a_mask, b_mask = self._mcast_masks(cta_layout, cta_coord)
                ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
                gather = self._gather_fragments(sA, tidx) if self.gather else None
                work = scheduler.first()
                while scheduler.valid(work):
                    tile = scheduler.tile(work)
                    # the tile's rows from its first; rows past its group's end are read but never stored
                    first_row, row_end = self._tile_rows(tiles, tile, mD)
                    tAsA, tAgA, tokens = None, None, None
                    if cutlass.const_expr(self.gather):
                        tokens = self._gathered_tokens(gather, mRows, mA.shape[0], first_row, row_end)
                    else:
                        gA = cute.local_tile(cute.domain_offset((first_row, 0), tA), (tm, tk), (0, None))
                        # each CTA of a cluster row (1x2, 2x2) loads half of the shared token rows into both
                        tAsA, tAgA = cpasync.tma_partition(tma_a, cta_coord[1], cute.make_layout(cn),
                                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    tBgB_t = tBgB[(None, tile.n, None, tile.batch)]
                    tBgB_up_t = tBgB_up[(None, tile.n, None, tile.batch)]
                    for kt in range(k_tiles):
                        if warp_idx == 0:
                            if cutlass.const_expr(self.grouped_cfg.prefetch > 0):  # the weight into L2, ahead
                                ahead = kt + self.grouped_cfg.prefetch
                                if ahead < k_tiles:
                                    with cute.arch.elect_one():  # one lane (a TMA copy elects its own)
                                        cute.prefetch(tma_b, tBgB_t[(None, ahead)])
                                        if cutlass.const_expr(bool(self.gate)):
                                            cute.prefetch(tma_b, tBgB_up_t[(None, ahead)])
                            ab_pipe.producer_acquire(ab_state)
                            bar = ab_pipe.producer_get_barrier(ab_state)
                            if cutlass.const_expr(not self.gather):
                                cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, ab_state.index)], tma_bar_ptr=bar,
                                          mcast_mask=a_mask)
                            if cutlass.const_expr(bool(self.gate)):  # gate half, then up half of the stage
                                cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, 2 * ab_state.index)],
                                          tma_bar_ptr=bar, mcast_mask=b_mask)
                                cute.copy(tma_b, tBgB_up_t[(None, kt)], tBsB[(None, 2 * ab_state.index + 1)],
                                          tma_bar_ptr=bar, mcast_mask=b_mask)
                            else:
                                cute.copy(tma_b, tBgB_t[(None, kt)], tBsB[(None, ab_state.index)], tma_bar_ptr=bar,
                                          mcast_mask=b_mask)
                            ab_pipe.producer_commit(ab_state)
                        if cutlass.const_expr(self.gather):
                            a_pipe.producer_acquire(ab_state)
                            self._copy_gathered(gather, mA, tokens, kt, ab_state.index)
                            a_pipe.producer_commit(ab_state)  # arrives when this thread's copies land
                        ab_state.advance()
                    work = scheduler.next(work)
                # (producer_tail advances the state it is given: the gathered ring's first)
                if cutlass.const_expr(self.gather):
                    a_pipe.producer_tail(ab_state.clone())
                if warp_idx == 0:
                    ab_pipe.producer_tail(ab_state)

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128  # thread index among the consumer warp groups
            epi_barrier = pipeline.NamedBarrier(barrier_id=barriers.gemm_epilogue(0), num_threads=self.epi_threads)
            thr_mma = tiled_mma.get_slice(ctid)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((tm, tn))).shape, Float32)
            k_blocks = cute.size(tCrA, mode=[2])

            r2s, tRS_sD, tRS_acc, tRS_cD, tRS_rD, tRS_rOut = self._epilogue_fragments(tiled_mma, acc, sD, ctid)
            n_vals = cute.size(tRS_rD)
            tRS_rUp = cute.make_rmem_tensor(tRS_cD.shape, Float32)
            gate_fn = activations(self.d_dtype.width == 16)[self.gate] if self.gate else None
            grad_fn = gate_gradients()[self.gate_grad] if self.gate_grad else None
            # the gate's gradient: the saved gate and up of a subtile; where the accumulator leaves the
            # registers (64 a thread or fewer), of two, the next one's loads in flight while the current
            # one is stored (a 128x256 tile's 128 spilled with them)
            loads_ahead = tm * tn // (128 * self.tile_wgs) <= 64
            halves = [tuple(cute.make_rmem_tensor(tRS_cD.shape, self.d_dtype) for _ in range(2))
                      for _ in range(2 if loads_ahead else 1)] if self.gate_grad else None
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads))
            is_store_warp = warp_idx == 4

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            n_stored = Int32(0)  # TMA-stored subtiles: picks the staging buffer
            work = scheduler.first()
            while scheduler.valid(work):
                tile = scheduler.tile(work)
                first_row, row_end = self._tile_rows(tiles, tile, mD)
                first_col = tile.n * out_tn
                # half_tiles: a warp group whose rows all lie past the group (or whose tile lies past N)
                # waits for and releases every stage as usual but issues no MMAs
                mma_on = True
                if cutlass.const_expr(self.grouped_cfg.half_tiles):
                    mma_on = first_row + 64 * (wg_idx - 1) < row_end and first_col < n_cols
                # ---- mainloop: keep one wgmma batch in flight, release the stage behind it
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for kt in range(k_tiles):
                    ab_pipe.consumer_wait(read_state)
                    if cutlass.const_expr(self.gather):
                        a_pipe.consumer_wait(read_state)
                        # cp.async wrote A through the generic proxy; WGMMA reads through the async one
                        cute.arch.fence_proxy("async.shared", space="cta")
                    if mma_on:
                        for kb in cutlass.range_constexpr(k_blocks):
                            coord = (None, None, kb, read_state.index)
                            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
                    warpgroup.commit_group()
                    read_state.advance()
                    if kt > 0:
                        warpgroup.wait_group(1)
                        self._release(ab_pipe, a_pipe, release_state)
                        release_state.advance()
                warpgroup.wait_group(0)
                if k_tiles > 0:
                    self._release(ab_pipe, a_pipe, release_state)
                    release_state.advance()
                if cutlass.const_expr(bool(self.gate_grad) and loads_ahead):  # the first subtile's gate and up
                    self._load_halves(mGate, mUp, tRS_cD, epi_order.get_hier_coord(0), first_row, first_col, row_end,
                                      n_cols, *halves[0])

                # ---- epilogue, one (64 * tile_wgs x 32) subtile at a time
                # a cluster peer's tile past its group's rows or past N: nothing to store
                if first_row < row_end and first_col < n_cols:
                    whole = first_row + tm <= row_end  # else the group's last rows: predicated stores
                    gD_t = cute.zipped_divide(
                        cute.local_tile(cute.domain_offset((first_row, first_col), tD), (tm, out_tn), (0, 0)),
                        self.epi_tile)
                    bsD, bgD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_t)
                    epi = (r2s, tRS_sD, sD, tRS_cD, tma_d, bsD, epi_barrier, store_pipe, is_store_warp, ctid)
                    bgD_up = bgD
                    if cutlass.const_expr(bool(self.gate_grad)):  # the up half's gradient, n_cols columns on
                        up_at = cute.domain_offset((first_row, n_cols + first_col), tD)
                        gD_up = cute.zipped_divide(cute.local_tile(up_at, (tm, out_tn), (0, 0)), self.epi_tile)
                        _, bgD_up = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                                                          gD_up)
                    for e in cutlass.range_constexpr(n_epi):
                        e_coord = epi_order.get_hier_coord(e)
                        e_acc = (e // epi_tiles[1]) * acc_epi_n + e % epi_tiles[1]  # the same subtile in the acc
                        for v in cutlass.range_constexpr(n_vals):
                            tRS_rD[v] = tRS_acc[e_acc * n_vals + v]
                        if cutlass.const_expr(bool(self.gate_grad)):
                            if cutlass.const_expr(not loads_ahead or e + 1 < n_epi):
                                e_load = e + 1 if loads_ahead else e
                                self._load_halves(mGate, mUp, tRS_cD, epi_order.get_hier_coord(e_load), first_row,
                                                  first_col, row_end, n_cols, *halves[e_load % len(halves)])
                            r_gate, r_up = halves[e % len(halves)]
                            # a subtile past N stores neither half (the gate half's would land in the up half)
                            if first_col + e_coord[1] * self.epi_tile[1] < n_cols:
                                d_gate, d_up = grad_fn(tRS_rD.load(), r_gate.load().to(Float32), r_up.load().to(Float32))
                                tRS_rOut.store(d_gate.to(self.d_dtype))
                                n_stored = self._store_subtile(tRS_rOut, whole, n_stored, epi, bgD[(None, e_coord)],
                                                               mD, e_coord, first_row, first_col, row_end, n_cols)
                                tRS_rOut.store(d_up.to(self.d_dtype))
                                n_stored = self._store_subtile(tRS_rOut, whole, n_stored, epi, bgD_up[(None, e_coord)],
                                                               mD, e_coord, first_row, n_cols + first_col, row_end,
                                                               mD.shape[1])
                        else:
                            if cutlass.const_expr(bool(self.gate)):
                                for v in cutlass.range_constexpr(n_vals):
                                    tRS_rUp[v] = tRS_acc[(e_acc + up_shift) * n_vals + v]
                                tRS_rOut.store((gate_fn(tRS_rD.load()) * tRS_rUp.load()).to(self.d_dtype))
                            else:
                                tRS_rOut.store(tRS_rD.load().to(self.d_dtype))
                            n_stored = self._store_subtile(tRS_rOut, whole, n_stored, epi, bgD[(None, e_coord)], mD,
                                                           e_coord, first_row, first_col, row_end, n_cols)
                work = scheduler.next(work)
            store_pipe.producer_tail()


# ----------------------------------------------------------------------------- build
def build(dtype_name, out_dtype_name, a_major, b_major, tile_m, tile_n, tile_k, stages, consumer_warpgroups,
          cluster_m=1, cluster_n=1, gate="", prefetch=0, overlap_last=False, staged_partial=False, rows="",
          half_tiles=False, gate_grad="", num_sms=SM_COUNT):
    """(jit function, fake arguments) for cute.compile; see the module docstring for conventions."""
    problem = GroupedProblem(dtype_name, out_dtype_name, a_major, b_major, gate, rows, gate_grad)
    cfg = GroupedConfig(tile_m, tile_n, tile_k, stages, consumer_warpgroups, cluster_m, cluster_n, prefetch,
                        overlap_last, staged_partial, half_tiles=half_tiles)
    err = unsupported_reason(problem, cfg)
    if err:
        raise ValueError(err)
    ab_t, d_t = CUTE_DTYPES[dtype_name], CUTE_DTYPES[out_dtype_name]
    # one symbol per extent shared by all tensors, so the FFI checks that they agree
    T = cute.sym_int()
    N = cute.sym_int(divisibility=8)
    K = cute.sym_int(divisibility=8)
    E = cute.sym_int()

    def ld():
        return cute.sym_int64(divisibility=8)  # TMA needs 16-byte aligned strides

    # gathered: a holds the tokens (any count), rows (T,) picks d's row r from a's row rows[r]
    a = make_fake_tensor(ab_t, (cute.sym_int() if rows else T, K), stride=(ld(), 1), assumed_align=16)
    index = make_fake_tensor(INDEX_CUTE_TYPES[rows], (T,), stride=(1,), assumed_align=INDEX_CUTE_TYPES[rows].width // 8
                             ) if rows else None
    b_stride = (ld(), 1, ld()) if b_major == "k" else (1, ld(), ld())
    # gated: b has the gate and up columns, twice d's (the host checks that)
    b_n = cute.sym_int(divisibility=16) if gate else N
    b = make_fake_tensor(ab_t, (b_n, K, E), stride=b_stride, assumed_align=16)
    offs = make_fake_tensor(Int32, (E,), stride=(1,), assumed_align=4)
    # the gate's gradient: d is [gate | up]'s, twice b's columns (the host checks); the saved gate and
    # up have b's columns each
    d = make_fake_tensor(d_t, (T, cute.sym_int(divisibility=16) if gate_grad else N), stride=(ld(), 1),
                         assumed_align=16)
    gate_t, up_t = (make_fake_tensor(d_t, (T, N), stride=(ld(), 1), assumed_align=16) if gate_grad else None
                    for _ in range(2))
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    gemm = GroupedHopperGemm(cfg, b_major, num_sms=num_sms, gate=gate, gather=bool(rows), gate_grad=gate_grad)
    return gemm, (a, b, offs, d, index, gate_t, up_t, stream)
