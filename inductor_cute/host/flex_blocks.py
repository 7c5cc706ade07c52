"""A BlockMask's lists coarsened to the blocks a kernel walks, and the fine blocks' states tensor
(kernels/attention/block_states.py says how the two keep the mask exact). Torch ops on the mask's
device, no copy from the host (a CUDA graph may capture them): ~30 small kernels per call."""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..kernels.attention.block_states import FULL, HEADER, PARTIAL, SKIPPED, with_block_states

_ABSENT = 3  # a fine block past the keys' or queries' end, inside the last coarse block: it decides nothing
_INT32_MAX = 2**31 - 1


def states_fit(mask_dims: tuple, kv_blocks: int) -> bool:
    """Whether the states of a mask of (Z, H, query blocks) x `kv_blocks` fine blocks, header and
    tail (`_tail`, at most 128 rows' worth) included, stay within the int32 index the mask program
    computes."""
    z, h, q_blocks = mask_dims
    return z * h * q_blocks * kv_blocks + HEADER + 128 * (kv_blocks + 1) <= _INT32_MAX


def _tail(kv_blocks: int, q_factor: int, kv_factor: int) -> int:
    """States past the last fine block that the mask program may read: kernels evaluate it on the
    rows and keys of their last blocks past the lengths (then drop them), up to q_factor - 1 fine
    query blocks and kv_factor - 1 fine KV blocks past the last ones; they read SKIPPED there."""
    return (q_factor - 1) * kv_blocks + kv_factor


def fine_states(num, idx, full_num, full_idx, kv_blocks: int) -> torch.Tensor:
    """(Z, H, query blocks, kv_blocks) int32: each block's state, SKIPPED, PARTIAL or FULL, from
    the lists (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices). The lists may be
    narrower or wider than kv_blocks (torch only requires them to name blocks); an entry past a
    row's count or naming no block before the keys' end counts for nothing."""
    states = torch.full((*num.shape, kv_blocks + 1), SKIPPED, dtype=torch.int32, device=num.device)
    for count, blocks, state in ((num, idx, PARTIAL), (full_num, full_idx, FULL)):
        listed = torch.arange(blocks.shape[-1], device=blocks.device) < count.unsqueeze(-1)
        listed &= (blocks >= 0) & (blocks < kv_blocks)
        states.scatter_(-1, torch.where(listed, blocks.long(), kv_blocks), state)  # the rest: the spare column
    return states[..., :kv_blocks]


def walked_mask(entry: str, fine: tuple, kv_len: int, sizes: tuple, walk: tuple, mask_text: str,
                mask_tensors: tuple) -> tuple:
    """What a kernel walking (KV, query) blocks of `walk` takes in place of a mask of finer `sizes`
    (KV, query) blocks whose forward lists `fine` were checked: the coarse (partial, full) block
    maps (`as_lists` makes lists of them, transposed for a backward's), the mask program
    `mask_text` (canonical, checked) with the states term, and `mask_tensors` with the states
    tensor after them. States past the int32 index are refused, naming `entry`."""
    kv_block_size, q_block_size = sizes
    kv_blocks = -(-kv_len // kv_block_size)
    if not states_fit(fine[0].shape, kv_blocks):
        raise UnsupportedError(f"{entry}: block mask: {fine[0].shape} x {kv_blocks} blocks of {q_block_size} x "
                               f"{kv_block_size} exceed the int32 index of their states")
    partial, full, states = coarse_maps(fine, kv_blocks, walk[1] // q_block_size, walk[0] // kv_block_size)
    z, h = fine[0].shape[:2]
    program = with_block_states(mask_text, len(mask_tensors), q_block_size, kv_block_size, z > 1, h > 1)
    return partial, full, program, (*mask_tensors, states)


def as_lists(partial: torch.Tensor, full: torch.Tensor) -> tuple:
    """(counts, indices, full counts, full indices) of (Z, H, rows, columns) partial and full block maps."""
    return (*_as_lists(partial), *_as_lists(full))


def coarse_maps(block_mask: tuple, kv_blocks: int, q_factor: int, kv_factor: int) -> tuple:
    """(partial, full) bool maps (Z, H, coarse query blocks, coarse KV blocks) of a mask whose keys
    span `kv_blocks` fine blocks, at blocks of q_factor x kv_factor fine blocks, and the states
    tensor (header first). A coarse block is full where every fine block in it is, skipped where
    none is kept, partial otherwise."""
    states = fine_states(*block_mask, kv_blocks)
    z, h, q_blocks, _ = states.shape
    coarse_q, coarse_kv = -(-q_blocks // q_factor), -(-kv_blocks // kv_factor)
    padded = torch.full((z, h, coarse_q * q_factor, coarse_kv * kv_factor), _ABSENT, dtype=torch.int32,
                        device=states.device)
    padded[:, :, :q_blocks, :kv_blocks] = states
    blocks = padded.view(z, h, coarse_q, q_factor, coarse_kv, kv_factor)
    full = ((blocks == FULL) | (blocks == _ABSENT)).all(5).all(3)
    kept = ((blocks == FULL) | (blocks == PARTIAL)).any(5).any(3)
    header = [kv_blocks, h * q_blocks * kv_blocks if z > 1 else 0, q_blocks * kv_blocks if h > 1 else 0]
    pieces = [states.new_full((1,), value) for value in header]  # filled on the device
    tail = states.new_full((_tail(kv_blocks, q_factor, kv_factor),), SKIPPED)
    return kept & ~full, full, torch.cat([*pieces, states.flatten(), tail])


def _as_lists(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, indices) of a (Z, H, Qb, KVb) bool block map, as a BlockMask keeps them: each row's
    kept blocks first, in increasing order."""
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)
