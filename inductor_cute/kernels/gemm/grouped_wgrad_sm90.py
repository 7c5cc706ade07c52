"""Grouped GEMM, weight-gradient form, on Hopper (sm_90a) in CuTe DSL: `torch._grouped_mm` of a
2-D a and a 2-D b whose groups split the reduction (the MoE backward's weight gradient),

    out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g], :]   for every group g (offs[-1] = 0)

in one persistent launch, the group sizes read on the device (no host sync).

The forward's CTA (grouped_sm90.py: TMA producer warp, WGMMA consumer warp groups, stmatrix +
TMA-store epilogue, `HopperGemm._setup` for layouts and MMA) over a dense tile map: every group
has a whole (M, N) output, so the work units are (group, M tile, N tile), E * tiles_m * tiles_n
of them, known on the host, dealt by `GroupedRaster` with the group as batch (tiles of one group
run together and share its tokens in L2). Every CTA first reads `offs` into a shared-memory table
of group ends; a unit's reduction runs over its group's tokens [start, end) in k-blocks of
tile_k tokens from `start` (A and B are one TMA descriptor each over all tokens, offset to the
group's first token). An empty group has no k-block and stores zeros.

The group's last k-block runs past `end` into the next group's tokens (or TMA's zeros past the
last token); where an operand is token-major, the first starts up to 7 tokens before the group
(TMA's innermost coordinate must be 16-byte aligned). Those tokens must not contribute. We chose
to zero them in shared memory, in both operands (0 * inf would still be NaN), after the stage has
landed and before the WGMMA reads it:
the consumer warps write zeros, fence the generic proxy against the async one and meet at a
named barrier. The other ways cost more where it matters: per-group tensor maps (TMA zero-fill
at the group's edge) need descriptor updates in global memory and proxy fences whenever a CTA
moves to another group, plus one descriptor slot per CTA, and a descriptor mistake can only be
found on a GPU; masking accumulator rows is impossible since tokens are the reduction. The mask
costs at most (tile_m + tile_n) * tile_k shared-memory stores per work unit, spread over the
consumer threads, against the unit's whole group of tokens streamed through TMA.

Clusters (config cluster_m x cluster_n; 2x2 with ping-pong only) take one block of output tiles of
one group, so all its CTAs run the same k-blocks: the two row tiles of a 2x1 cluster share the
token block of b (each loads half of it by TMA into both), the two column tiles of a 1x2 cluster
that of a, and a 2x2 cluster both: fewer operand bytes read out of L2 a unit (a 128x256 unit
reads 48 KB a k-block alone, 32 KB in a 2x1 cluster), which matters where units are long; units
of a few hundred tokens measured no gain (docs/perf-notes.md, twenty-eighth session). Each CTA
masks the boundary tokens in its own copy of a stage. A CTA whose tile lies past M or N (an odd
tile count) loads its share and computes as usual (its peers' stages need its loads and releases)
and skips the epilogue.

With `store_whole_tile` (the config's), the epilogue writes every subtile of the tile into its own
staging buffer and the store warp then issues all their TMA stores as one group, which drains
while the next unit's k-blocks run; the next epilogue first waits for that group's reads. Two
barriers a tile instead of two a subtile, for a tile of shared memory (fewer ring stages): where a
unit's reduction is short (MoE weight gradients at a few hundred tokens an expert), its store
otherwise follows its MMAs instead of overlapping the next unit's.

With `pingpong` (the config's; 128x128 tiles) the two consumer warp groups take the CTA's units
in turn, each a whole tile in its own registers, with its own subtile staging buffers, epilogue
barrier and store warp, as the dense kernel's ping-pong does; with the whole-tile store they share
one tile's buffer, taking turns at their epilogues too (each hands it over once its stores have
read it), so the ring keeps its stages. Both read the one ring in unit order: a warp
group passes over the other's unit by advancing its ring state by that unit's k-block count, read
from the group table. Named "turn" barriers make their mainloops alternate (a warp group hands the
turn over once its last WGMMA is issued), so one warp group's epilogue runs while the other's
WGMMAs keep the tensor cores busy: a unit of a few hundred tokens otherwise spends about as long
storing its tile as multiplying it. The boundary masks run within a turn, before their k-block's
WGMMAs; only the other warp group's WGMMAs still in flight overlap them.

Tensor conventions of the jit function: a (M, T), M-major (a_major "m": the transposed view of a
row-major (T, M), what autograd passes) or token-major ("k"); b (N, T), from torch's b (T, N) as
b.t(): N-major ("n": b row-major) or token-major ("k"); offs int32 (E,); d (M, N, E), from torch's
out (E, M, N) as out.permute(1, 2, 0), row-major. The compiled function (TVM-FFI, env stream) is
f(a, b, offs, d).
"""
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_tensor

