"""The order in which an attention forward kernel's CTAs take their (query block, head, batch)
tiles (plain Python: works on ints and on DSL integers).

Two things decide the order. A causal (or any lower-triangular) mask gives late query blocks the
most KV blocks, and CTAs start roughly in launch order: numbering longest-first puts the longest
tiles early and lets the short ones fill the tail. And every tile of a (head, batch) pair reads
the same K/V: if the ~132 CTAs running at once belong to 132 different pairs (one query block of
each), every CTA streams its K/V from HBM, which at 192/128 heads needs more bandwidth than HBM
has (measured: DeepSeek-V3 MLA prefill at 59% of the matmul rate, the d128 GQA case at 82%).

So pairs go in sections whose K/V fits in L2 (`L2_KV_BYTES`), and within a section the tiles run
longest-first, the section's pairs side by side: tile r of a section of w pairs from pair `first`
is query block `m_blocks - 1 - r // w` of pair `first + r % w`. When the pairs do not divide into
whole sections, the narrower one (pairs % width of them) runs first: run last, its few longest
tiles came at the very end and the other CTAs idled behind them (DeepSeek-V3 MLA, 128 pairs in
sections of 9: a makespan of 581.5 blocks per SM against 560.5 with it first, 512 of work, in a
greedy-dispatch simulation with 1.5 blocks of fixed cost per tile). Pairs are numbered
head-fastest, so the query heads sharing a KV head are neighbours; a section holds whole KV heads
where it can.
"""

import cutlass

# K/V bytes a section keeps in L2: the H200 has 50 MB in two halves, and the CTAs of a section
# spread over several waves, so its K/V must outlive them with room for Q and O traffic
L2_KV_BYTES = 24 << 20


def section_width(seq_len, bytes_per_key: int, q_per_kv):
    """Query-head pairs per section: as many KV heads of `seq_len` keys (`bytes_per_key` of K and V
    each, a Python int) as fit L2_KV_BYTES, at least one, times the query heads that share each."""
    kv_heads = cutlass.max(1, (L2_KV_BYTES // bytes_per_key) // cutlass.max(1, seq_len))
    return kv_heads * q_per_kv


class LongestFirst:
    def __init__(self, m_blocks, heads, batch, width=None):
        """`width`: pairs per section (None: one section of every pair, plain longest-first)."""
        self.m_blocks, self.heads, self.batch = m_blocks, heads, batch
        self.pairs = heads * batch
        self.width = self.pairs if width is None else cutlass.min(width, self.pairs)

    def count(self):
        """Tiles in all: the 1-D grid's size."""
        return self.m_blocks * self.pairs

    def coord(self, t):
        """(query block, head, batch) of tile t."""
        narrow = self.pairs % self.width  # pairs of the narrower first section; 0: none
        narrow_tiles = narrow * self.m_blocks
        section_tiles = self.width * self.m_blocks
        full = cutlass.min(cutlass.max(t - narrow_tiles + 1, 0), 1)  # 1: t lies in the whole sections
        section = cutlass.max(t - narrow_tiles, 0) // section_tiles
        first = full * (narrow + section * self.width)
        w = narrow + full * (self.width - narrow)
        r = t - full * (narrow_tiles + section * section_tiles)
        m_block = self.m_blocks - 1 - r // w
        pair = first + r % w
        return m_block, pair % self.heads, pair // self.heads
