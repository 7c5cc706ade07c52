"""Eager flex attention decoding (split-KV) with score/mask programs and block masks, and the
remembered launch (FlexDecodeLaunch) that repeats a checked call for compiled graphs."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..kernels.common.units import LOG2E
from ..runtime import get_kernel
from .common import ALIGN_BYTES, DTYPE_NAMES, attention_shapes, block_lists, check_cuda, sm_count, stream_scratch
from .gemm import _alias, _in_place


@functools.lru_cache(maxsize=256)
def _flex_decode_kernel(head_dim_qk: int, head_dim_v: int, dtype_name: str, q_per_kv: int, has_kv_len: bool,
                        score_program: str = "", score_dtypes: tuple[str, ...] = (), mask_program: str = "",
                        mask_dtypes: tuple[str, ...] = (), sparse_block: int = 0, kv_batch_broadcast: bool = False,
                        gqa_unpacked: bool = False):
    from ..kernels.attention.flex_decode_config import FlexDecodeProblem, spec

    return get_kernel(spec(FlexDecodeProblem(head_dim_qk, head_dim_v, dtype_name, q_per_kv, has_kv_len, score_program,
                                             score_dtypes, mask_program, mask_dtypes, sparse_block,
                                             kv_batch_broadcast, gqa_unpacked)))


def _score_mod_operands(score_mod: str | None, score_tensors, device, kind: str = "score", name: str = "flex_decode"
                        ) -> tuple[str, tuple[str, ...], list]:
    """(canonical program text or "", captured tensors' dtype names, the kernel's captured-tensor
    slots: the tensors contiguous, then None). `kind` "mask": the mask_mod's mask program. `name`:
    the entry point errors name (the prefill entry checks its programs here too)."""
    from ..kernels.common.programs import score as sp

    if score_mod is None:
        if score_tensors:
            raise UnsupportedError(f"{name}: {kind}_tensors were given without a {kind}_mod")
        return "", (), [None] * sp.MAX_TENSORS
    if not isinstance(score_mod, str):
        raise UnsupportedError(f"{name}: {kind}_mod must be a {kind} program's text (kernels.score_program)")
    tensors = list(score_tensors)
    if len(tensors) > sp.MAX_TENSORS:
        raise UnsupportedError(f"{name}: at most {sp.MAX_TENSORS} {kind} tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.device != device:
            raise UnsupportedError(f"{name}: {kind} tensor t{i} must be a 1-D tensor on {device}")
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
    try:
        text = sp.canonical(score_mod, dtypes, mask=kind == "mask")
    except ValueError as e:
        raise UnsupportedError(f"{name}: {kind}_mod: {e}") from None
    return text, dtypes, [_unit_stride(t) for t in tensors] + [None] * (sp.MAX_TENSORS - len(tensors))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t contiguous with stride 1, as the kernel's compact 1-D tensors are declared: torch calls a
    one-element tensor contiguous whatever its stride (Inductor hands over a flattened 0-d buffer
    with stride 0)."""
    t = t.contiguous()
    return t if t.stride(0) == 1 else t.as_strided(t.shape, (1,))


def _block_mask_operands(block_mask: tuple, kv_block_size: int, q_block_size: int, heads: int, group: int,
                         q_len: int, kv_block: int, device) -> list:
    """The kernel's four block-mask arguments (int32, contiguous; without full blocks, zero counts
    over kv_indices) from (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)."""
    from ..kernels.attention.flex_decode_config import sparse_block_reason

    num, idx, full_num, full_idx = block_lists("flex_decode", block_mask, device)
    problem = sparse_block_reason(kv_block_size, kv_block, q_block_size, q_len)
    if problem:
        raise UnsupportedError(f"flex_decode: {problem}")
    if num.shape[1] not in (1, heads):
        raise UnsupportedError(f"flex_decode: the block mask has {num.shape[1]} heads; expected 1 or {heads}")
    return [t.to(torch.int32).contiguous() for t in (num, idx, full_num, full_idx)]


def _int32_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()  # t itself when it already is


def _zero_counts(num: torch.Tensor) -> torch.Tensor:
    """The full-block counts of a block mask without full blocks: none anywhere."""
    return torch.zeros(num.shape, device=num.device, dtype=torch.int32)


def _copied_q(t: torch.Tensor) -> torch.Tensor:
    return _decode_operand("q", t, copy_ok=True)


def _copied_kv(t: torch.Tensor) -> torch.Tensor:
    return _decode_operand("k/v", t, copy_ok=True)


