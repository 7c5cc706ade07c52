"""What torch.compile'd graphs call to run our GEMM on Inductor's buffers.

Generated output code imports this module, so a graph loaded from Inductor's FX cache finds the
function in a fresh process and loads its kernel from our disk cache without compiling.
"""

from __future__ import annotations

import functools

import torch

from ... import ops
from ...kernels.gemm.family import from_tuple

MODULE = __name__  # what generated output code imports
BATCHED = {"bmm", "baddbmm"}
WITH_INPUT = {"addmm", "baddbmm"}


def is_bias_row(sizes, strides, n: int) -> bool:
    """Whether an input of these sizes/strides is one contiguous (N,) row broadcast over the output."""
    return (len(sizes) > 0 and sizes[-1] == n and strides[-1] == 1
            and all(size == 1 or stride == 0 for size, stride in zip(sizes[:-1], strides[:-1])))


def input_role(sizes, strides, n: int, beta: float) -> str | None:
    """How an addmm/baddbmm input reaches the kernel: "row" (our bias vector), "full" (our C
    operand, scaled by beta) or None when beta == 0 (torch ignores the input then, NaN included)."""
    if beta == 0:
        return None
    return "row" if beta == 1 and is_bias_row(sizes, strides, n) else "full"


@functools.lru_cache(maxsize=None)
def _config(params: tuple):
    return from_tuple(params)


def gemm(*inputs: torch.Tensor, out: torch.Tensor, op: str, config: tuple, alpha: float = 1.0,
         beta: float = 1.0, epilogue: str = "", row: torch.Tensor | None = None,
         full: torch.Tensor | None = None) -> None:
    """out = alpha * a @ b (+ beta * inp for addmm/baddbmm) with one GemmConfig or GemvConfig
    (given as kernels.gemm_kernels.as_tuple makes it);
    with a fused `epilogue` program, out = program(a @ b, row, full) instead."""
    run = ops.bmm if op in BATCHED else ops.mm
    if epilogue:
        a, b = inputs
        run(a, b, bias=row, c=full, out=out, config=_config(config), epilogue=epilogue)
        return
    bias = c = None
    if op in WITH_INPUT:
        inp, a, b = inputs
        role = input_role(inp.shape, inp.stride(), out.shape[-1], beta)
        if role == "row":
            bias = inp[(0,) * (inp.dim() - 1)]
        elif role == "full":
            c = inp
    else:
        a, b = inputs
    run(a, b, bias=bias, c=c, alpha=alpha, beta=beta if c is not None else None, out=out,
        config=_config(config))
