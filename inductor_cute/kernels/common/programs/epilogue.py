"""Pointwise epilogue programs: what a fused GEMM epilogue computes, as data.

A program is a JSON list of SSA steps `[name, op, arg, ...]`; the last step is the output. Args
are earlier names, the leaves "acc" (the fp32 accumulator of A @ B), "row" (a per-column vector,
the kernel's bias operand) and "full" (an (M, N) tensor, the kernel's C operand), or numbers.
Its ops are the registry's epilogue ops (registry.py). Code generation (inductor/gemm/epilogue.py)
writes programs; the GEMM builder turns one into the kernel's epilogue hook. Plain Python here;
the CuTe DSL is imported only by `make_epilogue_fn`.
"""

from __future__ import annotations

from . import registry
from .registry import EPILOGUE, dumps, evaluate, parse_steps, split_step  # noqa: F401  (public here too)

LEAVES = ("acc", "row", "full")
ARITY = registry.arity(EPILOGUE)


def loads(text: str) -> list[list]:
    """Parse, validate and type a program; raises ValueError naming the first problem."""
    steps = parse_steps(text, EPILOGUE)
    typer = registry.Typer(EPILOGUE, dict.fromkeys(LEAVES, "f"))
    for step in steps:
        typer.add(step)
    return steps


def operands(steps: list[list]) -> set[str]:
    """Which of the "row" and "full" operands a program reads."""
    return {arg for step in steps for arg in step[2:] if arg in ("row", "full")}


def reference_ops() -> dict:
    """The epilogue ops on torch tensors, for tests and for checking generated programs on the CPU."""
    return registry.reference_ops(EPILOGUE)


def reference(text: str, acc, row=None, full=None):
    """The program on torch tensors (broadcasting): what the kernel computes per element."""
    return evaluate(loads(text), {"acc": acc, "row": row, "full": full}, reference_ops())


def make_epilogue_fn(text: str, fast: bool):
    """The GEMM kernel's epilogue hook for a program: acc/bias/c are fp32 fragments (bias already
    broadcast along M); numbers fold at trace time. `fast` picks bf16-grade special functions."""
    steps = loads(text)
    ops = registry.dsl_ops(EPILOGUE, registry.FragmentDsl(fast))
    numbers = [tuple(None if isinstance(a, str) else float for a in step[2:]) for step in steps]

    def epilogue_fn(acc, *, alpha, beta, bias=None, c=None):
        return evaluate(steps, {"acc": acc, "row": bias, "full": c}, ops, numbers)

    return epilogue_fn
