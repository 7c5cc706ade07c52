"""What every eager entry point shares: dtype names, device checks, 16-byte alignment."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..runtime import device_arch

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
ALIGN_BYTES = 16  # every kernel reads and writes rows with 16-byte vectors


@functools.lru_cache(maxsize=None)
def check_device(index: int) -> None:
    device_arch(index)  # raises for a GPU we have no kernels for; remembered once it passes


def check_cuda(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"{name}: expected torch.Tensor arguments, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise UnsupportedError(f"{name}: tensors must be on a CUDA device, got {t.device}")
        if t.device != tensors[0].device:
            raise UnsupportedError(f"{name}: tensors are on {tensors[0].device} and {t.device}; expected one device")
    check_device(tensors[0].device.index or 0)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous and 16-byte aligned, else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_view(t: torch.Tensor, unit_mode: int) -> torch.Tensor | None:
    """`t` (any rank) restrided for TMA with `unit_mode` contiguous, or None if its layout cannot be.

    TMA needs a unit-stride mode, every other stride a multiple of 16 bytes and a 16-byte aligned
    base. Modes of extent 1 have no meaningful stride, so they get a packed one."""
    sizes, strides = list(t.shape), list(t.stride())
    if t.data_ptr() % ALIGN_BYTES or (sizes[unit_mode] > 1 and strides[unit_mode] != 1):
        return None
    strides[unit_mode] = 1
    packed = max(sz * st for sz, st in zip(sizes, strides))
    for i in range(t.dim()):
        if i == unit_mode:
            continue
        if sizes[i] == 1:
            strides[i] = -(-packed // 8) * 8
        elif strides[i] % 8 or strides[i] == 0:
            return None
    return t.as_strided(sizes, strides)


try:  # what Inductor's output code calls reinterpret_tensor: a view in C++, a third of as_strided's host time
    from torch._C._dynamo.guards import _reinterpret_tensor as alias
except ImportError:  # pragma: no cover
    def alias(t: torch.Tensor, sizes, strides, offset_increment: int) -> torch.Tensor:
        return t.as_strided(sizes, strides, t.storage_offset() + offset_increment)


_SCRATCH: dict[tuple, torch.Tensor] = {}  # (device, stream, slot, dtype, zeroed) -> flat buffer
_VIEWS: dict[tuple, tuple] = {}  # (device, stream, buffers) -> the views stream_scratch returned
MAX_SCRATCH_VIEWS = 256
_STRIDES: dict[tuple, tuple] = {}


def _contiguous_strides(shape: tuple) -> tuple:
    strides = _STRIDES.get(shape)
    if strides is None:
        acc, out = 1, []
        for size in reversed(shape):
            out.append(acc)
            acc *= size
        strides = _STRIDES[shape] = tuple(reversed(out))
    return strides


def _in_cudagraph_tree(device_index: int, stream: int) -> bool:
    """Whether torch.compile's CUDA-graph trees warm up or record on `stream` now: they run a
    graph's calls on their own stream with every allocation of the thread routed to the graphs'
    private pool, and refuse (at the end of the warm-up) a pool allocation the graph's outputs do
    not account for, as a buffer kept for later calls would be."""
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
        return manager is not None and manager.stream.cuda_stream == stream
    except Exception:  # another torch's internals: no trees known here
        return False


def _allocate(shape, dtype: torch.dtype, zeroed: bool, device: torch.device) -> torch.Tensor:
    return (torch.zeros if zeroed else torch.empty)(shape, device=device, dtype=dtype)


def _fresh(device: torch.device, buffers: tuple) -> tuple[torch.Tensor, ...]:
    return tuple(_allocate(shape, dtype, zeroed, device) for shape, dtype, zeroed in buffers)


def stream_scratch(device: torch.device, buffers: tuple, per_stream: bool = True) -> tuple[torch.Tensor, ...]:
    """Kernel workspaces reused by every call instead of allocated per call: `buffers` is a tuple
    of (shape, dtype, zeroed); zeroed ones start zeroed (a kernel that uses them leaves them zero
    again). Reuse is safe when each launch writes a workspace before reading it, or resets it,
    because calls on one stream never overlap: one flat buffer per (device, stream, position in
    `buffers`, dtype), grown to the largest size asked for (so dynamic sizes pin no more than
    the largest), or per device when `per_stream` is False (a launch that never touches them).
    During CUDA-graph capture, CUDA-graph trees' warm-up, and off CUDA, the buffers are fresh: no
    graph shares one with eager calls or with another graph, and none outlives its graph's pool."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return _fresh(device, buffers)
    current = torch._C._cuda_getCurrentRawStream(device.index)
    stream = current if per_stream else None
    # the views an earlier call with these buffers got (forgotten whenever a flat buffer is
    # allocated): one dict lookup instead of a lookup and a view per buffer, ~3 us a call on a CPU
    views = _VIEWS.get((device.index, stream, buffers))
    if views is not None:
        return views
    views = []
    for slot, (shape, dtype, zeroed) in enumerate(buffers):
        numel = 1
        for size in shape:
            numel *= size
        key = (device.index, stream, slot, dtype, zeroed)
        flat = _SCRATCH.get(key)
        if flat is None or flat.numel() < numel:  # the old buffer is freed in stream order
            if _in_cudagraph_tree(device.index, current):  # checked only here: trees never get a buffer
                return _fresh(device, buffers)
            flat = _SCRATCH[key] = _allocate(max(numel, 1), dtype, zeroed, device)
            _VIEWS.clear()  # views of the replaced buffer must not keep it alive or be handed out
        views.append(alias(flat, shape, _contiguous_strides(tuple(shape)), 0))
    views = tuple(views)
    if len(_VIEWS) >= MAX_SCRATCH_VIEWS:  # dynamic sizes: each its own views
        _VIEWS.clear()
    _VIEWS[(device.index, stream, buffers)] = views
    return views


