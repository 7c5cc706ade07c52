"""Eager flex attention backward: dq, dk, dv of a forward with a mask program and a block mask.

Under torch.compile with enable(flex_backward=True) (opt-in until its first GPU run) training graphs
reach it through inductor/flex/backward.py.
Three kernels (kernels/attention/flex_backward_config.py): the preprocess (delta and lse in log2
units per query row), dK/dV and dQ.
"""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..kernels.common.programs import score_grad
from ..kernels.common.units import LOG2E
from ..runtime import get_kernel
from .common import DTYPE_NAMES, attention_shapes, block_lists, check_cuda
from .flex import _score_mod_operands
from .flex_prefill import _operand

NAME = "flex_backward"
MAX_GRID_YZ = 65535  # heads and batch are the grids' y and z


@functools.lru_cache(maxsize=256)
def _flex_backward_kernels(head_dim_qk: int, head_dim_v: int, dtype_name: str, mask_program: str,
                           mask_dtypes: tuple[str, ...], sparse_block: int, sparse_q_block: int, config=None,
                           score_program: str = "", score_dtypes: tuple[str, ...] = ()) -> dict:
    from ..kernels.attention.flex_backward_config import FlexBackwardProblem, specs

    problem = FlexBackwardProblem(head_dim_qk, head_dim_v, dtype_name, mask_program, mask_dtypes, sparse_block,
                                  sparse_q_block, score_program, score_dtypes)
    return {name: get_kernel(s) for name, s in specs(problem, config).items()}


# per call otherwise: a training step with a score_mod would differentiate its program every time
_derivative_error = functools.lru_cache(maxsize=256)(score_grad.derivative_error)


def _block_lists(names: tuple[str, ...], lists: tuple, batch: int, heads: int, rows: int, row_block: int,
                 device) -> list:
    """One of a BlockMask's two list sets (num, indices, full_num, full_indices), named `names`,
    whose row blocks of `row_block` must cover `rows`: int32 and contiguous, zero full counts over
    the indices when the full lists are absent."""
    num, idx, full_num, full_idx = block_lists(NAME, lists, device, names, (batch, heads, rows, row_block))
    return [t.to(torch.int32).contiguous() for t in (num, idx, full_num, full_idx)]


def walked_block_masks(forward_lists: tuple, backward_lists: tuple, mask_mod, mask_tensors, kv_block_size: int,
                       q_block_size: int, shape: tuple, device) -> tuple:
    """(forward lists, backward lists, mask_mod, mask_tensors, KV and query block sizes) as the
    kernels walk a BlockMask: as given, or, where its blocks divide the kernels' (128 x 128), both
    list sets coarsened from the forward lists, with the fine blocks' states as one more mask
    tensor (host/flex_blocks.py; the prefill walks the forward the same way, so the two agree on
    every element). `shape`: (batch, query heads, q_len, kv_len)."""
    from ..kernels.attention import flex_backward_config as fbc
    from .flex_blocks import as_lists, walked_mask

    walk = fbc.block_walk(kv_block_size, q_block_size)
    if walk is None or walk == (kv_block_size, q_block_size):
        return forward_lists, backward_lists, mask_mod, mask_tensors, kv_block_size, q_block_size  # checked later
    problem = fbc.block_mask_reason(kv_block_size, q_block_size, len(mask_tensors))
    if problem:
        raise UnsupportedError(f"{NAME}: block mask: {problem}")
    batch, heads, q_len, kv_len = shape
    fine = block_lists(NAME, forward_lists, device, cover=(batch, heads, q_len, q_block_size))
    mask_mod, _, _ = _score_mod_operands(mask_mod, mask_tensors, device, "mask", name=NAME)  # checked before it grows
    partial, full, mask_mod, mask_tensors = walked_mask(NAME, fine, kv_len, (kv_block_size, q_block_size), walk,
                                                        mask_mod, mask_tensors)
    # the dK/dV kernel's lists: per coarse KV block the same coarse blocks, transposed
    backward = as_lists(partial.transpose(-1, -2), full.transpose(-1, -2))
    return as_lists(partial, full), backward, mask_mod, mask_tensors, *walk


