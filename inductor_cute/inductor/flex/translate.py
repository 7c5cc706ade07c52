"""flex_attention's score_mod and mask_mod FX graphs as score / mask programs
(kernels/common/programs/score.py): what the split-KV decode kernel computes per element.

A mod's graph sees its arguments (score, b, h, q, kv) as 0-d tensors and its captured buffers as
tensors of any rank. The kernel reads each captured buffer as a flat 1-D tensor (`Captured` says
how: row-major, bool and int64 as int32), so an N-D read `buf[i0, i1, ...]` becomes a load at
sum(i_d * stride_d), each index wrapped as torch wraps a negative one; a 0-d buffer used as a value
is a load at 0. A symbolic size is read where the mod also captures it as an integer operand
(Dynamo lifts the sizes of captured tensors into the mod's graph: `SizeOperand`); one more per
buffer may be symbolic without one, read as the buffer's length (`len`) divided by its other
sizes. Bool constants (and_masks' `new_ones((), dtype=bool)`) fold away; a bool used as a
number is 0/1, as in torch. Everything else a program cannot say raises ValueError naming it: the
lowering then leaves the call to the stock kernel.

Plain values in, text out: testable without Inductor.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...kernels.common.programs import registry
from ...kernels.common.programs import score as sp

_aten, _prims = torch.ops.aten, torch.ops.prims
LEAVES = ("score", "b", "h", "q", "kv")  # the score_mod's placeholders (score, b, h, m, n) in program terms
MASK_LEAVES = LEAVES[1:]  # the mask_mod's (b, h, m, n)
INT32_MAX = 2 ** 31 - 1

# A captured buffer's dtype -> the dtype the kernel reads it as (its values converted by the lowering).
# int64 becomes int32: the buffers mods capture hold positions, offsets and ids, far inside int32.
KERNEL_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
                 torch.int32: torch.int32, torch.int64: torch.int32, torch.bool: torch.int32}


@dataclasses.dataclass(frozen=True)
class SizeOperand:
    """A symbolic size of a captured buffer whose value the mod also captures, as the integer
    operand in buffer slot `slot`."""

    slot: int


@dataclasses.dataclass(frozen=True)
class Captured:
    """A captured buffer as the program reads it: its dtype and sizes (ints; a SizeOperand where a
    symbolic size is also an integer operand; None for at most one other symbolic size: the
    program divides the buffer's length, `len`, by the others; the kernel's int32 index arithmetic
    assumes fewer than 2^31 elements, which only the static part is checked for), or `problem`,
    why the kernel cannot read it."""

    dtype: torch.dtype | None = None
    shape: tuple = (None,)
    problem: str | None = None

    @property
    def kernel_dtype(self) -> torch.dtype:
        return KERNEL_DTYPES[self.dtype]


def describe(dtype: torch.dtype, shape, on_device: bool = True) -> Captured:
    """The Captured of a buffer of `dtype` and `shape` (ints, SizeOperands, None where symbolic)."""
    shape = tuple(shape)
    if not on_device:
        return Captured(problem="is not on the query's device")
    if dtype not in KERNEL_DTYPES:
        names = ", ".join(str(dt).removeprefix("torch.") for dt in KERNEL_DTYPES)
        return Captured(problem=f"has dtype {str(dtype).removeprefix('torch.')} (supported: {names})")
    if shape.count(None) > 1:
        return Captured(problem=f"has more than one symbolic size that no integer operand holds: {shape}")
    numel = math.prod(s for s in shape if isinstance(s, int))
    if numel == 0 or numel > INT32_MAX:
        return Captured(problem=f"has {numel} elements")
    return Captured(dtype, shape)


def _captured(buffer) -> Captured:
    """A Captured, or a dtype (a 1-D buffer of any length, for tests and older callers)."""
    return buffer if isinstance(buffer, Captured) else describe(buffer, (None,))


def output_value(gm: torch.fx.GraphModule):
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = output.args[0]
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def is_full(node, value) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is torch.ops.aten.full.default and node.args[1] == value)


def is_identity_score_mod(gm: torch.fx.GraphModule) -> bool:
    """The score_mod graph returns its score argument untouched (no score_mod was given)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return len(placeholders) >= 5 and output_value(gm) is placeholders[0]


def is_noop_mask_mod(gm: torch.fx.GraphModule) -> bool:
    """The mask_mod graph is flex_attention's noop_mask: a constant True, whatever (b, h, m, n)."""
    return is_full(output_value(gm), True)


