"""The grouped GEMM's tile map, in plain Python with the kernel's own arithmetic: every output tile
of every group is visited exactly once, in group order and M-fastest within a group; empty groups
get no tiles; the host's launch bound is never below the tile count."""

import itertools
import random

import pytest

from inductor_cute.kernels.common.grouped_tile_map import (group_of, prefix_table, reference_tiles, tile_counts,
                                                          tile_in_group)
from inductor_cute.kernels.gemm.grouped_config import MAX_GROUPS, max_work_units


def ends_of(sizes):
    return list(itertools.accumulate(sizes))


def brute_force(sizes, n, tile_m, tile_n):
    """The expected tiles, by enumeration: (group, m, n, first row, row end)."""
    out, row = [], 0
    for g, rows in enumerate(sizes):
        tiles_m = -(-rows // tile_m)
        for n_tile in range(-(-n // tile_n)):
            for m in range(tiles_m):
                out.append((g, m, n_tile, row + m * tile_m, row + rows))
        row += rows
    return sorted(out, key=lambda t: (t[0], t[2], t[1]))


CASES = {
    "equal": [256] * 8,
    "skewed": [1, 0, 700, 3, 0, 0, 129, 64],
    "leading-and-trailing-empty": [0, 0, 5, 0, 0],
    "all-smaller-than-a-tile": [7, 1, 63, 2],
    "one-group": [1000],
    "unaligned-offsets": [127, 129, 255, 257, 1],
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tile_m,tile_n,n", [(128, 256, 1536), (64, 128, 200), (128, 128, 8)])
def test_every_tile_once_in_group_order(name, tile_m, tile_n, n):
    sizes = CASES[name]
    got = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS)
    assert got == brute_force(sizes, n, tile_m, tile_n)
    assert len(got) <= max_work_units(sum(sizes), n, len(sizes), tile_m, tile_n)
    # rows of a tile never start past its group's end, and tiles within a group do not overlap
    assert all(first < end for _, _, _, first, end in got)


def test_empty_groups_are_never_found():
    sizes = [0, 3, 0, 0, 200, 0]
    prefix = prefix_table(ends_of(sizes), 2, 128)
    assert prefix == [0, 0, 2, 2, 2, 6, 6]
    found = [group_of(w, prefix.__getitem__, len(sizes), MAX_GROUPS) for w in range(prefix[-1])]
    assert found == [1, 1, 4, 4, 4, 4]


def test_random_skewed_groups_at_the_group_limit():
    rng = random.Random(0)
    sizes = [rng.choice([0, 0, 1, 17, 128, 300, 4000]) for _ in range(MAX_GROUPS)]
    ends = ends_of(sizes)
    prefix = prefix_table(ends, 3, 128)
    for work in range(0, prefix[-1], 7):
        g = group_of(work, prefix.__getitem__, len(sizes), MAX_GROUPS)
        assert prefix[g] <= work < prefix[g + 1] and sizes[g] > 0


def test_tile_in_group_is_m_fastest():
    assert [tile_in_group(i, 300, 128) for i in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_decreasing_offsets_count_as_empty_groups():
    assert tile_counts([100, 50, 300], 2, 64) == [4, 0, 8]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cluster_mn", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tile_m,tile_n,n", [(128, 256, 1536), (128, 128, 384), (64, 128, 8)])
def test_clusters_cover_every_tile_once(name, cluster_mn, tile_m, tile_n, n):
    """A cluster's CTAs share a group; the tiles they store (rows in the group, columns in N) are
    exactly the tiles without clusters, each once; the launch bound covers the work units."""
    sizes = CASES[name]
    got = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn)
    size = cluster_mn[0] * cluster_mn[1]
    blocks = [got[i:i + size] for i in range(0, len(got), size)]
    assert all(len({t[0] for t in block}) == 1 for block in blocks), "a cluster spans two groups"
    stored = [t for t in got if t[3] < t[4] and t[2] * tile_n < n]
    assert sorted(stored) == sorted(brute_force(sizes, n, tile_m, tile_n))
    assert len(blocks) <= max_work_units(sum(sizes), n, len(sizes), tile_m, tile_n, cluster_mn)


def test_a_2x1_cluster_pairs_row_tiles_of_the_same_weight_columns():
    # 300 rows: row tiles 0, 1 then 2 and an idle peer (rows 384.. are past the group)
    got = reference_tiles([300], 256, 128, 128, MAX_GROUPS, (2, 1))
    assert [(m, n) for _, m, n, _, _ in got] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert [first < end for _, _, _, first, end in got] == [True, True, True, False] * 2


def assert_rows_covered(tiles, sizes, n, tile_m, tile_n):
    """The stored tiles (first row before the row end) of each group and column tile together
    cover exactly the group's rows."""
    starts = [0, *ends_of(sizes)]
    for g, rows in enumerate(sizes):
        for n_tile in range(-(-n // tile_n)):
            covered = set()
            for _, _, _, first, end in (t for t in tiles if t[0] == g and t[2] == n_tile and t[3] < t[4]):
                covered |= set(range(first, min(first + tile_m, end)))
            assert covered == set(range(starts[g], starts[g] + rows))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cluster_mn", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tile_m", [64, 128])
def test_overlap_last_stores_whole_tiles_that_cover_every_row(name, cluster_mn, tile_m):
    """With overlap_last the stored tiles of a group of tile_m rows or more are all whole and lie
    inside the group, and together cover its rows; a smaller group keeps its one partial tile at
    its first row; the same tiles are visited (m, n and the idle peers unchanged)."""
    sizes, n, tile_n = CASES[name], 384, 128
    plain = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn)
    got = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn, overlap_last=True)
    assert [t[:3] for t in got] == [t[:3] for t in plain]
    starts = [0, *ends_of(sizes)]
    for (g, _, n_tile, first, end), (_, _, _, plain_first, _) in zip(got, plain):
        row0 = starts[g]
        if plain_first >= end:  # a peer past the group's rows: stores nothing, as before
            assert first == plain_first
        elif end - row0 >= tile_m:
            assert row0 <= first and first + tile_m <= end  # whole, inside the group
        else:
            assert first == row0 == plain_first  # the group's one partial tile
    assert_rows_covered(got, sizes, n, tile_m, tile_n)


def test_overlap_last_moves_only_a_groups_last_tile_back():
    # 300 rows from row 1000 in 128-row tiles: 1000, 1128, then 1172 (not 1256), overlapping 84 rows
    got = reference_tiles([1000, 1300], 128, 128, 128, MAX_GROUPS, overlap_last=True)
    assert [first for g, _, _, first, _ in got if g == 1] == [1000, 1128, 1172]


def test_overlap_last_cuts_the_group_rows_at_the_tokens():
    # offsets past the 1100 tokens: the kernel stores nothing past them, and a moved tile ends at
    # the last token (972..1099), not at the group's end; a group cut below a tile keeps its row0
    got = reference_tiles([1000, 1300], 128, 128, 128, MAX_GROUPS, overlap_last=True, tokens=1100)
    assert [(first, end) for g, _, _, first, end in got if g == 1] == [(1000, 1100), (1128, 1100), (1256, 1100)]
    got = reference_tiles([700, 1300], 128, 128, 128, MAX_GROUPS, overlap_last=True, tokens=1100)
    assert [(first, end) for g, _, _, first, end in got if g == 1][:4] == [(700, 1100), (828, 1100), (956, 1100),
                                                                          (972, 1100)]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cluster_mn", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_half_tiles_keep_a_last_tile_of_at_most_half_its_rows_in_place(name, cluster_mn):
    """With half_tiles (and overlap_last) a group's last tile that holds at most tile_m / 2 of its
    rows keeps its place, partial, and only the first half of it has rows of the group; the other
    tiles are placed as overlap_last places them; together they still cover every row."""
    sizes, n, tile_m, tile_n = CASES[name], 384, 128, 128
    overlapped = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn, overlap_last=True)
    plain = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn)
    got = reference_tiles(ends_of(sizes), n, tile_m, tile_n, MAX_GROUPS, cluster_mn, overlap_last=True,
                          half_tiles=True)
    assert [t[:3] for t in got] == [t[:3] for t in plain]
    for (g, _, _, first, end), (_, _, _, moved, _), (_, _, _, nominal, _) in zip(got, overlapped, plain):
        if nominal < end <= nominal + tile_m // 2:  # at most half the tile's rows left: kept in place
            assert first == nominal
        else:
            assert first == moved
    assert_rows_covered(got, sizes, n, tile_m, tile_n)


def test_half_tiles_place_the_moe_blocks_tails():
    # 300 rows from row 1000: tiles 1000, 1128, then 1256 kept (44 rows, a half tile) where
    # overlap_last alone moves it to 1172; 200 rows from 1300: 1300, then 1372 moved (72 rows left)
    got = reference_tiles([1000, 1300, 1500], 128, 128, 128, MAX_GROUPS, overlap_last=True, half_tiles=True)
    assert [first for g, _, _, first, _ in got if g == 1] == [1000, 1128, 1256]
    assert [first for g, _, _, first, _ in got if g == 2] == [1300, 1372]
