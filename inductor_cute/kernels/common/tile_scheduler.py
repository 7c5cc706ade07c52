"""Which output tiles a CTA computes, and in which order: the tile walk of tiled kernels (CuTe DSL).

Two parts, so that a new kind of problem replaces only the first:
  * a tile map numbers the work units (one cluster's block of output tiles each) and turns a
    work index into the coordinates of the CTA's tile (`TileCoord`). `GroupedRaster` is the map
    of one dense, batched problem. A grouped GEMM whose groups have their own M (varlen, group
    offsets) brings its own map, with the same `count` and `coord`, that finds the group of a
    work index and returns the tile within that group's problem with `group` set; the kernel's
    loops stay as they are.
  * `TileScheduler` deals the work units to CTAs: CTA z of a grid of Z clusters takes z, z + Z,
    z + 2Z, ... Persistent kernels launch one wave of clusters and loop; non-persistent ones
    launch one cluster per work unit, so each loop runs once. Consumers that split a CTA's units
    between them (ping-pong) each take every `slots`-th one, starting at their own `slot`.

Every role of a kernel walks its tiles with the same loop (`work` stays a plain Int32 loop
variable):

    work = scheduler.first(slot, slots)
    while scheduler.valid(work):
        tile = scheduler.tile(work)
        ...
        work = scheduler.next(work, slots)
"""
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

MAX_GRID_Z = 65535  # the gridDim.z limit: the most clusters a non-persistent launch can have
HOPPER_MAX_GPCS = 8  # GPCs of a GH100 die: its parts keep at most this many

# The map and the scheduler are frozen dataclasses (Constexpr for trace-time fields) because the
# DSL must see through every object used inside a runtime `if` or `while`: a plain class there
# fails to trace (TYPE_DYNAMIC_EXPR_UNSUPPORTED).


class TileCoord(NamedTuple):
    """A CTA's output tile: tile indices along M and N, the batch index and, for a grouped
    problem, which group (0 for a single problem)."""

    m: object
    n: object
    batch: object
    group: object = 0


@dataclass(frozen=True)
class GroupedRaster:
    """The tiles of one dense (batched) output in a grouped ("swizzled") raster: runs of `group`
    cluster rows are swept column by column, so work units in flight together share rows of A
    and columns of B in L2. Work units are clusters; batches follow one another."""

    clusters_m: Int32
    clusters_n: Int32
    count: Int32  # work units
    cluster_mn: Constexpr
    group: Constexpr

    @staticmethod
    def create(tiles_m, tiles_n, batch, cluster_mn: tuple[int, int], group: int) -> "GroupedRaster":
        """`tiles_m` x `tiles_n` output tiles per batch, in clusters of `cluster_mn` tiles."""
        clusters_m = cute.ceil_div(tiles_m, cluster_mn[0])
        clusters_n = cute.ceil_div(tiles_n, cluster_mn[1])
        return GroupedRaster(clusters_m, clusters_n, clusters_m * clusters_n * batch, cluster_mn, group)

    def coord(self, work, cta_in_cluster) -> TileCoord:
        """The tile of CTA `cta_in_cluster` (its (m, n) in the cluster) in work unit `work`."""
        per_batch = self.clusters_m * self.clusters_n
        batch = work // per_batch
        rest = work - batch * per_batch
        span = self.group * self.clusters_n  # work units of one run of `group` cluster rows
        run = rest // span
        first_m = run * self.group
        rows = cutlass.min(self.clusters_m - first_m, self.group)  # the last run may be shorter
        within = rest - run * span
        cluster_m = first_m + within % rows
        cluster_n = within // rows
        return TileCoord(cluster_m * self.cluster_mn[0] + cta_in_cluster[0],
                         cluster_n * self.cluster_mn[1] + cta_in_cluster[1], batch)


@dataclass(frozen=True)
class TileScheduler:
    """Deals the work units of a tile map to the clusters of the grid (z dimension), in a static
    round robin. `create` it inside the kernel; `launch_clusters` sizes the grid on the host."""

    tile_map: object  # GroupedRaster or another map with `count` and `coord(work, cta_in_cluster)`
    cta_in_cluster: tuple
    start: Int32
    stride: Int32

    @staticmethod
    def create(tile_map, cta_in_cluster) -> "TileScheduler":
        # the grid never exceeds the work units: every cluster has at least one
        _, _, start = cute.arch.block_idx()
        _, _, stride = cute.arch.grid_dim()
        return TileScheduler(tile_map, cta_in_cluster, start, stride)

    @staticmethod
    def max_clusters(persistent: bool, num_sms: int, cluster_size: int) -> int:
        """The most clusters to launch: one wave when persistent, else one per work unit. A cluster
        runs within one GPC, whose SMs come in TPCs of two, and a Hopper die keeps at most 8 GPCs
        with however many TPCs its floorsweeping left each: a GPC with an odd count leaves one
        TPC idle under 4-CTA clusters. The 132-SM H100 SXM we measured fits 66 clusters of 2 but
        only 30 of 4 (the driver's count), and a cluster beyond those runs its whole share of the
        units after the others (a second wave: 2x2 clusters took 1.7-2x as long). The layout
        differs from die to die and the kernel is compiled for an SM count, not a die, so larger
        clusters assume the worst: every GPC wasting a cluster's TPCs but one (29 of 4 on 132 SMs;
        a GPU test compares this with the driver's count on the card it runs on)."""
        if not persistent:
            return MAX_GRID_Z
        if cluster_size <= 2:
            return max(1, num_sms // cluster_size)
        tpcs, per_cluster = num_sms // 2, cluster_size // 2
        return max(1, (tpcs - HOPPER_MAX_GPCS * (per_cluster - 1)) // per_cluster)

    @staticmethod
    def launch_clusters(work_units, max_clusters: int):
        """gridDim.z for `work_units` units (a tile map's `count`) and at most `max_clusters`."""
        return cutlass.min(work_units, max_clusters)

    def first(self, slot=0, slots: int = 1):
        """This CTA's first work unit for consumer `slot` of `slots` (the CTA's units are dealt
        to its slots in turn)."""
        if slots == 1:
            return self.start
        return self.start + slot * self.stride

    def valid(self, work):
        return work < self.tile_map.count

    def has_next(self, work):
        """Whether the CTA has another work unit after `work` (for any of its slots)."""
        return work + self.stride < self.tile_map.count

    def next(self, work, slots: int = 1):
        """The work unit after `work` for a consumer that takes every `slots`-th."""
        if slots == 1:
            return work + self.stride
        return work + slots * self.stride

    def tile(self, work) -> TileCoord:
        return self.tile_map.coord(work, self.cta_in_cluster)
