"""Eager flex attention prefill (forward) with score/mask programs and block masks.

Not yet re-exported by `ops`; compiled graphs call it through inductor/flex/runtime.py's
FlexPrefillLauncher once enable(flex_prefill=True) offers it (opt-in until its speed is measured).
"""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..kernels.common.units import LOG2E
from ..runtime import get_kernel
from .common import ALIGN_BYTES, DTYPE_NAMES, attention_shapes, block_lists, check_cuda, sm_count, stream_scratch
from .flex import _score_mod_operands

NAME = "flex_prefill"
MAX_TILES = 2**31 - 1  # the kernel's 1-D grid


@functools.lru_cache(maxsize=256)
def _flex_prefill_kernel(head_dim_qk: int, head_dim_v: int, dtype_name: str, score_program: str,
                         score_dtypes: tuple[str, ...], mask_program: str, mask_dtypes: tuple[str, ...],
                         sparse_block: int, sparse_q_block: int, positive_scale: bool = True, config=None,
                         kv_batch_broadcast: bool = False):
    from ..kernels.attention.flex_prefill_config import FlexPrefillProblem, spec

    return get_kernel(spec(FlexPrefillProblem(head_dim_qk, head_dim_v, dtype_name, score_program, score_dtypes,
                                              mask_program, mask_dtypes, sparse_block, sparse_q_block,
                                              positive_scale, kv_batch_broadcast), config))


@functools.lru_cache(maxsize=64)
def _device_default_config(head_dim_qk: int, head_dim_v: int, dtype_name: str, device_index: int):
    from ..kernels.attention.flex_prefill_config import FlexPrefillProblem, default_config

    return default_config(FlexPrefillProblem(head_dim_qk, head_dim_v, dtype_name), sm_count(device_index))


# the decode entry's program checks, its errors naming this entry
_program_operands = functools.partial(_score_mod_operands, name=NAME)


def _block_mask_operands(block_mask: tuple, batch: int, heads: int, q_len: int, kv_block_size: int,
                         q_block_size: int, kv_block: int, device) -> list:
    """The kernel's four block-mask arguments (int32, contiguous) from the BlockMask's lists."""
    from ..kernels.attention.flex_prefill_config import sparse_block_reason

    lists = block_lists(NAME, block_mask, device, cover=(batch, heads, q_len, q_block_size))
    problem = sparse_block_reason(kv_block_size, q_block_size, kv_block)
    if problem:
        raise UnsupportedError(f"{NAME}: {problem}")
    return [t.to(torch.int32).contiguous() for t in lists]


def _walked_block_mask(block_mask: tuple, mask_mod, mask_tensors, kv_block_size: int, q_block_size: int,
                       kv_block: int, shape: tuple, device) -> tuple:
    """(block mask, mask_mod, mask_tensors, KV and query block sizes) as the kernel walks them: as
    given, or coarsened to the kernel's blocks with the fine blocks' states as one more mask tensor
    (kernels/attention/block_states.py) where the mask's blocks divide the kernel's. `shape`:
    (batch, query heads, q_len, kv_len)."""
    from ..kernels.attention.flex_prefill_config import block_mask_reason, block_walk
    from .flex_blocks import as_lists, walked_mask

    walk = block_walk(kv_block_size, q_block_size, kv_block)
    if walk is None or walk == (kv_block_size, q_block_size):
        return block_mask, mask_mod, mask_tensors, kv_block_size, q_block_size  # checked as they are
    batch, heads, q_len, kv_len = shape
    fine = block_lists(NAME, block_mask, device, cover=(batch, heads, q_len, q_block_size))
    problem = block_mask_reason(kv_block_size, q_block_size, kv_block, len(mask_tensors))
    if problem:
        raise UnsupportedError(f"{NAME}: block mask: {problem}")
    mask_mod, _, _ = _program_operands(mask_mod, mask_tensors, device, "mask")  # checked before it grows
    partial, full, mask_mod, mask_tensors = walked_mask(NAME, fine, kv_len, (kv_block_size, q_block_size), walk,
                                                        mask_mod, mask_tensors)
    return as_lists(partial, full), mask_mod, mask_tensors, *walk