def _block_origins(at: int, sparse_block: int, no_full: bool) -> tuple:
    """Where the kernel's four block-mask slots come from in the sources (num, idx, full_num,
    full_idx from `at` on): without full blocks, zero counts and kv_indices again."""
    if not sparse_block:
        return (None,) * 4
    return ((at, _int32_contiguous), (at + 1, _int32_contiguous),
            (at, _zero_counts) if no_full else (at + 2, _int32_contiguous),
            (at + 1, _int32_contiguous) if no_full else (at + 3, _int32_contiguous))


def _decode_operand(name: str, t: torch.Tensor, copy_ok: bool) -> torch.Tensor:
    """`t` (4-D) as TMA and 16-byte loads need it: unit last stride, other strides multiples of 8
    elements, 16-byte aligned base. Modes of extent 1 get a packed stride. A layout that does not
    fit is copied when `copy_ok` (q is small) and refused otherwise (k and v are the cache)."""
    sizes, strides = list(t.shape), list(t.stride())
    if strides[3] == 1:
        packed = -(-max(sz * st for sz, st in zip(sizes, strides)) // 8) * 8
        strides[:3] = [packed if sz == 1 else st for sz, st in zip(sizes[:3], strides[:3])]
        if t.data_ptr() % ALIGN_BYTES == 0 and all(st % 8 == 0 and st > 0 for st in strides[:3]):
            return t.as_strided(sizes, strides)
    if copy_ok:
        return t.clone(memory_format=torch.contiguous_format)
    raise UnsupportedError(f"flex_decode: {name} must have a contiguous last dim, other strides multiples of "
                           f"8 elements and a 16-byte aligned start; got strides {tuple(t.stride())}")


def _checked(q, k, v, scale, kv_len, num_splits, score_mod, score_tensors, mask_mod, mask_tensors, block_mask,
             kv_block_size, q_block_size, copy_kv: bool = False):
    """flex_decode's checks, planning and launch: (out, lse, launched), launched (kernel, kernel
    arguments, origins) or None when nothing was launched (an empty output). origins[j] is
    (index in `sources(...)`, the conversion applied to it) for the j-th tensor input argument of
    the kernel (q, k, v, kv_len, score slots, block slots, mask slots), None for an absent one.
    `copy_kv`: copy k or v whose layout the kernel cannot stream instead of refusing it."""
    from ..kernels.attention import flex_decode_config as fdc
    from ..kernels.common.programs import score as sp

    check_cuda("flex_decode", q, k, v, *(t for t in (kv_len,) if t is not None))
    batch, heads, q_len, dqk, kv_heads, seq, dv, kv_batch_broadcast = attention_shapes("flex_decode", q, k, v,
                                                                                      shared_kv_ok=True)
    group = heads // kv_heads
    problem = fdc.unsupported_reason(dqk, dv, DTYPE_NAMES[q.dtype], group, max(q_len, 1))
    if problem:
        raise UnsupportedError(f"flex_decode: {problem}")
    if kv_len is not None:
        if kv_len.shape != (batch,) or kv_len.dtype not in (torch.int32, torch.int64):
            raise UnsupportedError(f"flex_decode: kv_len must be an int32 or int64 tensor of shape ({batch},), got "
                                   f"{kv_len.dtype} of shape {tuple(kv_len.shape)}")
        kv_len = _int32_contiguous(kv_len)
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = block_mask
    has_block_mask = any(t is not None for t in block_mask)
    # a mask per query head under GQA: one CTA per query head (kv_num_blocks is checked below)
    unpacked = has_block_mask and kv_num_blocks is not None and kv_num_blocks.dim() == 3 and \
        fdc.unpacks_gqa(kv_num_blocks.shape[1], group)
    cta_heads = heads if unpacked else kv_heads
    if batch * cta_heads > 65535:
        raise UnsupportedError(f"flex_decode: batch * {'query' if unpacked else 'KV'} heads = {batch * cta_heads} "
                               "exceeds 65535 (grid limit)")
    if num_splits is not None and not 1 <= num_splits <= fdc.MAX_SPLITS:
        raise UnsupportedError(f"flex_decode: num_splits must be in 1..{fdc.MAX_SPLITS}, got {num_splits}")
    program, score_dtypes, score_slots = _score_mod_operands(score_mod, score_tensors, q.device)
    mask_program, mask_dtypes, mask_slots = _score_mod_operands(mask_mod, mask_tensors, q.device, "mask")
    kv_block = fdc.kv_block_for(dqk, dv, kv_block_size if has_block_mask else 0)
    sparse_block, block_slots, keys = 0, [None] * 4, seq
    if has_block_mask:
        block_slots = _block_mask_operands(block_mask, kv_block_size, q_block_size, heads, group, q_len, kv_block,
                                           q.device)
        sparse_block = kv_block_size
        # counted on the arguments: without full blocks, the kernel's full-index slot repeats kv_indices
        columns = kv_indices.shape[-1] + (full_kv_indices.shape[-1] if full_kv_indices is not None else 0)
        keys = min(seq, kv_block_size * columns)  # partial and full blocks bound the keys: no sync to count

    scale = 1.0 / dqk ** 0.5 if scale is None else float(scale)
    out = torch.empty(batch, heads, q_len, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)
    if out.numel() == 0 or seq == 0:  # nothing to attend to: flex_attention's empty rows
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse, None
    q4 = _decode_operand("q", q, copy_ok=True)
    k4, v4 = _decode_operand("k", k, copy_ok=copy_kv), _decode_operand("v", v, copy_ok=copy_kv)
    kernel = _flex_decode_kernel(dqk, dv, DTYPE_NAMES[q.dtype], group, kv_len is not None, program, score_dtypes,
                                 mask_program, mask_dtypes, sparse_block, kv_batch_broadcast, unpacked)
    if num_splits is None:
        num_splits = fdc.num_splits(batch, cta_heads, fdc.m_tiles(1 if unpacked else group, q_len), keys, kv_block,
                                    sm_count(q.device.index or 0))
    o_part = torch.empty(num_splits, batch, heads, q_len, dv, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(num_splits, batch, heads, q_len, device=q.device, dtype=torch.float32)
    args = (q4, k4, v4, kv_len, o_part, lse_part, out, lse, scale * LOG2E, scale, *score_slots, *block_slots,
            *mask_slots)
    kernel(*args)
    n_score, n_mask = len(score_dtypes), len(mask_dtypes)
    mask_at = 4 + n_score
    block_at = mask_at + n_mask
    kv_convert = _copied_kv if copy_kv else None
    origins = ((0, _copied_q), (1, kv_convert), (2, kv_convert), (3, _int32_contiguous) if kv_len is not None else None,
               *((4 + i, _unit_stride) if i < n_score else None for i in range(sp.MAX_TENSORS)),
               *_block_origins(block_at, sparse_block, full_kv_num_blocks is None),
               *((mask_at + i, _unit_stride) if i < n_mask else None for i in range(sp.MAX_TENSORS)))
    return out, lse, (kernel, args, origins)


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                kv_len: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
                score_mod: str | None = None, score_tensors=(), mask_mod: str | None = None, mask_tensors=(),
                kv_num_blocks: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
                full_kv_num_blocks: torch.Tensor | None = None, full_kv_indices: torch.Tensor | None = None,
                kv_block_size: int = 128, q_block_size: int = 128):
    """Attention for decoding, split over the KV length: softmax(scale * q k^T) v per query head.

    q (B, Hq, Lq, Dqk), k (B, Hkv, Lkv, Dqk), v (B, Hkv, Lkv, Dv) (or k and v of batch 1, one cache
    shared by every query batch, as paged attention holds it), bf16 or fp16, Hq a multiple of
    Hkv (GQA/MQA: query head h reads KV head h // (Hq // Hkv)), Lq at most 64. `kv_len` (B,)
    limits each batch's keys to its first kv_len[b]; a row with no key gets out 0 and lse -inf.
    `scale` defaults to 1/sqrt(Dqk). With `return_lse`, also returns the fp32 logsumexp (B, Hq,
    Lq) of the scaled scores in natural-log units, as torch's flex_attention returns it.
    `num_splits` overrides the number of KV splits chosen from the problem size.
    `score_mod` is a score program's text (kernels.score_program: flex_attention's score_mod as
    data) reading `score_tensors` (1-D, on q's device) as t0, t1, ...; it modifies the scaled
    scores before the softmax, exactly as flex_attention's score_mod does.

    A BlockMask's tensors (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices; (Z, H,
    Qb[, C]) as torch builds them) and block sizes restrict the keys to its blocks: `mask_mod`, a
    mask program's text reading `mask_tensors` as t0, t1, ..., masks keys of the partial blocks
    (of all keys without block tensors). As in torch, batch b reads mask row b % Z and query head
    h row h % H; H is 1 or Hq (with GQA, a mask per query head runs a CTA per query head, K/V
    read once per query head), kv_block_size a multiple of the kernel's KV block, and Lq at most
    q_block_size (every query in query block 0).
    """
    out, lse, _ = _checked(q, k, v, scale, kv_len, num_splits, score_mod, score_tensors, mask_mod, mask_tensors,
                           (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), kv_block_size,
                           q_block_size)
    return (out, lse) if return_lse else out


def sources(q, k, v, kv_len, score_tensors, mask_tensors, block_mask) -> tuple:
    """The caller's tensors in the order a FlexDecodeLaunch reads them (None where absent)."""
    return (q, k, v, kv_len, *score_tensors, *mask_tensors, *block_mask)


_INPUTS = 4  # q, k, v, kv_len; then o_part, lse_part, out, lse, two scalars, then the slots
_SLOTS_AT = _INPUTS + 6


class FlexDecodeLaunch:
    """A checked flex_decode call reduced to what repeating it needs; it holds no tensor.

    `template` is the kernel's argument list with the scalars in place and None elsewhere;
    `operands` fills its tensor inputs from the sources (see `sources`): (position, source index,
    None, None, None) for the source itself, (position, i, sizes, strides, None) for that view of
    it (from its own storage offset, taken without the dispatcher), (position, i, None, None,
    convert) for convert(source) (what the checked path copies or converts: done again each
    call). `buffers`: the partials o_part and lse_part as common.stream_scratch takes them
    (reused call after call), then the (shape, dtype) of out and lse, fresh from the caching
    allocator each call. Valid only for sources of the layouts it was made from (shapes,
    strides, dtypes, device, 16-byte alignment) and the same programs, scale and block sizes:
    callers key it on them."""

    __slots__ = ("kernel", "template", "operands", "buffers", "device", "num_splits")

    def __init__(self, kernel, template: tuple, operands: tuple, buffers: tuple, device, num_splits: int) -> None:
        self.kernel, self.template, self.operands = kernel, template, operands
        self.buffers, self.device, self.num_splits = buffers, device, num_splits

    def arguments(self, sources) -> list:
        """The kernel's arguments for these sources, fresh partials and outputs included."""
        args = list(self.template)
        for position, i, sizes, strides, convert in self.operands:
            if convert is not None:
                args[position] = convert(sources[i])
            elif sizes is None:
                args[position] = sources[i]
            else:
                args[position] = _alias(sources[i], sizes, strides, 0)
        partials, (s2, d2), (s3, d3) = self.buffers[:2], *self.buffers[2:]
        device = self.device
        args[4], args[5] = stream_scratch(device, partials)  # written before read in each launch
        args[6] = torch.empty(s2, device=device, dtype=d2)  # the outputs: the caller keeps them
        args[7] = torch.empty(s3, device=device, dtype=d3)
        return args

    def __call__(self, sources) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch on `sources`: (out, lse)."""
        args = self.arguments(sources)
        self.kernel(*args)
        return args[6], args[7]


def _launch_of(kernel, args: tuple, origins: tuple, sources: tuple) -> FlexDecodeLaunch | None:
    """The FlexDecodeLaunch repeating `kernel(*args)` on `sources` (origins as _checked returns
    them), or None where an argument is neither a source, a view of one, nor a conversion of one."""
    operands = []
    for j, origin in enumerate(origins):
        position = j if j < _INPUTS else j - _INPUTS + _SLOTS_AT
        arg = args[position]
        if origin is None:
            if arg is not None:
                return None
            continue
        i, convert = origin
        source = sources[i]
        if arg is source or (isinstance(source, torch.Tensor) and _in_place(arg, source)
                             and arg.shape == source.shape and arg.stride() == source.stride()):
            operands.append((position, i, None, None, None))  # the source itself is that view
        elif isinstance(source, torch.Tensor) and _in_place(arg, source):
            operands.append((position, i, tuple(arg.shape), tuple(arg.stride()), None))
        elif convert is not None:
            operands.append((position, i, None, None, convert))
        else:
            return None
    template = [None] * len(args)
    template[8:10] = args[8:10]
    buffers = (*((tuple(t.shape), t.dtype, False) for t in args[4:6]), *((tuple(t.shape), t.dtype) for t in args[6:8]))
    return FlexDecodeLaunch(kernel, tuple(template), tuple(operands), buffers, args[6].device, args[4].shape[0])


def run_checked(q, k, v, *, scale, kv_len=None, num_splits=None, score_mod=None, score_tensors=(), mask_mod=None,
                mask_tensors=(), block_mask=(None, None, None, None), kv_block_size=128, q_block_size=128,
                copy_kv: bool = False) -> tuple[torch.Tensor, torch.Tensor, FlexDecodeLaunch | None]:
    """flex_decode (returning lse) through every check, launched, then the FlexDecodeLaunch that
    repeats it on these tensors' layouts: (out, lse, launch), launch None for an empty output.
    `copy_kv` copies k/v layouts the kernel cannot stream (each call) instead of refusing them.
    Raises UnsupportedError as flex_decode does."""
    out, lse, launched = _checked(q, k, v, scale, kv_len, num_splits, score_mod, score_tensors, mask_mod,
                                  mask_tensors, tuple(block_mask), kv_block_size, q_block_size, copy_kv)
    if launched is None:
        return out, lse, None
    kernel, args, origins = launched
    return out, lse, _launch_of(kernel, args, origins,
                                sources(q, k, v, kv_len, score_tensors, mask_tensors, block_mask))