def score_program(gm: torch.fx.GraphModule, buffers: tuple = (), score_dtype: torch.dtype = torch.float32) -> str:
    """The canonical score program of a score_mod graph, "" for the identity; raises ValueError
    saying what cannot be translated. All float math is fp32, as eager flex_attention computes it:
    the graph says `score_dtype` (the query's) for the scores, so a cast to it keeps fp32."""
    if is_identity_score_mod(gm):
        return ""
    return _Translation(gm, tuple(map(_captured, buffers)), False, score_dtype).program()


def mask_program(gm: torch.fx.GraphModule, buffers: tuple = ()) -> str:
    """The canonical mask program of a mask_mod graph, "" when it keeps every key (noop_mask, or
    what folds to True); raises ValueError saying what cannot be translated."""
    if is_noop_mask_mod(gm):
        return ""
    return _Translation(gm, tuple(map(_captured, buffers)), True, None).program()


@dataclasses.dataclass(frozen=True)
class _View:
    """Captured buffer `slot`, indexed so far at `indices` (dim -> program argument); `remaining`
    are its dims not indexed yet, in order."""

    slot: int
    indices: tuple = ()  # ((dim, argument), ...)
    remaining: tuple = ()


def _aten_overload(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(_aten, packet), overload)


_OPS = {_aten_overload(name): op for name, op in registry.aten_ops().items()}  # aten overload -> program op
_LOGICAL = {op for op, name in _OPS.items() if registry.OPS[name].typing == "logical"}
_WHERE = (_aten.where.self, _aten.where.ScalarSelf, _aten.where.ScalarOther, _aten.where.Scalar)
_FLOOR_DIV = (_aten.div.Tensor_mode, _aten.div.Scalar_mode)
_CASTS = (_prims.convert_element_type.default, _aten._to_copy.default)
_CONSTANTS = (_aten.full.default, _aten.scalar_tensor.default, _aten.ones.default, _aten.zeros.default)
_IDENTITY = (_aten.clone.default, _aten.alias.default, _aten.lift_fresh_copy.default, _aten.detach.default)
_NONNEG_OPS = ("add", "mul", "floordiv", "maximum")  # of nonnegative ints: nonnegative
_ON_BOOLS = {"add": "or", "maximum": "or", "mul": "and", "minimum": "and"}  # what torch computes on two bools


