"""Grouped-query attention packed into tile rows (plain Python: works on ints and on DSL integers).

The `group` query heads that share one KV head are stacked into the rows of one tile, so K and V
are read once for all of them: packed row p is query head offset p % group within the group
(query head kv_head * group + p % group) at query position p // group. Decoding packs because a
single query position fills a few rows of a 64-row WGMMA; a prefill may pack short sequences.
"""


class PackGQA:
    def __init__(self, group: int):
        self.group = group  # query heads per KV head

    def rows(self, q_len):
        """Packed rows of q_len query positions."""
        return q_len * self.group

    def unpack(self, row, kv_head):
        """(query head, query position) of packed row `row` in KV head `kv_head`'s tile."""
        return kv_head * self.group + row % self.group, row // self.group

    def pack(self, head_offset, position):
        """The packed row of query head kv_head * group + head_offset at `position`."""
        return position * self.group + head_offset