def flex_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor, grad_out: torch.Tensor, *, scale: float | None = None,
                            score_mod: str | None = None, score_tensors=(), mask_mod: str | None = None,
                            mask_tensors=(), kv_num_blocks: torch.Tensor | None = None,
                            kv_indices: torch.Tensor | None = None, full_kv_num_blocks: torch.Tensor | None = None,
                            full_kv_indices: torch.Tensor | None = None, q_num_blocks: torch.Tensor | None = None,
                            q_indices: torch.Tensor | None = None, full_q_num_blocks: torch.Tensor | None = None,
                            full_q_indices: torch.Tensor | None = None, kv_block_size: int = 128,
                            q_block_size: int = 128, config=None):
    """(dq, dk, dv) of out = softmax(scale q k^T) v per query head, given the forward's out and
    lse (fp32 (B, Hq, Lq), natural-log units as flex_attention and flex_prefill return it) and
    grad_out = dL/dout.

    Shapes and dtypes as flex_prefill: q (B, Hq, Lq, Dqk), k (B, Hkv, Lkv, Dqk), v (B, Hkv, Lkv, Dv),
    out and grad_out (B, Hq, Lq, Dv), bf16 or fp16, Hq a multiple of Hkv (dk and dv sum over the
    query heads of a KV head); head dims 64/64, 128/128 and 192/128. k and v may have batch 1,
    shared by every query batch: dk and dv (batch 1) then also sum over the query batches (the
    kernels run on a copy of k and v per query batch, and the sum is taken in fp32). `scale` defaults to 1/sqrt(Dqk).
    `mask_mod` is a mask program's text reading `mask_tensors`; `score_mod` a score program's
    reading `score_tensors`, recomputed and differentiated with respect to the score (its captured
    tensors get no gradient: a learnable bias is the caller's to refuse). A BlockMask comes as both
    its list sets: the forward's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices:
    per query block its KV blocks, walked for dq) and the backward's (q_num_blocks, q_indices,
    full_q_num_blocks, full_q_indices: per KV block its query blocks, walked for dk and dv);
    kv_block_size and q_block_size multiples of 128, or divisors of 128 (walked coarsened:
    `walked_block_masks`, the backward lists then made from the forward's).
    Rows with nothing to attend (lse -inf) get zero gradients. `config`: a FlexBackwardConfig in
    place of the default one (stages, overlapped schedules, dq_reduce: dq from the dK/dV kernel).
    """
    from ..kernels.attention import flex_backward_config as fbc

    check_cuda(NAME, q, k, v, out, lse, grad_out)
    batch, heads, q_len, dqk, kv_heads, kv_len, dv, shared_kv = attention_shapes(NAME, q, k, v, shared_kv_ok=True)
    problem = fbc.unsupported_reason(dqk, dv, DTYPE_NAMES[q.dtype])
    if problem:
        raise UnsupportedError(f"{NAME}: {problem}")
    for name, t in (("out", out), ("grad_out", grad_out)):
        if t.shape != (batch, heads, q_len, dv) or t.dtype != q.dtype:
            raise UnsupportedError(f"{NAME}: {name} must be {tuple((batch, heads, q_len, dv))} in {q.dtype}, got "
                                   f"{tuple(t.shape)} in {t.dtype}")
    if lse.shape != (batch, heads, q_len) or lse.dtype != torch.float32:
        raise UnsupportedError(f"{NAME}: lse must be {(batch, heads, q_len)} in torch.float32, got {tuple(lse.shape)} "
                               f"in {lse.dtype}")
    if heads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise UnsupportedError(f"{NAME}: {heads} heads or batch {batch} exceed the grid's {MAX_GRID_YZ}")
    forward_lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    backward_lists = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    if any(t is not None for t in forward_lists + backward_lists):
        forward_lists, backward_lists, mask_mod, mask_tensors, kv_block_size, q_block_size = walked_block_masks(
            forward_lists, backward_lists, mask_mod, mask_tensors, kv_block_size, q_block_size,
            (batch, heads, q_len, kv_len), q.device)
    mask_program, mask_dtypes, mask_slots = _score_mod_operands(mask_mod, mask_tensors, q.device, "mask", name=NAME)
    score_program, score_dtypes, score_slots = _score_mod_operands(score_mod, score_tensors, q.device, "score",
                                                                   name=NAME)
    problem = _derivative_error(score_program, score_dtypes) if score_program else None
    if problem:
        raise UnsupportedError(f"{NAME}: score_mod: {problem}")

    sparse_block, sparse_q_block = 0, 128
    fwd_slots, bwd_slots = [None] * 4, [None] * 4
    padded = fbc.padded_rows(q_len)
    if any(t is not None for t in forward_lists + backward_lists):
        problem = fbc.sparse_block_reason(kv_block_size, q_block_size)
        if problem:
            raise UnsupportedError(f"{NAME}: {problem}")
        fwd_slots = _block_lists(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"),
                                 forward_lists, batch, heads, q_len, q_block_size, q.device)
        bwd_slots = _block_lists(("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"),
                                 backward_lists, batch, heads, kv_len, kv_block_size, q.device)
        sparse_block, sparse_q_block = kv_block_size, q_block_size
        # the dK/dV kernel may walk every query block the mask has: lse2 and delta cover them
        padded = max(padded, fwd_slots[0].shape[2] * q_block_size)

    if config is not None:
        error = fbc.config_error(config, fbc.FlexBackwardProblem(dqk, dv, DTYPE_NAMES[q.dtype], mask_program,
                                                                 mask_dtypes, sparse_block, sparse_q_block,
                                                                 score_program, score_dtypes))
        if error:
            raise UnsupportedError(f"{NAME}: {config}: {error}")

    if q_len == 0 or kv_len == 0 or batch == 0 or heads == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.empty(batch, heads, q_len, dqk, device=q.device, dtype=q.dtype)
    dk = torch.empty(batch, kv_heads, kv_len, dqk, device=q.device, dtype=q.dtype)
    dv_ = torch.empty(batch, kv_heads, kv_len, dv, device=q.device, dtype=q.dtype)
    if shared_kv:  # per query batch (_operand copies the expanded views), summed below
        k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
    kernels = _flex_backward_kernels(dqk, dv, DTYPE_NAMES[q.dtype], mask_program, mask_dtypes, sparse_block,
                                     sparse_q_block, config, score_program, score_dtypes)
    scale = 1.0 / dqk ** 0.5 if scale is None else float(scale)
    delta = torch.empty(batch, heads, padded, device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    q_, k_, v_, do_ = _operand(q), _operand(k), _operand(v), _operand(grad_out)
    kernels["preprocess"](_operand(out), do_, lse.contiguous(), delta, lse2)
    if "dq" not in kernels:  # dq_reduce: the dK/dV kernel adds scale * dS K into an fp32 workspace
        dq_acc = torch.zeros(batch, heads, padded, dqk, device=q.device, dtype=torch.float32)
        kernels["dkdv"](q_, k_, v_, do_, lse2, delta, dk, dv_, scale * LOG2E, scale, *bwd_slots, *mask_slots,
                        *score_slots, dq_acc)
        dq.copy_(dq_acc[:, :, :q_len])
    else:
        kernels["dkdv"](q_, k_, v_, do_, lse2, delta, dk, dv_, scale * LOG2E, scale, *bwd_slots, *mask_slots,
                        *score_slots, None)
        kernels["dq"](q_, k_, v_, do_, lse2, delta, dq, scale * LOG2E, scale, *fwd_slots, *mask_slots, *score_slots)
    if shared_kv:
        dk, dv_ = (t.sum(0, keepdim=True, dtype=torch.float32).to(q.dtype) for t in (dk, dv_))
    return dq, dk, dv_