class _Translation:
    """One graph's translation: its steps, typed as they are emitted, and each node's value (a
    leaf or step name, a number, a Python bool, or a _View of a captured buffer)."""

    def __init__(self, gm: torch.fx.GraphModule, buffers: tuple, mask: bool, score_dtype):
        self.gm, self.buffers, self.mask, self.score_dtype = gm, buffers, mask, score_dtype
        self.what = "mask_mod" if mask else "score_mod"
        leaves = MASK_LEAVES if mask else LEAVES
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) < len(leaves):
            raise ValueError(f"{self.what} graph without its {len(leaves)} arguments")
        if len(placeholders) - len(leaves) != len(buffers):
            raise ValueError("captured buffers do not match the graph")
        for i, buf in enumerate(buffers):
            if buf.problem:
                raise ValueError(f"captured buffer {i} {buf.problem}")
        dtypes = tuple(str(b.kernel_dtype).removeprefix("torch.") for b in buffers)
        self.dtypes = dtypes
        self.typer = sp.typer(dtypes, mask)
        self.values = dict(zip(placeholders, leaves))
        self.values.update({node: _View(i, (), tuple(range(len(buf.shape))))
                            for i, (node, buf) in enumerate(zip(placeholders[len(leaves):], buffers))})
        self.steps: list[list] = []
        self.nonneg = {"b", "h", "q", "kv"}
        self.loaded = {}  # _View -> the name of its load (a 0-d buffer read where it is used)
        self.symbolic = {}  # buffer slot -> the step computing its symbolic size
        self.as_int = {}  # bool step -> its 0/1 int step
        self.made = 0  # steps named by `fresh`

    # ------------------------------------------------------------------------------- the steps

    def emit(self, name: str, op: str, *args) -> str:
        self.steps.append([name, op, *args])
        self.typer.add(self.steps[-1])
        if (op in _NONNEG_OPS and all(self.is_nonneg(a) for a in args)) or op in ("abs", "len") or \
                (op == "remainder" and isinstance(args[1], int) and args[1] > 0):
            if self.typer.types[name] == "i":
                self.nonneg.add(name)
        return name

    def fresh(self, base: str) -> str:
        """A new step name that no FX node has (FX names are identifiers)."""
        self.made += 1
        return f"{base}.{self.made}"

    def type_of(self, a) -> str | None:
        return "b" if isinstance(a, bool) else self.typer.type_of(a)

    def is_nonneg(self, a) -> bool:
        return (isinstance(a, int) and not isinstance(a, bool) and a >= 0) or a in self.nonneg

    # ------------------------------------------------------------------------ node arguments

    def value(self, x):
        """A node's value or a literal; a number out of int32 range or anything else raises."""
        if isinstance(x, torch.fx.Node):
            if x not in self.values:
                raise ValueError(f"{x.name} is used as a value")
            return self.values[x]
        if isinstance(x, bool):
            return x
        if isinstance(x, int):
            if abs(x) > INT32_MAX:
                raise ValueError(f"the integer {x} does not fit int32")
            return x
        if isinstance(x, float):
            return x
        raise ValueError(f"argument {x!r}")

    def scalar(self, x):
        """A value that is one element: a buffer view indexed down to one (or a 0-d buffer) is loaded."""
        v = self.value(x)
        return self.read(v) if isinstance(v, _View) else v

    def read(self, v: _View) -> str:
        """The one element of a view indexed down to one (or of a 0-d buffer), loaded once."""
        if v.remaining:
            raise ValueError(f"captured buffer {v.slot} is used as a tensor of {len(v.remaining)} dims")
        if v not in self.loaded:
            self.loaded[v] = self.load(self.fresh(f"t{v.slot}"), v)
        return self.loaded[v]

    def number(self, x):
        """A scalar as a number: a bool counts 0/1, as torch promotes it."""
        return self.as_number(self.scalar(x))

    def as_number(self, v):
        if isinstance(v, bool):
            return int(v)
        if self.type_of(v) == "b":
            if v not in self.as_int:
                self.as_int[v] = self.emit(self.fresh(v), "int", v)
            return self.as_int[v]
        return v

    def boolean(self, x):
        v = self.scalar(x)
        if self.type_of(v) != "b":
            raise ValueError(f"{self.what}: a logical op on a number ({x})")
        return v

    # -------------------------------------------------------------------------- captured reads

    def index(self, view: _View, entries) -> _View | str:
        """view[entries]: each entry a 0-d index (or None, keeping that dim) for the next dims."""
        if len(entries) > len(view.remaining):
            raise ValueError(f"captured buffer {view.slot} indexed with {len(entries)} indices")
        indices, kept = dict(view.indices), []
        for dim, entry in zip(view.remaining, entries):
            if entry is None:
                kept.append(dim)
                continue
            i = self.scalar(entry)
            if self.type_of(i) != "i":
                kind = "bool" if self.type_of(i) == "b" else "float"
                raise ValueError(f"captured buffer {view.slot} indexed by a {kind}")
            indices[dim] = i
        return _View(view.slot, tuple(sorted(indices.items())), tuple(kept) + view.remaining[len(entries):])

    def load(self, name: str, view: _View) -> str:
        """The element of a fully indexed view: a load at its flat row-major index; a bool buffer's
        0/1 element compared with 0."""
        buf = self.buffers[view.slot]
        flat, terms = 0, []
        for dim, i in view.indices:
            # dim 0's size wraps nothing (see below) and no stride holds it
            size, stride = self.size(view.slot, dim, name) if dim > 0 else None, self.stride(view.slot, dim, name)
            if isinstance(i, int):
                if dim > 0 and isinstance(size, int) and not -size <= i < size:
                    raise ValueError(f"index {i} is out of range for dim {dim} of captured buffer {view.slot}")
                if dim > 0 and isinstance(size, int):
                    i %= size
                elif dim > 0 and i < 0:  # counted from the end of a symbolic size
                    i = self.emit(self.fresh(name), "add", i, size)
                if isinstance(i, int) and isinstance(stride, int):
                    flat += i * stride
                elif i != 0:
                    terms.append(i if stride == 1 else self.emit(self.fresh(name), "mul", i, stride))
                continue
            if dim > 0 and not self.is_nonneg(i):  # torch counts a negative index from the end of its dim
                neg = self.emit(self.fresh(name), "lt", i, 0)
                i = self.emit(self.fresh(name), "where", neg, self.emit(self.fresh(name), "add", i, size), i)
            terms.append(i if stride == 1 else self.emit(self.fresh(name), "mul", i, stride))
        # dim 0 needs no wrap: a negative first index makes the flat index negative, and the load
        # counts a negative index from the end of the flat tensor, which is the same element
        for term in terms:
            flat = term if flat == 0 else self.emit(self.fresh(name), "add", flat, term)
        tensor = sp.tensor_name(view.slot)
        if buf.dtype is torch.bool:
            return self.emit(name, "ne", self.emit(self.fresh(name), "load", tensor, flat), 0)
        return self.emit(name, "load", tensor, flat)

    def size(self, slot: int, dim: int, name: str) -> int | str:
        """Dim `dim` of a captured buffer: its int, or for a symbolic size a step made once per
        program: its integer operand's value, else the buffer's length divided by its other sizes."""
        shape = self.buffers[slot].shape
        if isinstance(shape[dim], int):
            return shape[dim]
        if isinstance(shape[dim], SizeOperand):
            return self.read(_View(shape[dim].slot))
        if slot not in self.symbolic:
            length = self.emit(self.fresh(name), "len", sp.tensor_name(slot))
            others = self.product([self.size(slot, d, name) for d in range(len(shape)) if d != dim], name)
            self.symbolic[slot] = length if others == 1 else self.emit(self.fresh(name), "floordiv", length, others)
        return self.symbolic[slot]

    def stride(self, slot: int, dim: int, name: str) -> int | str:
        """The row-major stride of dim `dim`: an int, or a step where a later size is symbolic."""
        return self.product([self.size(slot, d, name) for d in range(dim + 1, len(self.buffers[slot].shape))], name)

    def product(self, factors: list, name: str) -> int | str:
        """The product of ints and int steps: an int when all are ints, else a step."""
        result = math.prod(f for f in factors if isinstance(f, int))
        for f in factors:
            if not isinstance(f, int):
                result = f if result == 1 else self.emit(self.fresh(name), "mul", result, f)
        return result

    # ---------------------------------------------------------------------------- translation

    def program(self) -> str:
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                self.values[node] = self.node(node)
            elif node.op == "get_attr":  # a 0-d tensor constant (make_fx keeps those as attributes)
                const = getattr(self.gm, node.target, None)
                if isinstance(const, torch.Tensor) and const.dim() == 0 and const.device.type != "meta":
                    self.values[node] = self.typed(const.item(), const.dtype)
        out = self.scalar(output_value(self.gm))
        if self.mask:
            if out is True:
                return ""  # keeps every key, as no mask program does
            if out is False:
                out = self.emit("out", "ne", 0, 0)
        elif isinstance(out, (int, float)) and not isinstance(out, bool):
            out = self.emit("out", "mul", float(out), 1.0)
        want = "b" if self.mask else "f"
        if self.type_of(out) != want:
            raise ValueError(f"the {self.what} does not return a {'bool' if self.mask else 'float'}")
        if not self.steps or out != self.steps[-1][0]:
            self.emit("out", "and", out, out) if self.mask else self.emit("out", "mul", out, 1.0)
        return sp.canonical(sp.dumps(self.steps), self.dtypes, self.mask)

    def node(self, node: torch.fx.Node):
        target, args, kwargs = node.target, node.args, node.kwargs
        if target in _LOGICAL:
            return self.logical(node.name, _OPS[target], *(self.boolean(a) for a in args))
        if target in _WHERE:
            return self.where(node.name, *args)
        if target in _OPS:
            if kwargs.get("alpha", 1) != 1:
                raise ValueError(f"{target} with alpha")
            op, values = _OPS[target], [self.scalar(a) for a in args]
            if registry.OPS[op].typing in ("same", "int") and all(self.type_of(v) == "b" for v in values):
                # torch keeps bool op bool a bool: True + True is True, not 2
                if op not in _ON_BOOLS:
                    raise ValueError(f"{op} of bools")
                return self.logical(node.name, _ON_BOOLS[op], *values)
            return self.emit(node.name, op, *(self.as_number(v) for v in values))
        if target in _FLOOR_DIV:
            if kwargs.get("rounding_mode") != "floor":
                raise ValueError(f"a division with rounding_mode={kwargs.get('rounding_mode')!r}")
            return self.emit(node.name, "floordiv", *(self.number(a) for a in args))
        if target in _CASTS:
            dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
            return self.cast(node.name, self.scalar(args[0]), dtype)
        if target in _CONSTANTS:
            return self.constant(target, args, kwargs)
        if target in _IDENTITY:
            return self.value(args[0])
        if target is _aten.index.Tensor and isinstance(self.value(args[0]), _View):
            view = self.index(self.values[args[0]], args[1])
            return self.load(node.name, view) if not view.remaining else view
        if target is _aten.select.int and isinstance(self.value(args[0]), _View):
            view, (dim, i) = self.values[args[0]], args[1:]
            dims = len(view.remaining)
            if not isinstance(dim, int) or not isinstance(i, int) or not -dims <= dim < dims:
                raise ValueError(f"select({dim}, {i}) of captured buffer {view.slot}")
            view = self.index(view, [None] * (dim % dims) + [i])
            return self.load(node.name, view) if not view.remaining else view
        raise ValueError(f"{target} is not supported")

    def logical(self, name: str, op: str, *args):
        """and / or / not with Python bools folded: and_masks starts from a constant True."""
        if op == "not":
            (a,) = args
            return (not a) if isinstance(a, bool) else self.emit(name, "not", a)
        a, b = args
        absorbing, neutral = (False, True) if op == "and" else (True, False)
        if a is absorbing or b is absorbing:
            return absorbing
        if a is neutral:
            return b
        if b is neutral:
            return a
        return self.emit(name, op, a, b)

    def where(self, name: str, cond, a, b):
        c, a, b = self.boolean(cond), self.scalar(a), self.scalar(b)
        if self.type_of(a) == "b" and self.type_of(b) == "b":  # where on bools: (c & a) | (~c & b)
            keep = self.logical(self.fresh(name), "and", c, a)
            other = self.logical(self.fresh(name), "and", self.logical(self.fresh(name), "not", c), b)
            return self.logical(name, "or", keep, other)
        a, b = self.as_number(a), self.as_number(b)
        if isinstance(c, bool):  # the branch taken, as torch types the result
            picked = a if c else b
            if "f" in (self.type_of(a), self.type_of(b)) and self.type_of(picked) != "f":
                return float(picked) if isinstance(picked, int) else self.emit(name, "float", picked)
            return picked
        return self.emit(name, "where", c, a, b)

    def cast(self, name: str, x, dtype):
        """x.to(dtype): a device move changes nothing; ints and bools convert as torch converts them;
        floats stay fp32 in the kernel when cast to fp32 or (in a score_mod) to the query's dtype,
        the dtype the graph gives fp32 scores. Casts that round or narrow otherwise are refused."""
        t = self.type_of(x)
        if dtype is None:
            return x
        if dtype is torch.float32 or (dtype is self.score_dtype and not self.mask):
            if isinstance(x, (bool, int)):
                return float(x)
            return x if t == "f" else self.emit(name, "float", x)
        if dtype in (torch.int32, torch.int64):
            if isinstance(x, (bool, float)):
                return int(x)
            if t == "f" and dtype is torch.int64:
                raise ValueError("a float cast to int64 (the kernel's ints are int32)")
            return x if t == "i" else self.emit(name, "int", x)
        if dtype is torch.bool:
            if isinstance(x, (int, float)):
                return bool(x)
            return x if t == "b" else self.emit(name, "ne", x, 0)
        raise ValueError(f"a cast to {dtype}")

    def constant(self, target, args, kwargs):
        if target is _aten.scalar_tensor.default:
            shape, value = [], args[0]
        elif target is _aten.full.default:
            shape, value = args[0], args[1]
        else:
            shape, value = args[0], int(target is _aten.ones.default)
        if list(shape):
            raise ValueError(f"a constant of shape {list(shape)}")
        dtype = kwargs.get("dtype")
        if dtype is None:  # full infers the dtype from the value; the others make the default float32
            dtype = torch.float32 if target is not _aten.full.default or isinstance(value, float) else \
                torch.bool if isinstance(value, bool) else torch.int64
        return self.typed(value, dtype)

    def typed(self, value, dtype: torch.dtype):
        """A constant of `dtype` as a program value: a Python bool, a float or an int32 number."""
        if dtype is torch.bool:
            return bool(value)
        if dtype.is_floating_point:
            return float(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"the integer constant {value}")
        return self.value(int(value))