def _operand(t: torch.Tensor) -> torch.Tensor:
    """`t` (4-D) as TMA needs it: unit last stride, other strides multiples of 8 elements, a
    16-byte aligned start (modes of extent 1 get a packed stride); else a contiguous copy."""
    sizes, strides = list(t.shape), list(t.stride())
    if strides[3] == 1:
        packed = -(-max(sz * st for sz, st in zip(sizes, strides)) // 8) * 8
        strides[:3] = [packed if sz == 1 else st for sz, st in zip(sizes[:3], strides[:3])]
        if t.data_ptr() % ALIGN_BYTES == 0 and all(st % 8 == 0 and st > 0 for st in strides[:3]):
            return t.as_strided(sizes, strides)
    return t.clone(memory_format=torch.contiguous_format)


def flex_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                 score_mod: str | None = None, score_tensors=(), mask_mod: str | None = None, mask_tensors=(),
                 kv_num_blocks: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
                 full_kv_num_blocks: torch.Tensor | None = None, full_kv_indices: torch.Tensor | None = None,
                 kv_block_size: int = 128, q_block_size: int = 128, return_lse: bool = False, config=None):
    """Attention forward for prefill: softmax(scale * q k^T) v per query head.

    q (B, Hq, Lq, Dqk), k (B, Hkv, Lkv, Dqk), v (B, Hkv, Lkv, Dv) (or k and v of batch 1, shared by
    every query batch), bf16 or fp16, Hq a multiple of Hkv (query head h reads KV head
    h // (Hq // Hkv)); head dims (qk/v) 64/64, 128/128, 192/128 or
    256/256. `scale`
    defaults to 1/sqrt(Dqk). With `return_lse`, also returns the fp32 logsumexp (B, Hq, Lq) of the
    scaled scores in natural-log units, as torch's flex_attention returns it; a row with nothing
    to attend gets out 0 and lse -inf.
    `score_mod` / `mask_mod` are score and mask programs' texts (kernels.score_program) reading
    `score_tensors` / `mask_tensors` (1-D, on q's device) as t0, t1, ...
    A BlockMask's tensors (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices; (Z, H,
    Qb[, C]) as torch builds them, Z in (1, B), H in (1, Hq)) restrict each query block's keys to
    its blocks; the mask program runs on the partial blocks only (on all keys without block
    tensors). kv_block_size and q_block_size: multiples of 128, or divisors of 128 (such a mask is
    walked in 128 x 128 blocks, exactly: host/flex_blocks.py). Causal attention is
    a block mask with a causal mask program. `config`: a FlexPrefillConfig instead of the
    default one (benchmarks and tests; a config that cannot run the problem is refused).
    """
    from ..kernels.attention import flex_prefill_config as fpc

    check_cuda(NAME, q, k, v)
    batch, heads, q_len, dqk, kv_heads, seq, dv, shared_kv = attention_shapes(NAME, q, k, v, shared_kv_ok=True)
    problem = fpc.unsupported_reason(dqk, dv, DTYPE_NAMES[q.dtype])
    if problem:
        raise UnsupportedError(f"{NAME}: {problem}")
    if fpc.m_blocks(q_len) * heads * batch > MAX_TILES:
        raise UnsupportedError(f"{NAME}: {fpc.m_blocks(q_len) * heads * batch} tiles exceed the grid limit")
    if config is None:  # the default of persistent CTAs (64/64, 128/128) needs this device's SM count
        config = _device_default_config(dqk, dv, DTYPE_NAMES[q.dtype], q.device.index)
    kv_block = config.kv_block
    block_mask = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    sparse_block, sparse_q_block, block_slots = 0, fpc.M_BLOCK, [None] * 4
    if any(t is not None for t in block_mask):
        block_mask, mask_mod, mask_tensors, kv_block_size, q_block_size = _walked_block_mask(
            block_mask, mask_mod, mask_tensors, kv_block_size, q_block_size, kv_block, (batch, heads, q_len, seq),
            q.device)
        block_slots = _block_mask_operands(block_mask, batch, heads, q_len, kv_block_size, q_block_size, kv_block,
                                           q.device)
        sparse_block, sparse_q_block = kv_block_size, q_block_size
    program, score_dtypes, score_slots = _program_operands(score_mod, score_tensors, q.device, "score")
    mask_program, mask_dtypes, mask_slots = _program_operands(mask_mod, mask_tensors, q.device, "mask")

    out = torch.empty(batch, heads, q_len, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)
    if out.numel() == 0 or seq == 0:  # nothing to attend to: flex_attention's empty rows
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    scale = 1.0 / dqk ** 0.5 if scale is None else float(scale)
    # a score program scales the scores itself: one kernel whatever the scale's sign. The kernel's
    # scale_log2 is fp32: one below its smallest normal is zero there (and -inf * 0 a NaN)
    positive_scale = scale * LOG2E >= torch.finfo(torch.float32).tiny or bool(program)
    try:
        kernel = _flex_prefill_kernel(dqk, dv, DTYPE_NAMES[q.dtype], program, score_dtypes, mask_program,
                                      mask_dtypes, sparse_block, sparse_q_block, positive_scale, config, shared_kv)
    except ValueError as e:  # spec's refusal of the config
        raise UnsupportedError(f"{NAME}: {e}") from None
    counter = None
    if config.dynamic_tiles:
        # zeroed once, left zero by every launch (kernels/attention/tile_claims.py)
        (counter,) = stream_scratch(q.device, (((2,), torch.int32, True),))
    kernel(_operand(q), _operand(k), _operand(v), out, lse, scale * LOG2E, scale, *score_slots, *block_slots,
           *mask_slots, counter)
    return (out, lse) if return_lse else out
