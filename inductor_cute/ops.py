"""Eager entry points: call our kernels on torch tensors, no torch.compile needed.

Every check that can fail is made here, before a kernel runs, and raises UnsupportedError with
one line that names the problem.
"""

from __future__ import annotations

import functools

import torch

from .errors import UnsupportedError
from .runtime import device_arch, get_kernel

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ALIGN_BYTES = 16  # every kernel reads and writes rows with 16-byte vectors


@functools.lru_cache(maxsize=None)
def _check_device(index: int) -> None:
    device_arch(index)  # raises for a GPU we have no kernels for; remembered once it passes


def _check_cuda(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"{name}: expected torch.Tensor arguments, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise UnsupportedError(f"{name}: tensors must be on a CUDA device, got {t.device}")
    _check_device(tensors[0].device.index or 0)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous and 16-byte aligned, else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=256)
def _rmsnorm_kernel(n: int, dtype_name: str):
    from .kernels.rmsnorm_config import rmsnorm_spec, unsupported_reason

    problem = unsupported_reason(n, dtype_name)
    if problem:
        raise UnsupportedError(f"rmsnorm: {problem}")
    return get_kernel(rmsnorm_spec(n, dtype_name))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x**2, -1) + eps) * weight, accumulated in fp32, returned in x's dtype."""
    _check_cuda("rmsnorm", x, weight)
    dtype_name = _DTYPE_NAMES.get(x.dtype)
    if dtype_name is None:
        raise UnsupportedError(f"rmsnorm: dtype {x.dtype} is not supported (use bfloat16, float16 or float32)")
    if weight.dtype != x.dtype:
        raise UnsupportedError(f"rmsnorm: weight dtype {weight.dtype} differs from input dtype {x.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise UnsupportedError(f"rmsnorm: weight of shape {tuple(weight.shape)} does not match input {tuple(x.shape)}")
    if weight.device != x.device:
        raise UnsupportedError(f"rmsnorm: weight is on {weight.device}, input on {x.device}")
    n = x.shape[-1]
    kernel = _rmsnorm_kernel(n, dtype_name)
    if x.numel() == 0:
        return torch.empty_like(x)
    x = _aligned(x)
    out = torch.empty_like(x)
    kernel(x.view(-1, n), _aligned(weight), out.view(-1, n), float(eps))
    return out