from ..common import barriers
from ..common.grouped_tile_map import write_group_ends
from ..common.tile_scheduler import GroupedRaster, TileScheduler
from .config import EPI_STAGES, SM_COUNT
from .grouped_config import MAX_GROUPS, GroupedConfig, smem_bytes
from .grouped_sm90 import GroupedHopperGemm
from .grouped_wgrad_config import WgradProblem, unsupported_reason
from .sm90 import CUTE_DTYPES


class GroupedWgradHopperGemm(GroupedHopperGemm):
    """The forward's CTA over (group, M tile, N tile) work units, reducing over each group's
    tokens; cooperative or ping-pong consumers, clusters of one group's tiles."""

    def __init__(self, config: GroupedConfig, a_major: str, b_major: str, num_sms: int = SM_COUNT):
        super().__init__(config, b_major, num_sms=num_sms, a_major=a_major)
        self.a_major_mn, self.b_major_mn = a_major == "m", b_major == "n"  # tokens are not contiguous
        # k-blocks of a token-major operand start at 16-byte aligned tokens (bf16/fp16: 8)
        self.token_align = 1 if self.a_major_mn and self.b_major_mn else 8
        self.store_whole_tile = config.store_whole_tile
        # ping-pong's warp groups take turns at one whole-tile buffer (their epilogues alternate)
        self.shared_staging = config.store_whole_tile and config.pingpong

    def _setup(self):
        super()._setup()
        if self.store_whole_tile:  # a staging buffer for every subtile of the tile (one tile, shared in turn)
            tm, tn, _ = self.tile_mnk
            subtiles = (tm // self.epi_tile[0]) * (tn // self.epi_tile[1])
            self.sD_layout = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile, subtiles)

    def _shared_storage(self):
        st, lay_a, lay_b, lay_d = self.cfg.stages, self.sA_layout, self.sB_layout, self.sD_layout
        ab_t, d_t = self.ab_dtype, self.d_dtype

        @cute.struct
        class SharedStorage:
            ab_bars: cute.struct.MemRange[cutlass.Int64, 2 * st]
            sA: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_a)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_t, cute.cosize(lay_b)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[d_t, cute.cosize(lay_d)], 1024]
            sEnds: cute.struct.Align[cute.struct.MemRange[Int32, MAX_GROUPS + 1], 16]

        return SharedStorage

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOffs: cute.Tensor, mD: cute.Tensor,
                 stream: cuda.CUstream):
        self.ab_dtype, self.d_dtype = mA.element_type, mD.element_type
        self._setup()
        tm, tn, tk = self.tile_mnk
        cm, cn = self.cluster_mn
        tma_a, gA, tma_b, gB, tma_d, gD = self._tma_atoms(mA, mB, mD)
        # the kernel's tile map, for its count of work units (cluster blocks of tiles)
        tiles = GroupedRaster.create(cute.ceil_div(mD.shape[0], tm), cute.ceil_div(mD.shape[1], tn), mOffs.shape[0],
                                     self.cluster_mn, self.raster_group)
        grid_z = TileScheduler.launch_clusters(tiles.count, self.max_clusters)
        self.shared_storage = self._shared_storage()
        assert self.shared_storage.size_in_bytes() == smem_bytes(
            self.grouped_cfg, self.ab_dtype.width // 8, self.d_dtype.width // 8, tables=1)
        self.kernel(tma_a, gA, tma_b, gB, tma_d, gD, mOffs, self.tiled_mma,
                    self.sA_layout, self.sB_layout, self.sD_layout
                    ).launch(grid=[cm, cn, grid_z], block=[self.threads, 1, 1], cluster=[cm, cn, 1],
                             min_blocks_per_mp=1, stream=stream)

    def _k_span(self, sEnds: cute.Tensor, group):
        """(first token of the group's first k-block, tokens of the group before it, tokens from
        that first one to the group's end), warp-uniform (see GroupedTileMap.create). TMA needs a
        16-byte aligned innermost coordinate: where an operand is token-major, the k-blocks start
        at the group's first token rounded down to 16 bytes and the tokens before it are masked
        like those past its end (an unaligned coordinate is an illegal instruction, not a fault)."""
        start = cute.arch.make_warp_uniform(sEnds[group])
        end = cutlass.max(cute.arch.make_warp_uniform(sEnds[group + 1]), start)
        lead = start % self.token_align * cutlass.min(end - start, 1)  # an empty group has no k-block
        return start - lead, lead, end - (start - lead)

    def _k_tiles(self, sEnds: cute.Tensor, group):
        """The ring stages (k-blocks) of a unit of `group`."""
        return cute.ceil_div(self._k_span(sEnds, group)[2], self.tile_mnk[2])

    @cute.jit
    def _zero_tokens(self, stage: cute.Tensor, rows: cutlass.Constexpr, mn_major: cutlass.Constexpr, lo, hi, ctid):
        """Zero tokens lo..hi-1 of one (rows, tile_k) operand stage, spread over the threads of the
        tile's warp groups (a trip count that is the same for all of them, predicated stores). M/N-major
        stages take 16-byte stores of 8 rows of one token (contiguous under the swizzle),
        token-major ones single elements (8 tokens may straddle `lo` or `hi`)."""
        vec = 8 if mn_major else 1
        chunks = cute.zipped_divide(stage, (vec, 1))  # ((vec, 1), (rows // vec, tk))
        zeros = cute.make_rmem_tensor(cute.make_layout(vec), self.ab_dtype)
        zeros.fill(0.0)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype,
                                    num_bits_per_copy=vec * self.ab_dtype.width)
        per_token = rows // vec
        for i in range(lo * per_token, hi * per_token, self.epi_threads):
            idx = i + ctid
            if idx < hi * per_token:
                cute.copy(store, zeros, chunks[(None, (idx % per_token, idx // per_token))])

    @cute.jit
    def _mask_outside(self, sA_stage: cute.Tensor, sB_stage: cute.Tensor, lo, hi, ctid, barrier):
        """Zero both operands' tokens outside lo..hi-1 of a k-block, then make the zeros visible
        to WGMMA (proxy fence, and the tile's threads meet at `barrier`) before any reads them."""
        tm, tn, tk = self.tile_mnk
        if lo > 0 or hi < tk:
            self._zero_tokens(sA_stage, tm, self.a_major_mn, 0, lo, ctid)
            self._zero_tokens(sA_stage, tm, self.a_major_mn, hi, tk, ctid)
            self._zero_tokens(sB_stage, tn, self.b_major_mn, 0, lo, ctid)
            self._zero_tokens(sB_stage, tn, self.b_major_mn, hi, tk, ctid)
            cute.arch.fence_proxy("async.shared", space="cta")  # before WGMMA reads them
            barrier.arrive_and_wait()

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, tA: cute.Tensor, tma_b: cute.CopyAtom, tB: cute.Tensor,
               tma_d: cute.CopyAtom, tD: cute.Tensor, mOffs: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               sD_layout: cute.ComposedLayout):
        tm, tn, tk = self.tile_mnk
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
        sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)
        sEnds = storage.sEnds.get_tensor(cute.make_layout(MAX_GROUPS + 1))

        ab_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sA_layout, (None, None, 0))) + \
            cute.size_in_bytes(self.ab_dtype, cute.slice_(sB_layout, (None, None, 0)))
        ab_pipe = self._ab_pipeline(storage.ab_bars, ab_bytes)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_arrive_relaxed()  # peers must not signal our barriers before they exist

        # the group table; the CTA-wide sync after it also publishes the pipeline barriers' init
        tokens = tA.shape[1]
        write_group_ends(mOffs, sEnds, tokens, tidx, self.threads)
        cute.arch.sync_threads()

        gD = cute.local_tile(tD, (tm, tn), (None, None, None))  # (tm, tn, tiles_m, tiles_n, groups)
        tiles = GroupedRaster.create(cute.size(gD, mode=[2]), cute.size(gD, mode=[3]), cute.size(gD, mode=[4]),
                                     (cm, cn), self.raster_group)
        scheduler = TileScheduler.create(tiles, cta_coord)
        epi_tiles = (tm // self.epi_tile[0], tn // self.epi_tile[1])
        epi_order = cute.make_layout(epi_tiles, stride=(epi_tiles[1], 1))  # n fastest, like the acc
        n_epi = epi_tiles[0] * epi_tiles[1]

        if cutlass.const_expr(self.cluster_size > 1):
            cute.arch.cluster_wait()

        # ================================================================ producer
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                a_mask, b_mask = self._mcast_masks(cta_layout, cta_coord)
                ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
                work = scheduler.first()
                while scheduler.valid(work):
                    tile = scheduler.tile(work)
                    start, _, span = self._k_span(sEnds, tile.batch)
                    # k-blocks from the group's (aligned) first token; the consumers mask both ends
                    gA = cute.local_tile(cute.domain_offset((0, start), tA), (tm, tk), (tile.m, None))
                    gB = cute.local_tile(cute.domain_offset((0, start), tB), (tn, tk), (tile.n, None))
                    # in a cluster each CTA loads its half of the shared operand's block into both
                    tAsA, tAgA = cpasync.tma_partition(tma_a, cta_coord[1], cute.make_layout(cn),
                                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    tBsB, tBgB = cpasync.tma_partition(tma_b, cta_coord[0], cute.make_layout(cm),
                                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                    for kt in range(cute.ceil_div(span, tk)):
                        ab_pipe.producer_acquire(ab_state)
                        bar = ab_pipe.producer_get_barrier(ab_state)
                        cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, ab_state.index)], tma_bar_ptr=bar,
                                  mcast_mask=a_mask)
                        cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, ab_state.index)], tma_bar_ptr=bar,
                                  mcast_mask=b_mask)
                        ab_pipe.producer_commit(ab_state)
                        ab_state.advance()
                    work = scheduler.next(work)
                ab_pipe.producer_tail(ab_state)

        # ================================================================ consumers
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # the consumer slot of this warp group (cooperative: both in slot 0; ping-pong: its own)
            slot = 0  # a constant where cooperative
            if cutlass.const_expr(self.pingpong):
                slot = wg_idx - 1
            ctid = tidx - 128 * (1 + slot)  # thread index among the warp groups sharing a tile
            # the epilogue's barrier (the tile's threads) also orders the boundary mask before the MMA
            epi_barrier = pipeline.NamedBarrier(barrier_id=barriers.gemm_epilogue(slot), num_threads=self.epi_threads)
            thr_mma = tiled_mma.get_slice(ctid)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((tm, tn))).shape, Float32)
            k_blocks = cute.size(tCrA, mode=[2])
            r2s, tRS_sD, tRS_acc, tRS_cD, tRS_rD, tRS_rOut = self._epilogue_fragments(tiled_mma, acc, sD, ctid)
            n_vals = cute.size(tRS_rD)
            store_pipe = pipeline.PipelineTmaStore.create(  # whole tiles: one group of stores a tile
                num_stages=1 if self.store_whole_tile else EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.epi_threads))
            is_store_warp = warp_idx == 4 * (1 + slot)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
            slots = self.cfg.slots
            work = scheduler.first(slot, slots)
            if cutlass.const_expr(self.pingpong):
                # Slot 1 starts past the ring stages of the CTA's first unit, which is slot 0's, and
                # hands slot 0 the first turn.
                if slot == 1:
                    first = self._k_tiles(sEnds, scheduler.tile(scheduler.first()).batch)
                    read_state.advance(first)
                    release_state.advance(first)
                    self._turn(0, 0).arrive()
                    if cutlass.const_expr(self.shared_staging):
                        self._turn(1, 0).arrive()
            n_done = Int32(0)
            while scheduler.valid(work):
                tile = scheduler.tile(work)
                has_next = scheduler.has_next(work)  # the other slot's unit comes next
                _, lead, span = self._k_span(sEnds, tile.batch)
                k_tiles = cute.ceil_div(span, tk)
                tail = span - (k_tiles - 1) * tk  # tokens of the group in its last k-block
                # ---- mainloop: keep one wgmma batch in flight, release the stage behind it
                if cutlass.const_expr(self.pingpong):
                    self._turn(0, slot).arrive_and_wait()
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for kt in range(k_tiles):
                    ab_pipe.consumer_wait(read_state)
                    if kt == 0 or kt == k_tiles - 1:  # the group's first and last k-blocks
                        lo = lead if kt == 0 else 0
                        hi = tail if kt == k_tiles - 1 else tk
                        self._mask_outside(sA[(None, None, read_state.index)], sB[(None, None, read_state.index)],
                                           lo, hi, ctid, epi_barrier)
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

                # ---- epilogue: whole tiles by TMA (it clips at M and N), zeros for an empty group
                # (a cluster peer's tile past M or N: nothing to store, but the staging turn is taken)
                if cutlass.const_expr(self.shared_staging):
                    self._turn(1, slot).arrive_and_wait()  # the other's stores have read the buffer
                if tile.m * tm < tD.shape[0] and tile.n * tn < tD.shape[1]:
                    gD_t = cute.zipped_divide(gD[(None, None, tile.m, tile.n, tile.batch)], self.epi_tile)
                    bsD, bgD = cpasync.tma_partition(tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_t)
                    if cutlass.const_expr(self.store_whole_tile):
                        if cutlass.const_expr(not self.shared_staging):
                            if is_store_warp:  # the last tile's stores have read its buffers (drained in our mainloop)
                                store_pipe.producer_acquire()
                        epi_barrier.arrive_and_wait()
                        for e in cutlass.range_constexpr(n_epi):
                            for v in cutlass.range_constexpr(n_vals):
                                tRS_rD[v] = tRS_acc[e * n_vals + v]
                            tRS_rOut.store(tRS_rD.load().to(self.d_dtype))
                            cute.copy(r2s, tRS_rOut, tRS_sD[(None, None, None, e)])
                        cute.arch.fence_proxy("async.shared", space="cta")  # for the TMA unit's reads
                        epi_barrier.arrive_and_wait()
                        if is_store_warp:
                            for e in cutlass.range_constexpr(n_epi):
                                cute.copy(tma_d, bsD[(None, e)], bgD[(None, epi_order.get_hier_coord(e))])
                            store_pipe.producer_commit()
                            if cutlass.const_expr(self.shared_staging):
                                store_pipe.producer_acquire()  # read out before the other warp group writes
                    else:
                        for e in cutlass.range_constexpr(n_epi):
                            for v in cutlass.range_constexpr(n_vals):
                                tRS_rD[v] = tRS_acc[e * n_vals + v]
                            tRS_rOut.store(tRS_rD.load().to(self.d_dtype))
                            buf = slot * EPI_STAGES + (n_done * n_epi + e) % EPI_STAGES
                            self._tma_store_subtile(r2s, tRS_rOut, tRS_sD[(None, None, None, buf)], tma_d,
                                                    bsD[(None, buf)], bgD[(None, epi_order.get_hier_coord(e))],
                                                    epi_barrier, store_pipe, is_store_warp)
                    n_done += 1
                if cutlass.const_expr(self.pingpong):
                    if has_next:
                        # the staging buffer (the store warp arrives once its stores have read it)
                        if cutlass.const_expr(self.shared_staging):
                            self._turn(1, 1 - slot).arrive()
                        # pass over the other warp group's unit in the ring
                        other = self._k_tiles(sEnds, scheduler.tile(scheduler.next(work)).batch)
                        read_state.advance(other)
                        release_state.advance(other)
                work = scheduler.next(work, slots)
            store_pipe.producer_tail()