def attention_shapes(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared_kv_ok: bool = False):
    """The checks every attention entry makes on q (B, Hq, Lq, Dqk), k (B, Hkv, Lkv, Dqk) and v
    (B, Hkv, Lkv, Dv): bf16/fp16 alike, 4-D, matching sizes, Hq a multiple of Hkv; with
    `shared_kv_ok`, k and v may have batch 1 for any query batch (one shared cache).
    Returns (batch, heads, q_len, dqk, kv_heads, kv_len, dv, shared_kv)."""
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"{name}: q, k and v must all be bfloat16 or float16, got {q.dtype}, {k.dtype} and "
                               f"{v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise UnsupportedError(f"{name}: expected 4-D q, k, v (batch, heads, length, dim), got {q.dim()}-D, "
                               f"{k.dim()}-D and {v.dim()}-D")
    batch, heads, q_len, dqk = q.shape
    kv_heads, kv_len, dv = k.shape[1], k.shape[2], v.shape[3]
    shared_kv = shared_kv_ok and batch > 1 and k.shape[0] == 1 and v.shape[0] == 1
    if not shared_kv and (k.shape[0] != batch or v.shape[0] != batch):
        also = " (k and v may also have batch 1, shared by every query batch)" if shared_kv_ok else ""
        raise UnsupportedError(f"{name}: batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}{also}")
    if k.shape[3] != dqk or v.shape[1] != kv_heads or v.shape[2] != kv_len:
        raise UnsupportedError(f"{name}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                               "match")
    if kv_heads == 0 or heads % kv_heads:
        raise UnsupportedError(f"{name}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    return batch, heads, q_len, dqk, kv_heads, kv_len, dv, shared_kv


BLOCK_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def block_lists(entry: str, lists: tuple, device, names: tuple = BLOCK_LISTS, cover: tuple | None = None) -> tuple:
    """A BlockMask's (counts, indices, full counts, full indices), named `names`, after the checks
    every kernel's entry `entry` makes: counts and indices given, the full ones together or not at
    all, 3-D counts and 4-D indices of int32 or int64 on `device` sharing the counts' (batch,
    heads, blocks) dims; with `cover` (batch, heads, rows, row block), a batch and a head dim of 1
    or those, and blocks that cover the rows. Without full lists, zero counts over the indices."""
    num, idx, full_num, full_idx = lists
    if num is None or idx is None or (full_num is None) != (full_idx is None):
        raise UnsupportedError(f"{entry}: a block mask needs {names[0]} and {names[1]}, and {names[2]} and "
                               f"{names[3]} together or not at all")
    if full_num is None:
        full_num, full_idx = torch.zeros_like(num), idx
    for name, t, dim in zip(names, (num, idx, full_num, full_idx), (3, 4, 3, 4)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.device != device or \
                t.dtype not in (torch.int32, torch.int64) or t.shape[:3] != num.shape or 0 in t.shape:
            raise UnsupportedError(f"{entry}: {name} must be a non-empty {dim}-D int32 tensor on {device} sharing "
                                   f"{names[0]}' (batch, heads, blocks) dims")
    if cover is not None:
        batch, heads, rows, row_block = cover
        z, h, blocks = num.shape
        if z not in (1, batch) or h not in (1, heads):
            raise UnsupportedError(f"{entry}: the block mask has (batch, heads) ({z}, {h}); expected 1 or ({batch}, "
                                   f"{heads}) each")
        if blocks * row_block < rows:
            raise UnsupportedError(f"{entry}: {names[0]} has {blocks} blocks of {row_block}, which do not cover {rows}")
    return num, idx, full_num, full_idx

