"""The tile map of a grouped GEMM whose groups have their own row counts (MoE: tokens routed to
each expert, given as cumulative group ends `offs` on the device).

Work units are the output tiles of all groups (without clusters; with them, blocks of tiles: see
below), group after group: group g has ceil(M_g / tile_m) * tiles_n of them, M_g = ends[g] -
ends[g - 1]; empty groups have none. Inside a group tiles go M-fastest, so work units in flight
together read the same columns of the group's weight. A kernel first writes two tables into shared memory (`write_tables`):

    ends[0] = 0, ends[g + 1] = offs[g]           row range of group g: [ends[g], ends[g + 1])
    prefix[0] = 0, prefix[g + 1] = tiles of groups 0..g

and `GroupedTileMap` finds a work unit's group with a branch-free binary search over the prefix
(the largest g with prefix[g] <= work: empty groups share their successor's prefix and are never
found). `count` = prefix[groups]. The map plugs into `TileScheduler` like `GroupedRaster`.

With clusters of (cm, cn) CTAs a work unit is one cluster's block of cm x cn tiles of one group:
the tables count blocks (rows in units of cm * tile_m, ceil(tiles_n / cn) block columns), and CTA
(i, j) of the cluster takes tile (cm * block_m + i, cn * block_n + j). All CTAs of a block share
the group, so they can share its weight tile (cm = 2, multicast B), its token rows (cn = 2,
multicast A) or both (2x2). A CTA whose tile lies past its group's rows or past N still loads and
computes (its peers wait for its share of the shared loads) but stores nothing.

The arithmetic (`group_of`, `tile_in_group`) is written against a few operations passed in, so
that the same code runs in the kernel and in plain Python (see `reference_tiles`).
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32

from .tile_scheduler import TileCoord


def _search_steps(max_groups: int) -> list[int]:
    """Powers of two, largest first, whose sum reaches max_groups."""
    step = 1
    while step < max_groups:
        step *= 2
    out = []
    while step:
        out.append(step)
        step //= 2
    return out


def group_of(work, prefix_at, groups, max_groups: int, minimum=min, select=None):
    """The group of work unit `work` (< prefix_at(groups)): the largest g in [0, groups] with
    prefix_at(g) <= work, found in log2(max_groups) + 1 branch-free steps."""
    select = select or (lambda cond, a, b: a if cond else b)
    g = 0
    for step in _search_steps(max_groups):
        probe = minimum(g + step, groups)
        g = select(prefix_at(probe) <= work, probe, g)
    return g


def tile_in_group(local, rows, tile_m: int, ceil_div=None):
    """(m, n) tile indices of a group's `local`-th work unit, M fastest, for a group of `rows`."""
    ceil_div = ceil_div or (lambda a, b: -(-a // b))
    tiles_m = ceil_div(rows, tile_m)
    return local % tiles_m, local // tiles_m


def tile_first_row(row0, row_end, m, tile_m: int, overlap_last: bool, minimum=min, maximum=max, select=None,
                   half_tiles: bool = False):
    """The first row of tile `m` of the group of rows [row0, row_end): row0 + m * tile_m, except,
    with `overlap_last`, for the group's last tile when it would end past row_end: that one starts
    tile_m rows before row_end (overlapping the tile before it, whose rows it computes and stores
    again with the same values), so that every tile of a group of tile_m rows or more is whole and
    stored by TMA. A group of fewer rows keeps its one partial tile; tiles past the group's rows
    (a cluster's peers) keep their place. With `half_tiles` a last tile with at most tile_m / 2 of
    the group's rows keeps its place too: its second half lies past the group, and the warp group
    of those rows skips its MMAs (GroupedConfig.half_tiles)."""
    first = row0 + m * tile_m
    if not overlap_last:
        return first
    select = select or (lambda cond, a, b: a if cond else b)
    kept = tile_m // 2 if half_tiles else 0  # group rows a last tile may hold and keep its place
    return select(first + kept < row_end, minimum(first, maximum(row0, row_end - tile_m)), first)


def tile_counts(ends: list[int], tiles_n: int, tile_m: int) -> list[int]:
    """Work units per group from cumulative group ends (a negative size counts as empty)."""
    starts = [0] + list(ends[:-1])
    return [-(-max(e - s, 0) // tile_m) * tiles_n for s, e in zip(starts, ends)]


def prefix_table(ends: list[int], tiles_n: int, tile_m: int) -> list[int]:
    out = [0]
    for c in tile_counts(ends, tiles_n, tile_m):
        out.append(out[-1] + c)
    return out


def reference_tiles(ends: list[int], n: int, tile_m: int, tile_n: int, max_groups: int,
                    cluster_mn: tuple[int, int] = (1, 1), overlap_last: bool = False, tokens: int | None = None,
                    half_tiles: bool = False):
    """Every CTA tile's (group, m, n, first row, row end), work unit after work unit and CTA after
    CTA of the cluster (M fastest), by the kernel's arithmetic in plain Python: for CPU tests and
    host-side planning. With clusters, tiles past a group's rows (first row >= row end) or past
    N (n * tile_n >= n) are the CTAs that store nothing. First rows as `tile_first_row` places
    them, in group rows cut at `tokens` where given (as the kernel cuts them: offsets past the
    tokens)."""
    cm, cn = cluster_mn
    tiles_n = -(-n // tile_n)
    prefix = prefix_table(ends, -(-tiles_n // cn), tile_m * cm)  # blocks of cn column tiles
    rows_end = [0] + list(ends)
    out = []
    for work in range(prefix[-1]):
        g = group_of(work, prefix.__getitem__, len(ends), max_groups)
        bm, bn = tile_in_group(work - prefix[g], rows_end[g + 1] - rows_end[g], tile_m * cm)
        for j in range(cn):
            for i in range(cm):
                m = bm * cm + i
                end = rows_end[g + 1] if tokens is None else min(rows_end[g + 1], tokens)
                first = tile_first_row(rows_end[g], end, m, tile_m, overlap_last, half_tiles=half_tiles)
                out.append((g, m, bn * cn + j, first, end))
    return out


# ----------------------------------------------------------------------------- in the kernel
def _select(cond, a, b):
    return Int32(cutlass.select_(cond, a, b))


@dataclass(frozen=True)
class GroupedTileMap:
    """The work units of a grouped problem (see the module docstring); `sEnds` and `sPrefix` are
    the shared-memory tables, (max_groups + 1) Int32 each, written by `write_tables`."""

    sEnds: cute.Tensor
    sPrefix: cute.Tensor
    groups: Int32
    count: Int32  # work units
    tile_m: Constexpr
    max_groups: Constexpr
    cluster_mn: Constexpr = (1, 1)

    @staticmethod
    def create(sEnds, sPrefix, groups, tile_m: int, max_groups: int,
               cluster_mn: tuple[int, int] = (1, 1)) -> "GroupedTileMap":
        """After `write_tables` (written with cluster-sized blocks) and a barrier. Values read from
        the tables are marked warp-uniform: otherwise ptxas cannot tell that loops bounded by them
        are, and serializes the WGMMAs inside them (C7519)."""
        count = cute.arch.make_warp_uniform(sPrefix[groups])
        return GroupedTileMap(sEnds, sPrefix, groups, count, tile_m, max_groups, cluster_mn)

    def coord(self, work, cta_in_cluster=(0, 0)) -> TileCoord:
        """The tile of CTA `cta_in_cluster` in work unit `work`: m and n within its group,
        batch = group = its group."""
        cm, cn = self.cluster_mn
        g = group_of(work, lambda i: self.sPrefix[i], self.groups, self.max_groups, cutlass.min, _select)
        g = cute.arch.make_warp_uniform(g)
        bm, bn = tile_in_group(work - self.sPrefix[g], self.sEnds[g + 1] - self.sEnds[g], self.tile_m * cm,
                               cute.ceil_div)
        m = cute.arch.make_warp_uniform(bm * cm + cta_in_cluster[0])
        n = cute.arch.make_warp_uniform(bn * cn + cta_in_cluster[1])
        return TileCoord(m, n, g, g)

    def rows(self, group):
        """[first, end) rows of `group` in the stacked tokens."""
        return cute.arch.make_warp_uniform(self.sEnds[group]), cute.arch.make_warp_uniform(self.sEnds[group + 1])

    def tile_rows(self, tile: TileCoord, tokens, overlap_last: bool, half_tiles: bool = False):
        """(first row, end row) of `tile`: its first row as `tile_first_row` places it in its group's
        rows, the end the group's, neither past `tokens` (offsets past the tokens store nothing
        there). Producer and consumers both ask here, so A's rows and the stored rows agree."""
        row0, row_end = self.rows(tile.group)
        row_end = cutlass.min(row_end, tokens)
        first = tile_first_row(row0, row_end, tile.m, self.tile_m, overlap_last, cutlass.min, cutlass.max, _select,
                               half_tiles)
        return cute.arch.make_warp_uniform(first), row_end


@cute.jit
def write_tables(mOffs: cute.Tensor, sEnds: cute.Tensor, sPrefix: cute.Tensor, tiles_n: Int32,
                 tile_m: cutlass.Constexpr, tidx: Int32, threads: cutlass.Constexpr):
    """Fill the group tables from the device offsets; all `threads` threads call it and then the
    caller syncs them. Two barriers inside: counts in parallel, then warp 0 scans them."""
    groups = mOffs.shape[0]
    if tidx == 0:
        sEnds[0] = Int32(0)
        sPrefix[0] = Int32(0)
    # the same trip count for every thread (a thread-dependent one would leave ptxas unsure
    # that the warp groups have converged and serialize the kernel's WGMMAs, C7519)
    for base in range(0, groups, threads):
        g = base + tidx
        if g < groups:
            start = Int32(0)
            if g > 0:
                start = mOffs[g - 1]
            end = mOffs[g]
            sEnds[g + 1] = end
            sPrefix[g + 1] = cute.ceil_div(cutlass.max(end - start, 0), tile_m) * tiles_n
    cute.arch.sync_threads()
    if tidx < 32:
        # lane l sums a chunk of counts, the warp scans the chunk sums, each lane rewrites its
        # chunk as a running prefix
        chunk = cute.ceil_div(groups, 32)
        first = tidx * chunk
        last = cutlass.min(first + chunk, groups)
        total = Int32(0)
        for g in range(first, last):
            total += sPrefix[g + 1]
        inclusive = total
        for shift in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
            if tidx >= (1 << shift):
                inclusive += other
        running = inclusive - total
        for g in range(first, last):
            running += sPrefix[g + 1]
            sPrefix[g + 1] = running


@cute.jit
def write_group_ends(mOffs: cute.Tensor, sEnds: cute.Tensor, tokens: Int32, tidx: Int32,
                     threads: cutlass.Constexpr):
    """sEnds[0] = 0, sEnds[g + 1] = min(offs[g], tokens): the token range of group g is
    [sEnds[g], sEnds[g + 1]) (empty when the second is not larger). For kernels whose groups split
    the reduction (a dense tile map over groups, no tile prefix); all `threads` threads call it
    and then the caller syncs them."""
    groups = mOffs.shape[0]
    if tidx == 0:
        sEnds[0] = Int32(0)
    for base in range(0, groups, threads):  # a thread-independent trip count, as in write_tables
        g = base + tidx
        if g < groups:
            sEnds[g + 1] = cutlass.min(mOffs[g], tokens)