# ----------------------------------------------------------------------------- build
def build(dtype_name, out_dtype_name, a_major, b_major, tile_m, tile_n, tile_k, stages, consumer_warpgroups,
          cluster_m=1, cluster_n=1, prefetch=0, store_whole_tile=False, pingpong=False, num_sms=SM_COUNT):
    """(jit function, fake arguments) for cute.compile; see the module docstring for conventions."""
    problem = WgradProblem(dtype_name, out_dtype_name, a_major, b_major)
    cfg = GroupedConfig(tile_m, tile_n, tile_k, stages, consumer_warpgroups, cluster_m, cluster_n, prefetch,
                        store_whole_tile=store_whole_tile, pingpong=pingpong)
    err = unsupported_reason(problem, cfg)
    if err:
        raise ValueError(err)
    ab_t, d_t = CUTE_DTYPES[dtype_name], CUTE_DTYPES[out_dtype_name]
    # one symbol per extent shared by all tensors, so the FFI checks that they agree
    M = cute.sym_int(divisibility=8)
    N = cute.sym_int(divisibility=8)
    T = cute.sym_int(divisibility=8 if "k" in (a_major, b_major) else 1)
    E = cute.sym_int()

    def ld():
        return cute.sym_int64(divisibility=8)  # TMA needs 16-byte aligned strides

    a = make_fake_tensor(ab_t, (M, T), stride=(1, ld()) if a_major == "m" else (ld(), 1), assumed_align=16)
    b = make_fake_tensor(ab_t, (N, T), stride=(1, ld()) if b_major == "n" else (ld(), 1), assumed_align=16)
    offs = make_fake_tensor(Int32, (E,), stride=(1,), assumed_align=4)
    d = make_fake_tensor(d_t, (M, N, E), stride=(ld(), 1, ld()), assumed_align=16)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return GroupedWgradHopperGemm(cfg, a_major, b_major, num_sms=num_sms), (a, b, offs, d, stream)
