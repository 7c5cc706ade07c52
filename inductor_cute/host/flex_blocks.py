"""A BlockMask's lists coarsened to the blocks a kernel walks, and the fine blocks' states tensor
(kernels/attention/block_states.py says how the two keep the mask exact). Torch ops on the mask's
device: a few small kernels per call."""

from __future__ import annotations

import torch

from ..kernels.attention.block_states import FULL, PARTIAL, SKIPPED

_ABSENT = 3  # a fine block past the mask's end, inside the last coarse block: it decides nothing


def fine_states(num, idx, full_num, full_idx) -> torch.Tensor:
    """(Z, H, query blocks, KV blocks) int32: each block's state, SKIPPED, PARTIAL or FULL, from
    the lists (kv_num_blocks, kv_indices[, full_kv_num_blocks, full_kv_indices])."""
    kv_blocks = idx.shape[-1]
    states = torch.full((*num.shape, kv_blocks + 1), SKIPPED, dtype=torch.int32, device=num.device)
    for count, blocks, state in ((num, idx, PARTIAL), (full_num, full_idx, FULL)):
        if count is None:
            continue
        listed = torch.arange(blocks.shape[-1], device=blocks.device) < count.unsqueeze(-1)
        # an entry past the count lands in the spare last column
        states.scatter_(-1, torch.where(listed, blocks.long(), kv_blocks), state)
    return states[..., :kv_blocks]


def coarsened(block_mask: tuple, q_factor: int, kv_factor: int) -> tuple[tuple, torch.Tensor]:
    """(the lists at blocks of q_factor x kv_factor fine blocks, the states tensor with its header).
    A coarse block is FULL where every fine block in it is, skipped where none is kept, partial
    otherwise; full lists come back None where the mask had none."""
    num, idx, full_num, full_idx = block_mask
    states = fine_states(num, idx, full_num, full_idx)
    z, h, q_blocks, kv_blocks = states.shape
    coarse_q, coarse_kv = -(-q_blocks // q_factor), -(-kv_blocks // kv_factor)
    padded = torch.full((z, h, coarse_q * q_factor, coarse_kv * kv_factor), _ABSENT, dtype=torch.int32,
                        device=states.device)
    padded[:, :, :q_blocks, :kv_blocks] = states
    blocks = padded.view(z, h, coarse_q, q_factor, coarse_kv, kv_factor)
    full = ((blocks == FULL) | (blocks == _ABSENT)).all(5).all(3)
    kept = ((blocks == FULL) | (blocks == PARTIAL)).any(5).any(3)
    partial = kept & ~full
    lists = (*_as_lists(partial), *(_as_lists(full) if full_num is not None else (None, None)))
    header = torch.tensor([kv_blocks, h * q_blocks * kv_blocks if z > 1 else 0, q_blocks * kv_blocks if h > 1 else 0],
                          dtype=torch.int32, device=states.device)
    return lists, torch.cat([header, states.flatten()])


def _as_lists(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts, indices) of a (Z, H, Qb, KVb) bool block map, as a BlockMask keeps them: each row's
    kept blocks first, in increasing order."""
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)
