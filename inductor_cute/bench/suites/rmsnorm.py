"""RMSNorm over LLM hidden sizes: ours vs Inductor's Triton reduction vs eager PyTorch."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ... import ops
from ..case import Case

# (tokens, hidden): decode batches and prefill chunks of Llama-3 8B/70B, Qwen3, DeepSeek-V3 sizes.
SHAPES = [(8, 4096), (256, 8192), (4096, 4096), (4096, 7168), (8192, 5120), (16384, 4096), (16384, 8192),
          (32768, 2048)]
QUICK = [(8, 4096), (4096, 4096), (16384, 8192)]
EPS = 1e-6


def _compiled(mode: str):
    torch._dynamo.reset()
    return torch.compile(functools.partial(F.rms_norm, eps=EPS), mode=mode, dynamic=False)


def _faster_triton(x, shape, w, notes):
    """Stock Inductor: the faster of its default and max-autotune modes, as the baseline."""
    best, best_t = None, float("inf")
    from ..timing import time_us

    for mode in ("default", "max-autotune-no-cudagraphs"):
        fn = _compiled(mode)
        fn(x, shape, w)
        t = time_us(lambda: fn(x, shape, w))
        if t < best_t:
            best, best_t, best_mode = fn, t, mode
    notes.append(f"triton mode {best_mode}")
    return lambda: best(x, shape, w)


def _case(m: int, n: int, dtype=torch.bfloat16) -> Case:
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    elt = x.element_size()
    notes: list[str] = []
    shape = (n,)
    triton_fn = _faster_triton(x, shape, w, notes)
    return Case(
        name=f"M{m} N{n} {str(dtype).removeprefix('torch.')}",
        params={"M": m, "N": n, "dtype": str(dtype)},
        flops=4 * m * n,
        bytes=2 * m * n * elt + n * elt,
        runners={"inductor_cute": lambda: ops.rmsnorm(x, w, EPS), "triton": triton_fn,
                 "aten": lambda: F.rms_norm(x, shape, w, EPS)},
        notes=notes,
    )


def cases(quick: bool):
    return [functools.partial(_case, m, n) for m, n in (QUICK if quick else SHAPES)]


def host_overhead():
    """Per-call host cost on a one-row input, where launch cost is all there is."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    compiled = _compiled("default")
    return {"inductor_cute": lambda: ops.rmsnorm(x, w, EPS), "triton": lambda: compiled(x, (4096,), w),
            "aten": lambda: F.rms_norm(x, (4096,), w, EPS)}
