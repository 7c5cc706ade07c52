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


def _check_cuda(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"{name}: expected torch.Tensor arguments, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise UnsupportedError(f"{name}: tensors must be on a CUDA device, got {t.device}")
    device_arch(tensors[0].device)  # raises for a GPU we have no kernels for


def _aligned_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as a contiguous (rows, n) view, copied only if its layout or alignment needs it."""
    t2 = t.reshape(-1, n)
    if not t2.is_contiguous() or t2.data_ptr() % _ALIGN_BYTES:
        t2 = t2.contiguous() if not t2.is_contiguous() else t2.clone()
    return t2


@functools.lru_cache(maxsize=256)
def _rmsnorm_kernel(n: int, dtype_name: str):
    from .kernels.rmsnorm_config import rmsnorm_spec

    return get_kernel(rmsnorm_spec(n, dtype_name))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x**2, -1) + eps) * weight, accumulated in fp32, returned in x's dtype."""
    from .kernels import rmsnorm_config

    _check_cuda("rmsnorm", x, weight)
    if x.dtype not in _DTYPE_NAMES:
        raise UnsupportedError(f"rmsnorm: dtype {x.dtype} is not supported (use bfloat16, float16 or float32)")
    if weight.dtype != x.dtype:
        raise UnsupportedError(f"rmsnorm: weight dtype {weight.dtype} differs from input dtype {x.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise UnsupportedError(f"rmsnorm: weight of shape {tuple(weight.shape)} does not match input {tuple(x.shape)}")
    if weight.device != x.device:
        raise UnsupportedError(f"rmsnorm: weight is on {weight.device}, input on {x.device}")
    n = x.shape[-1]
    dtype_name = _DTYPE_NAMES[x.dtype]
    problem = rmsnorm_config.unsupported_reason(n, dtype_name)
    if problem:
        raise UnsupportedError(f"rmsnorm: {problem}")
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = _aligned_rows(x, n)
    w = _aligned_rows(weight, n)[0]
    out = torch.empty_like(rows)
    _rmsnorm_kernel(n, dtype_name)(rows, w, out, float(eps))
    return out.view(x.shape)
