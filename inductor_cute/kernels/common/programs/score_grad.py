"""The derivative of a score program with respect to its score, as a score program: what the
attention backward multiplies dS by to carry it through a score_mod (dS of the raw score = dS of
the modified one times d score_mod / d score).

`tangent(text, tensor_dtypes)` is forward-mode differentiation of the program's steps: it keeps
every step and adds, for each float step that depends on "score", the steps of its derivative; the
new program ends in the derivative of the result, and the original result keeps its name, so a
kernel can read both (make_score_fn's `outputs`). Ints, bools and loaded values do not depend on the
score (a captured tensor that needs its own gradient is the caller's to refuse). Where torch
autograd picks a derivative at a kink, so does this: abs at 0 gives 0, maximum and minimum of equal
values give each side half.

Plain Python, usable without the CuTe DSL.
"""

from __future__ import annotations

import itertools
import math

from .registry import dumps
from .score import loads, tensor_name, types_of

LN2 = math.log(2.0)
COMPARE_SWAPPED = {"gt": "lt", "lt": "gt", "ge": "le", "le": "ge"}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Builder:
    """Appends derivative steps. A tangent is a step name, a float, or None for zero; numbers
    fold, and an emitted step takes a name as its first argument (the torch reference ops want a
    tensor there)."""

    def __init__(self, steps: list[list], taken: set):
        self.steps = [list(s) for s in steps]
        self.taken = taken
        self.counter = itertools.count()

    def emit(self, op: str, *args) -> str:
        name = f"d{next(self.counter)}_"
        while name in self.taken:
            name = f"d{next(self.counter)}_"
        self.taken.add(name)
        self.steps.append([name, op, *(float(x) if _number(x) else x for x in args)])
        return name

    def add(self, a, b):
        if a is None or b is None:
            return b if a is None else a
        if _number(a) and _number(b):
            return float(a + b)
        return self.emit("add", *((a, b) if isinstance(a, str) else (b, a)))

    def mul(self, a, b):
        if a is None or b is None:
            return None
        if _number(a) and _number(b):
            return float(a * b)
        if _number(a) and a == 1 or _number(b) and b == 1:
            return b if _number(a) and a == 1 else a
        return self.emit("mul", *((a, b) if isinstance(a, str) else (b, a)))

    def neg(self, a):
        return self.mul(a, -1.0)

    def sub(self, a, b):
        return self.add(a, self.neg(b))

    def compare(self, op: str, a, b) -> str:
        return self.emit(op, a, b) if isinstance(a, str) else self.emit(COMPARE_SWAPPED[op], b, a)

    def where(self, c, a, b):
        a, b = 0.0 if a is None else a, 0.0 if b is None else b
        if _number(a) and _number(b) and a == b:
            return float(a)
        return self.emit("where", c, a, b)

    def div(self, n, a):
        """n / a; score programs have no reciprocal op, and a number comes second."""
        if n is None:
            return None
        if _number(a):
            return self.mul(n, 1.0 / a if a else math.inf)
        if _number(n):  # n / a as (a * 0 + n) / a: the same value, NaN where a is
            n = self.emit("add", self.emit("mul", a, 0.0), n)
        return self.emit("truediv", n, a)


def _rules(f: _Builder):
    """op -> (result name, args, arg tangents) -> the result's tangent, for every float op of
    score programs (registry.ops_of(SCORE))."""
    return {
        "neg": lambda y, a, d: f.neg(d[0]),
        "abs": lambda y, a, d: f.mul(f.where(f.compare("gt", a[0], 0.0), 1.0,
                                             f.where(f.compare("lt", a[0], 0.0), -1.0, 0.0)), d[0]),
        "exp": lambda y, a, d: f.mul(y, d[0]),
        "exp2": lambda y, a, d: f.mul(f.mul(y, LN2), d[0]),
        "log": lambda y, a, d: f.div(d[0], a[0]),
        "tanh": lambda y, a, d: f.mul(f.add(f.neg(f.mul(y, y)), 1.0), d[0]),
        "sigmoid": lambda y, a, d: f.mul(f.mul(y, f.add(f.neg(y), 1.0)), d[0]),
        "add": lambda y, a, d: f.add(d[0], d[1]),
        "sub": lambda y, a, d: f.sub(d[0], d[1]),
        "mul": lambda y, a, d: f.add(f.mul(d[0], a[1]), f.mul(a[0], d[1])),
        "truediv": lambda y, a, d: f.div(f.sub(d[0], f.mul(y, d[1])), a[1]),
        "maximum": lambda y, a, d: _pick(f, "gt", a, d),
        "minimum": lambda y, a, d: _pick(f, "lt", a, d),
        "where": lambda y, a, d: f.where(a[0], d[1], d[2]),
        "float": lambda y, a, d: d[0],
    }


def _pick(f: _Builder, wins: str, args, d):
    """maximum (wins "gt") or minimum ("lt"): the winner's tangent, half of each on a tie."""
    loses = COMPARE_SWAPPED[wins]
    tie = f.mul(f.add(d[0], d[1]), 0.5)
    return f.where(f.compare(wins, *args), d[0], f.where(f.compare(loses, *args), d[1], tie))


def tangent(text: str, tensor_dtypes=()) -> tuple[str, str, str]:
    """(program, result, derivative): the score program `text` (over captured tensors of these
    dtypes) followed by the steps of its derivative with respect to "score", which it ends in, and
    the names of the original result and of the derivative; raises ValueError for an op without a
    derivative on the score's path."""
    steps = loads(text, tensor_dtypes)
    types = types_of(steps, tensor_dtypes)
    f = _Builder(steps, set(types) | {tensor_name(i) for i in range(len(tensor_dtypes))})
    rules = _rules(f)
    tangents = {"score": 1.0}
    for name, op, *args in steps:
        if types[name] != "f":  # ints and bools carry no derivative
            continue
        d = [tangents.get(a) if isinstance(a, str) else None for a in args]
        if all(t is None for t in d):
            continue
        if op not in rules:
            raise ValueError(f"score_mod op {op!r} has no derivative here (its result depends on the score)")
        t = rules[op](name, args, d)
        if t is not None:
            tangents[name] = t
    result = tangents.get(steps[-1][0])
    if result is None or _number(result):  # a constant derivative (NaN where the score is)
        derivative = f.emit("add", f.emit("mul", "score", 0.0), 0.0 if result is None else result)
    else:
        derivative = f.emit("add", result, 0.0)  # the derivative as the program's last step
    return dumps(f.steps), steps[-1][0], derivative


def derivative_error(text: str, tensor_dtypes=()) -> str | None:
    """Why a score program has no derivative program (tangent's ValueError); None when it has."""
    try:
        tangent(text, tensor_dtypes)
    except ValueError as e:
        return str(e)
    return None
