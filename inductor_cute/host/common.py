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


_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}


def stream_scratch(device: torch.device, buffers: tuple, per_stream: bool = True) -> tuple[torch.Tensor, ...]:
    """Kernel workspaces reused by every call instead of allocated per call: `buffers` is a tuple
    of (shape, dtype, zeroed); zeroed ones are zeroed once (a kernel that uses them leaves them
    zero again). Reuse is safe when each launch writes a workspace before reading it, or resets
    it, because calls on one stream never overlap: one set per (device, stream), or per device
    when `per_stream` is False (a launch that never touches them). During CUDA-graph capture, and
    off CUDA, the buffers are fresh: no graph shares one with eager calls or with another graph."""
    def fresh():
        return tuple((torch.zeros if zeroed else torch.empty)(shape, device=device, dtype=dtype)
                     for shape, dtype, zeroed in buffers)

    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return fresh()
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index) if per_stream else None, buffers)
    found = _SCRATCH.get(key)
    if found is None:
        found = _SCRATCH[key] = fresh()
    return found
