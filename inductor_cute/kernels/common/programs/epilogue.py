"""Pointwise epilogue programs: what a fused GEMM epilogue computes, as data.

A program is a JSON list of SSA steps `[name, op, arg, ...]`; the last step is the output. Args
are earlier names, the leaves "acc" (the fp32 accumulator of A @ B), "row" (a per-column vector,
the kernel's bias operand) and "full" (an (M, N) tensor, the kernel's C operand), or numbers.
Code generation (inductor/epilogue.py) writes programs; the GEMM builder turns one into the
kernel's epilogue hook. Plain Python here; the CuTe DSL is imported only by `make_epilogue_fn`.
"""

from __future__ import annotations

import json
import math

LEAVES = ("acc", "row", "full")
UNARY = ("neg", "abs", "exp", "exp2", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "erf", "relu")
BINARY = ("add", "sub", "mul", "truediv", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne")
TERNARY = ("where",)
ARITY = {**{op: 1 for op in UNARY}, **{op: 2 for op in BINARY}, **{op: 3 for op in TERNARY}}


def dumps(steps: list[list]) -> str:
    """The canonical text of a program (it is part of the kernel's cache key)."""
    return json.dumps(steps, separators=(",", ":"))


def parse_steps(text: str, kind: str) -> list:
    """The JSON list of steps of a `kind` ("epilogue", "score") program, not yet validated."""
    try:
        steps = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{kind} program is not JSON: {e}") from None
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"{kind} program must be a non-empty list of steps")
    return steps


def split_step(step, arity: dict, kind: str) -> tuple[str, str, list]:
    """(name, op, args) of one step [name, op, *args] whose op is in `arity` with that many args."""
    if not isinstance(step, list) or len(step) < 2 or not isinstance(step[0], str):
        raise ValueError(f"bad {kind} step {step!r}")
    name, op, args = step[0], step[1], step[2:]
    if op not in arity or len(args) != arity[op]:
        raise ValueError(f"{kind} op {op!r} with {len(args)} arguments is not supported")
    return name, op, args


def loads(text: str) -> list[list]:
    """Parse and validate a program; raises ValueError naming the first problem."""
    steps = parse_steps(text, "epilogue")
    names = set(LEAVES)
    for step in steps:
        name, op, args = split_step(step, ARITY, "epilogue")
        for arg in args:
            if isinstance(arg, bool) or not (isinstance(arg, (int, float)) or arg in names):
                raise ValueError(f"epilogue step {name}: unknown argument {arg!r}")
        if name in names:
            raise ValueError(f"epilogue step name {name!r} is used twice")
        names.add(name)
    return steps


def operands(steps: list[list]) -> set[str]:
    """Which of the "row" and "full" operands a program reads."""
    return {arg for step in steps for arg in step[2:] if arg in ("row", "full")}


def evaluate(steps: list[list], env: dict, ops: dict):
    """Run a program with `ops[name](*args)` on values in `env` (leaf name -> value)."""
    values = dict(env)
    for name, op, *args in steps:
        values[name] = ops[op](*(values[a] if isinstance(a, str) else float(a) for a in args))
    return values[steps[-1][0]]


def reference_ops() -> dict:
    """The ops on torch tensors, for tests and for checking generated programs on the CPU."""
    import torch

    return {
        "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
        "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "tanh": torch.tanh,
        "sigmoid": torch.sigmoid, "erf": torch.erf, "relu": torch.relu,
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
        "maximum": lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)),
        "minimum": lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)),
        "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
        "where": lambda c, a, b: torch.where(torch.as_tensor(c), torch.as_tensor(a), torch.as_tensor(b)),
    }


def make_epilogue_fn(text: str, fast: bool):
    """The GEMM kernel's epilogue hook for a program: acc/bias/c are fp32 fragments (bias already
    broadcast along M); numbers fold at trace time. `fast` picks bf16-grade special functions."""
    import cutlass.cute as cute

    from ..activations import activations

    steps = loads(text)
    act = activations(fast)

    def is_num(x):
        return isinstance(x, float)

    def unary(tensor_fn, number_fn):
        return lambda x: number_fn(x) if is_num(x) else tensor_fn(x)

    def where(c, a, b):
        if isinstance(c, bool):
            return a if c else b
        if is_num(a) and is_num(b):
            raise ValueError("where() with two constant branches is not supported")
        return cute.where(c, a, b)

    def nan_to(a, b, picked):
        # torch.maximum/minimum propagate NaN from either side
        if not is_num(a):
            picked = cute.where(a != a, a, picked)
        if not is_num(b):
            picked = cute.where(b != b, b, picked)
        return picked

    def maximum(a, b):
        return max(a, b) if is_num(a) and is_num(b) else nan_to(a, b, where(a > b, a, b))

    def minimum(a, b):
        return min(a, b) if is_num(a) and is_num(b) else nan_to(a, b, where(a < b, a, b))

    ops = {
        "neg": lambda x: -x, "abs": lambda x: abs(x) if is_num(x) else cute.where(x < 0.0, -x, x),
        "exp": unary(lambda x: cute.math.exp(x, fastmath=True), math.exp),
        "exp2": unary(lambda x: cute.math.exp2(x, fastmath=True), lambda x: 2.0 ** x),
        "log": unary(lambda x: cute.math.log(x, fastmath=fast), math.log),
        "sqrt": unary(lambda x: cute.math.sqrt(x, fastmath=fast), math.sqrt),
        "rsqrt": unary(lambda x: cute.math.rsqrt(x, fastmath=fast), lambda x: 1.0 / math.sqrt(x)),
        "reciprocal": lambda x: 1.0 / x,
        "tanh": unary(act["tanh"], math.tanh), "sigmoid": unary(act["sigmoid"], lambda x: 1.0 / (1.0 + math.exp(-x))),
        "erf": unary(cute.math.erf, math.erf), "relu": unary(act["relu"], lambda x: max(x, 0.0)),
        "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
        "truediv": lambda a, b: a / b, "maximum": maximum, "minimum": minimum,
        "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
        "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
        "where": where,
    }

    def epilogue_fn(acc, *, alpha, beta, bias=None, c=None):
        return evaluate(steps, {"acc": acc, "row": bias, "full": c}, ops)

    return epilogue_fn
