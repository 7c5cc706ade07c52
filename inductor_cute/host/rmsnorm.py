"""Eager RMSNorm."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..runtime import get_kernel
from .common import DTYPE_NAMES, aligned, check_cuda

@functools.lru_cache(maxsize=256)
def _rmsnorm_kernel(n: int, dtype_name: str):
    from ..kernels.norm.rmsnorm_config import rmsnorm_spec, unsupported_reason

    problem = unsupported_reason(n, dtype_name)
    if problem:
        raise UnsupportedError(f"rmsnorm: {problem}")
    return get_kernel(rmsnorm_spec(n, dtype_name))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x**2, -1) + eps) * weight, accumulated in fp32, returned in x's dtype."""
    check_cuda("rmsnorm", x, weight)
    dtype_name = DTYPE_NAMES.get(x.dtype)
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
    x = aligned(x)
    out = torch.empty_like(x)
    kernel(x.view(-1, n), aligned(weight), out.view(-1, n), float(eps))
    return out
