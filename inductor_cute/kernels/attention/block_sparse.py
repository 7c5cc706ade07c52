"""Walking a BlockMask's block lists, in kernel blocks, dealt over splits.

flex_attention's BlockMask keeps, per (batch z, head h, row block r), the partial blocks
indices[z, h, r, :num[z, h, r]] (some entries masked: mask_mod runs on them) and the full blocks
full_indices[z, h, r, :full_num[z, h, r]] (none masked). A mask block of sparse_block keys is
sparse_block / kv_block kernel blocks. Forward kernels walk (kv_num_blocks, kv_indices,
full_kv_num_blocks, full_kv_indices) with r the query block (0 for decoding); a backward walks
(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) with r the KV block. As torch
indexes a broadcast mask, batch b reads row b % Z and head h row h % H.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def deal_over_splits(n_blocks, splits, split):
    """(first entry, entry count) of split `split` when n_blocks list entries are dealt evenly,
    in contiguous runs, over `splits` splits (later splits may get fewer, or none)."""
    per_split = cute.ceil_div(n_blocks, splits)
    first_block = split * per_split
    my_blocks = cutlass.max(cutlass.min(n_blocks - first_block, per_split), 0)
    return first_block, my_blocks


class BlockSparse:
    """A BlockMask's lists seen in blocks of kv_block keys (sparse_block 0: no block mask, every
    block is partial and entry j of the list is block j)."""

    def __init__(self, sparse_block: int, kv_block: int):
        self.enabled = sparse_block > 0
        self.sub_blocks = sparse_block // kv_block  # kernel blocks per mask block

    def mask_row(self, num: cute.Tensor, b, h):
        """(z, h) of the mask's lists that batch b and head h read (broadcast dims repeat)."""
        return b % num.shape[0], h % num.shape[1]

    def count(self, num: cute.Tensor, full_num: cute.Tensor, z, h, r):
        """(partial mask blocks, kernel blocks in all) of the lists of (z, h, row block r)."""
        n_partial = num[(z, h, r)]
        n_blocks = (n_partial + full_num[(z, h, r)]) * self.sub_blocks
        return n_partial, n_blocks

    @cute.jit
    def block_at(self, j: Int32, n_partial: Int32, z: Int32, h: Int32, r, indices, full_indices):
        """(kernel block index in kv_block units, whether it is a partial block) of entry j of the
        list of (z, h, row block r): j itself without a block mask (every block partial), else
        sub-block j % sub_blocks of the (j // sub_blocks)-th mask block, partial ones first."""
        blk, partial = j, True
        if const_expr(self.enabled):
            entry, sub = j // self.sub_blocks, j % self.sub_blocks
            partial = entry < n_partial
            idx = Int32(0)
            if partial:
                idx = indices[(z, h, r, entry)]
            else:
                idx = full_indices[(z, h, r, entry - n_partial)]
            blk = idx * self.sub_blocks + sub
        return blk, partial
