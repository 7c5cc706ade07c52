"""The order in which an attention forward kernel's CTAs take their (query block, head, batch)
tiles (plain Python: works on ints and on DSL integers).

A causal (or any lower-triangular) mask gives late query blocks the most KV blocks. CTAs start
roughly in launch order, so a 1-D grid numbered longest-first puts the longest tiles in the first
wave and lets the short ones fill the tail: tile t is query block `m_blocks - 1 - t // (H * B)`
of head-batch pair `t % (H * B)`. Without a mask every tile is as long as any other and the order
only decides which tiles share K/V in L2 (the heads of one query block run together).
"""


class LongestFirst:
    def __init__(self, m_blocks, heads, batch):
        self.m_blocks, self.heads, self.batch = m_blocks, heads, batch

    def count(self):
        """Tiles in all: the 1-D grid's size."""
        return self.m_blocks * self.heads * self.batch

    def coord(self, t):
        """(query block, head, batch) of tile t."""
        pairs = self.heads * self.batch
        m_block = self.m_blocks - 1 - t // pairs
        pair = t % pairs
        return m_block, pair % self.heads, pair // self.heads
