"""The one registry of the ops that generated programs compute, for both kinds of program:

    "epilogue"  a fused GEMM epilogue (epilogue.py): fp32 fragments of the tile, numbers fold at
                trace time
    "score"     a flex_attention score_mod or mask_mod (score.py): typed DSL scalars per element

A program is a JSON list of SSA steps `[name, op, arg, ...]`; the last step is the result. Every
op has one entry here: its arity, the rule that types its result ("f" fp32, "i" int32, "b" bool),
its torch reference, its DSL implementation per kind (None where that kind has no such op), the
Inductor names it is translated from, and a place for its gradient. Parsing, validation, typing
and evaluation go through this module for both kinds. An op both kinds have keeps two DSL
implementations: the epilogue's work on whole fragments with bf16-grade special functions for a
bf16 output, the score kind's on scalars with IEEE math; each emits exactly what its kernels
were checked with.

Plain Python at import: a DSL implementation is a function of a namespace `d` (FragmentDsl or
ScalarDsl below) that imports cutlass when a kernel is traced; a torch reference is a function
of the torch module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

EPILOGUE, SCORE = "epilogue", "score"


@dataclass(frozen=True)
class Op:
    name: str
    arity: int
    typing: str  # a rule of `result_type`
    reference: Callable  # (torch, *args) -> tensor: for tests and CPU stand-ins
    fragment: Callable | None = None  # (FragmentDsl, *args): the epilogue kind's implementation
    scalar: Callable | None = None  # (ScalarDsl, *args): the score kind's implementation
    aten: tuple[str, ...] = ()  # aten overloads ("add.Tensor") a score_mod/mask_mod graph node maps from
    handler: str | None = None  # the Inductor ops-handler method an epilogue body maps from
    # flex backward will need each op's partial derivatives (tanh's for softcap) as program steps;
    # an entry's derivative goes here when that kernel exists. None: not differentiable yet.
    gradient: Callable | None = None

    def implementation(self, kind: str) -> Callable | None:
        return self.fragment if kind == EPILOGUE else self.scalar


# ------------------------------------------------------------------- DSL implementation helpers

def _fold(number_fn, tensor_fn):
    """An epilogue unary op: computed at trace time on a number, in the kernel on a fragment."""
    return lambda d, x: number_fn(x) if isinstance(x, float) else tensor_fn(d, x)


def _fragment_where(d, c, a, b):
    if isinstance(c, bool):
        return a if c else b
    if isinstance(a, float) and isinstance(b, float):
        raise ValueError("where() with two constant branches is not supported")
    return d.cute.where(c, a, b)


def _fragment_nan(d, a, b, picked):
    # torch.maximum/minimum propagate NaN from either side
    if not isinstance(a, float):
        picked = d.cute.where(a != a, a, picked)
    if not isinstance(b, float):
        picked = d.cute.where(b != b, b, picked)
    return picked


def _fragment_maximum(d, a, b):
    if isinstance(a, float) and isinstance(b, float):
        return max(a, b)
    return _fragment_nan(d, a, b, _fragment_where(d, a > b, a, b))


def _fragment_minimum(d, a, b):
    if isinstance(a, float) and isinstance(b, float):
        return min(a, b)
    return _fragment_nan(d, a, b, _fragment_where(d, a < b, a, b))


def _scalar_nan(d, a, b, picked):  # torch.maximum/minimum: NaN from either side wins
    return d.sel(b != b, b, d.sel(a != a, a, picked, "f"), "f") if isinstance(a, d.Float32) else picked


def _scalar_maximum(d, a, b):
    return _scalar_nan(d, a, b, d.sel(a > b, a, b, d.kind_of(a)))


def _scalar_minimum(d, a, b):
    return _scalar_nan(d, a, b, d.sel(a < b, a, b, d.kind_of(a)))


def _scalar_floor_div_mod(d, a, b):
    # torch floors the quotient and gives the remainder the divisor's sign. The DSL's Int32 `//`
    # (arith.floordivsi) came out as a truncating division in the PTX, wrong on the H200 for a
    # negative dividend. So divide magnitudes (every rounding agrees there), take the truncated
    # quotient and step it down where the operands' signs differ and the division is inexact
    one, zero = d.Int32(1), d.Int32(0)
    magnitude = d.sel(a < 0, -a, a, "i") // d.sel(b < 0, -b, b, "i")
    signs_differ = d.sel(a < 0, one, zero, "i") != d.sel(b < 0, one, zero, "i")
    q = d.sel(signs_differ, -magnitude, magnitude, "i")
    r = a - q * b
    fix = (r != 0) & signs_differ
    return d.sel(fix, q - 1, q, "i"), d.sel(fix, r + b, r, "i")


def _scalar_load(d, t, i):
    n = d.Int32(t.shape[0])
    i = d.sel(i < 0, i + n, i, "i")  # a negative index counts from the end, as torch indexing does
    i = d.cutlass.max(d.cutlass.min(i, n - 1), d.Int32(0))
    v = t[i]
    return v if t.element_type is d.Int32 else d.Float32(v)


class FragmentDsl:
    """What the epilogue kind's implementations use: fp32 fragments (TensorSSA) and numbers.
    `fast` picks bf16-grade special functions."""

    def __init__(self, fast: bool):
        import cutlass.cute as cute

        from ..activations import activations

        self.cute, self.fast, self.act = cute, fast, activations(fast)


class ScalarDsl:
    """What the score kind's implementations use: Float32, Int32 and Boolean scalars."""

    def __init__(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Boolean, Float32, Int32

        self.cutlass, self.cute = cutlass, cute
        self.Float32, self.Int32, self.Boolean = Float32, Int32, Boolean
        self.typed = {"f": Float32, "i": Int32, "b": Boolean}

    def sel(self, c, a, b, t: str):
        return self.typed[t](self.cutlass.select_(c, a, b))

    def kind_of(self, x) -> str:
        return "f" if isinstance(x, self.Float32) else "i"


# ------------------------------------------------------------------------------------ the ops

def _math(fn, fastmath):
    """cute.math.fn with `fastmath` True, False or "fast" (the epilogue's bf16 switch)."""
    return lambda d, x: getattr(d.cute.math, fn)(x, fastmath=d.fast if fastmath == "fast" else fastmath)


def _unary(name, typing, ref, fragment=None, scalar=None):
    return Op(name, 1, typing, ref, fragment, scalar, (f"{name}.default",) if scalar else (),
              name if fragment else None)


def _binary(name, typing, ref, fragment=None, scalar=None, aten=None):
    aten = (f"{name}.Tensor", f"{name}.Scalar") if aten is None else aten
    return Op(name, 2, typing, ref, fragment, scalar, aten if scalar else (), name if fragment else None)


def _compare(name, py):
    return _binary(name, "compare", lambda t, a, b: getattr(t, name)(a, b), lambda d, a, b: py(a, b),
                   lambda d, a, b: py(a, b))


def _arith(name, py):
    return _binary(name, "same", lambda t, a, b: getattr(t, name)(a, b), lambda d, a, b: py(a, b),
                   lambda d, a, b: py(a, b))


_OPS = [
    # unary
    _unary("neg", "same", lambda t, x: t.neg(x), lambda d, x: -x, lambda d, x: -x),
    _unary("abs", "same", lambda t, x: t.abs(x),
           lambda d, x: abs(x) if isinstance(x, float) else d.cute.where(x < 0.0, -x, x),
           lambda d, x: d.sel(x < 0, -x, x, d.kind_of(x))),
    _unary("exp", "float", lambda t, x: t.exp(x), _fold(math.exp, _math("exp", True)), _math("exp", False)),
    _unary("exp2", "float", lambda t, x: t.exp2(x), _fold(lambda x: 2.0 ** x, _math("exp2", True)),
           _math("exp2", False)),
    _unary("log", "float", lambda t, x: t.log(x), _fold(math.log, _math("log", "fast")), _math("log", False)),
    _unary("sqrt", "float", lambda t, x: t.sqrt(x), _fold(math.sqrt, _math("sqrt", "fast"))),
    _unary("rsqrt", "float", lambda t, x: t.rsqrt(x), _fold(lambda x: 1.0 / math.sqrt(x), _math("rsqrt", "fast"))),
    _unary("reciprocal", "float", lambda t, x: t.reciprocal(x), lambda d, x: 1.0 / x),
    _unary("tanh", "float", lambda t, x: t.tanh(x), _fold(math.tanh, lambda d, x: d.act["tanh"](x)),
           _math("tanh", False)),
    _unary("sigmoid", "float", lambda t, x: t.sigmoid(x),
           _fold(lambda x: 1.0 / (1.0 + math.exp(-x)), lambda d, x: d.act["sigmoid"](x)),
           lambda d, x: 1.0 / (1.0 + d.cute.math.exp(-x, fastmath=False))),
    _unary("erf", "float", lambda t, x: t.erf(x), _fold(math.erf, lambda d, x: d.cute.math.erf(x))),
    # relu's handler is the epilogue translator's own (maximum with 0, which keeps NaN)
    Op("relu", 1, "same", lambda t, x: t.relu(x), _fold(lambda x: max(x, 0.0), lambda d, x: d.act["relu"](x))),
    # arithmetic
    _arith("add", lambda a, b: a + b),
    _arith("sub", lambda a, b: a - b),
    _arith("mul", lambda a, b: a * b),
    _binary("truediv", "float", lambda t, a, b: t.true_divide(a, b), lambda d, a, b: a / b, lambda d, a, b: a / b,
            ("div.Tensor", "div.Scalar")),
    _binary("maximum", "same", lambda t, a, b: t.maximum(t.as_tensor(a), t.as_tensor(b)), _fragment_maximum,
            _scalar_maximum, ("maximum.default",)),
    _binary("minimum", "same", lambda t, a, b: t.minimum(t.as_tensor(a), t.as_tensor(b)), _fragment_minimum,
            _scalar_minimum, ("minimum.default",)),
    # Python/torch integer division: floor, the remainder takes the divisor's sign
    Op("floordiv", 2, "int", lambda t, a, b: t.div(a, b, rounding_mode="floor"), None,
       lambda d, a, b: _scalar_floor_div_mod(d, a, b)[0], ("floor_divide.default", "floor_divide.Scalar")),
    _binary("remainder", "int", lambda t, a, b: t.remainder(a, b), None,
            lambda d, a, b: _scalar_floor_div_mod(d, a, b)[1]),
    # comparisons
    _compare("lt", lambda a, b: a < b), _compare("le", lambda a, b: a <= b), _compare("gt", lambda a, b: a > b),
    _compare("ge", lambda a, b: a >= b), _compare("eq", lambda a, b: a == b), _compare("ne", lambda a, b: a != b),
    # on bools: `&`, `|`, `~` of masks trace to the bitwise ops (the typing refuses ints)
    Op("and", 2, "logical", lambda t, a, b: t.logical_and(a, b), None, lambda d, a, b: a & b,
       ("logical_and.default", "bitwise_and.Tensor", "bitwise_and.Scalar")),
    Op("or", 2, "logical", lambda t, a, b: t.logical_or(a, b), None, lambda d, a, b: a | b,
       ("logical_or.default", "bitwise_or.Tensor", "bitwise_or.Scalar")),
    Op("not", 1, "logical", lambda t, x: t.logical_not(x), None, lambda d, x: ~x,
       ("logical_not.default", "bitwise_not.default")),
    Op("where", 3, "where", lambda t, c, a, b: t.where(t.as_tensor(c), t.as_tensor(a), t.as_tensor(b)),
       _fragment_where, lambda d, c, a, b: d.sel(c, a, b, d.kind_of(a)), ("where.self",), "where"),
    # casts (a graph's dtype conversions, translated by their target dtype) and captured tensors
    Op("float", 1, "to_float", lambda t, x: t.as_tensor(x).to(t.float32), None, lambda d, x: d.Float32(x)),
    # float -> int truncates toward zero, as torch's .to(int32)
    Op("int", 1, "to_int", lambda t, x: t.as_tensor(x).to(t.int32), None, lambda d, x: d.Int32(x)),
    # [name, "load", "t0", index]: t0[index], float dtypes read as fp32 (score programs only)
    Op("load", 2, "load", lambda t, tensor, i: tensor[t.as_tensor(i).long()], None, _scalar_load),
    # [name, "len", "t0"]: t0's element count, an int (a captured buffer's symbolic size comes from it)
    Op("len", 1, "load", lambda t, tensor: t.tensor(tensor.numel(), dtype=t.int32, device=tensor.device), None,
       lambda d, tensor: d.Int32(tensor.shape[0])),
]
OPS: dict[str, Op] = {op.name: op for op in _OPS}


def ops_of(kind: str) -> dict[str, Op]:
    """The ops a kind of program may use."""
    return {name: op for name, op in OPS.items() if op.implementation(kind) is not None}


def arity(kind: str) -> dict[str, int]:
    return {name: op.arity for name, op in ops_of(kind).items()}


def aten_ops() -> dict[str, str]:
    """aten overload name ("add.Tensor") -> the score-kind op a score_mod/mask_mod node becomes."""
    return {overload: op.name for op in ops_of(SCORE).values() for overload in op.aten}


def handler_ops() -> dict[str, str]:
    """Inductor ops-handler method -> the epilogue op an epilogue body's call becomes."""
    return {op.handler: op.name for op in ops_of(EPILOGUE).values() if op.handler}


# ------------------------------------------------------------------------- text and validation

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


def literal_type(x) -> str | None:
    """The type of a number in a program ("i" or "f"), None for anything else."""
    if isinstance(x, bool):
        return None
    return "i" if isinstance(x, int) else "f" if isinstance(x, float) else None


def result_type(op: str, types: list[str], name: str, kind: str = SCORE) -> str:
    """The type of a step computing `op` on arguments of `types`; raises ValueError if they do not
    fit. Numbers follow torch's promotion: an int and a float give a float. In an epilogue a bool
    counts as a number too (the kernel's fragment arithmetic converts it to 0/1, as torch does)."""
    def need(ok, what):
        if not ok:
            raise ValueError(f"{kind} step {name}: {op} needs {what}, got {'/'.join(types)}")

    numbers = "fib" if kind == EPILOGUE else "fi"
    numeric = all(t in numbers for t in types)
    rule = OPS[op].typing
    if rule == "float":
        need(numeric, "numbers")
        return "f"
    if rule == "same":
        need(numeric, "numbers")
        return "f" if "f" in types else "i"
    if rule == "int":
        need(all(t == "i" for t in types), "ints")
        return "i"
    if rule == "compare":
        need(numeric, "numbers")
        return "b"
    if rule == "logical":
        need(all(t == "b" for t in types), "bools")
        return "b"
    if rule == "where":
        need(types[0] == "b" and all(t in numbers for t in types[1:]), "a bool and two numbers")
        return "f" if "f" in types[1:] else "i"
    if rule == "to_float":
        return "f"
    assert rule == "to_int", rule
    return "i"


def operand_type(op: str, arg_types: list, result: str) -> str | None:
    """The type every numeric argument of a score step is brought to before the op (None: each
    stays as it is): the common type of a comparison or where's branches, fp32 for float math,
    else the result's type."""
    rule = OPS[op].typing
    if rule in ("to_float", "to_int", "load", "logical"):
        return None
    if rule in ("compare", "where"):
        return "i" if all(t == "i" for t in arg_types if t in ("f", "i")) else "f"
    if rule == "float":
        return "f"
    return result


class Typer:
    """Validates and types a program one step at a time: `types` holds every leaf's and typed
    step's type. `leaves`: name -> type; `tensors`: captured tensor name -> element type (their
    only use is as the first argument of `load` and `len`)."""

    def __init__(self, kind: str, leaves: dict, tensors: dict | None = None):
        self.kind, self.arity = kind, arity(kind)
        self.types, self.tensors = dict(leaves), dict(tensors or {})

    def add(self, step) -> str:
        """Type one more step; raises ValueError naming the problem."""
        name, op, args = split_step(step, self.arity, self.kind)
        if name in self.types or name in self.tensors:
            raise ValueError(f"{self.kind} step name {name!r} is used twice")
        if op in ("load", "len"):
            if args[0] not in self.tensors:
                raise ValueError(f"{self.kind} step {name}: {op} of unknown tensor {args[0]!r}")
            args = args[1:]
        arg_types = []
        for arg in args:
            t = self.types.get(arg) if isinstance(arg, str) else literal_type(arg)
            if t is None:
                raise ValueError(f"{self.kind} step {name}: unknown argument {arg!r}")
            arg_types.append(t)
        if op == "load":
            if arg_types[0] != "i":
                raise ValueError(f"{self.kind} step {name}: load index must be an int")
            t = self.tensors[step[2]]
        elif op == "len":
            t = "i"
        else:
            t = result_type(op, arg_types, name, self.kind)
        self.types[name] = t
        return t

    def type_of(self, arg) -> str | None:
        return self.types.get(arg) if isinstance(arg, str) else literal_type(arg)


# ----------------------------------------------------------------------------------- evaluation

def evaluate(steps: list[list], env: dict, ops: dict, convert=None, keep: dict | None = None):
    """Run a program with `ops[op](*args)`; `env` maps leaves (and tensor names) to values.
    `convert`, per step a tuple of per-argument functions (None: the value as it is), prepares
    each argument (numbers as the kind's constants, ints promoted) in argument order. Every
    step's value is also left in `keep` if given."""
    values = {} if keep is None else keep
    values.update(env)
    for k, (name, op, *args) in enumerate(steps):
        fns = convert[k] if convert is not None else (None,) * len(args)
        values[name] = ops[op](*(v if fn is None else fn(v) for v, fn in
                                 zip((values[a] if isinstance(a, str) else a for a in args), fns)))
    return values[steps[-1][0]]


def dsl_ops(kind: str, d) -> dict:
    """The kind's DSL implementations bound to its namespace (FragmentDsl or ScalarDsl)."""
    return {name: (lambda impl: lambda *args: impl(d, *args))(op.implementation(kind))
            for name, op in ops_of(kind).items()}


def reference_ops(kind: str | None = None) -> dict:
    """The ops on torch tensors (a kind's, or all), for tests and CPU stand-ins."""
    import torch

    chosen = OPS if kind is None else ops_of(kind)
    return {name: (lambda ref: lambda *args: ref(torch, *args))(op.reference) for name, op in chosen.items()}
