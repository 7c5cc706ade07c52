"""Inductor pointwise nodes after a GEMM -> an epilogue program for our kernel.

The nodes' store functions run under a handler that records every op as a program step
(kernels/epilogue_program.py). Anything the kernel cannot do raises NotImplementedError with the
reason, which turns the fusion down: Inductor then runs the pointwise nodes as a Triton kernel.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import sympy
import torch
from torch._inductor import ir
from torch._inductor.ops_handler import DefaultHandler
from torch._inductor.virtualized import V

from ..kernels.epilogue_program import ARITY, dumps

_OPS_AS_IS = set(ARITY)


@dataclass
class Operand:
    """An extra input of the fused kernel: buffer `name` read with `strides` from `offset`."""

    name: str
    strides: tuple[int, ...]  # along (batch,) M, N of the output
    offset: int
    dtype: torch.dtype


@dataclass
class Epilogue:
    steps: list = field(default_factory=list)
    row: Operand | None = None  # the kernel's bias operand
    full: Operand | None = None  # the kernel's C operand
    out: ir.Buffer | None = None  # the last buffer written: the fused kernel's output
    written: list = field(default_factory=list)  # every buffer the nodes store, in order

    @property
    def program(self) -> str:
        return dumps(self.steps)


def _static_ints(exprs) -> tuple[int, ...]:
    out = []
    for e in exprs:
        e = sympy.sympify(e)
        if not e.is_Integer:
            raise NotImplementedError(f"symbolic stride or offset {e}")
        out.append(int(e))
    return tuple(out)


def _row_major(size, stride) -> bool:
    expected = 1
    for sz, st in zip(reversed(list(size)), reversed(list(stride))):
        if sz != 1 and not V.graph.sizevars.statically_known_equals(st, expected):
            return False
        expected = expected * sz
    return True


class _Recorder(DefaultHandler):
    """Ops handler that turns a pointwise body into program steps."""

    def __init__(self, epi: Epilogue, gemm_name: str, gemm_value: str):
        self.epi = epi
        self.values = {gemm_name: gemm_value}  # buffer -> program value
        self.gemm_name = gemm_name
        self.index_vars = None
        self.counter = itertools.count()

    def step(self, op, *args):
        name = f"v{next(self.counter)}"
        self.epi.steps.append([name, op, *args])
        return name

    def _default(self, name, args, kwargs):
        if name in _OPS_AS_IS:
            if kwargs:
                raise NotImplementedError(f"op {name} with keyword arguments")
            if all(isinstance(a, float) for a in args) or (name == "where" and all(isinstance(a, float) for a in args[1:])):
                raise NotImplementedError(f"{name} of constants only")
            return self.step(name, *args)
        raise NotImplementedError(f"op {name} has no CuTe epilogue form")

    # ---- ops with their own meaning
    def constant(self, value, dtype):
        if not dtype.is_floating_point and dtype != torch.bool and not isinstance(value, (int, float)):
            raise NotImplementedError(f"constant of {dtype}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise NotImplementedError("non-finite constant")
        return value

    def to_dtype(self, x, dtype, src_dtype=None, use_compute_types=True):
        # values are fp32 in the kernel; a cast to a float type only rounds (kept exact here)
        if not dtype.is_floating_point:
            raise NotImplementedError(f"cast to {dtype}")
        return x

    def square(self, x):
        return self.step("mul", x, x)

    def sigmoid(self, x):
        return self.step("sigmoid", x)

    def load(self, name, index):
        if name in self.values:
            if name == self.gemm_name:
                expected = V.graph.get_buffer(name).get_layout().make_indexer()(self.index_vars)
                if sympy.simplify(index - expected) != 0:
                    raise NotImplementedError("the GEMM output is read with another indexing")
            return self.values[name]
        return self._operand(name, index)

    def _operand(self, name, index):
        strides = _static_ints(V.graph.sizevars.stride_vars(index, self.index_vars))
        offset = _static_ints([V.graph.sizevars.offset_var(index, self.index_vars)])[0]
        operand = Operand(name, strides, offset, V.graph.get_dtype(name))
        slot = "row" if all(s == 0 for s in strides[:-1]) and strides[-1] == 1 else "full"
        if slot == "full" and strides[-1] != 1:
            raise NotImplementedError(f"input {name} is not contiguous along N (strides {strides})")
        current = getattr(self.epi, slot)
        if current is not None and current != operand:
            raise NotImplementedError(f"more than one {slot} operand")
        setattr(self.epi, slot, operand)
        return slot

    def store(self, name, index, value, mode=None):
        if mode is not None:
            raise NotImplementedError(f"store mode {mode}")
        if isinstance(value, float):
            raise NotImplementedError("a constant output")
        self.values[name] = value
        self.epi.written.append(name)

    # everything that would need indices, masks or randomness stays out
    def index_expr(self, *args, **kwargs):
        raise NotImplementedError("index_expr")

    def indirect_indexing(self, *args, **kwargs):
        raise NotImplementedError("indirect indexing")

    def masked(self, *args, **kwargs):
        raise NotImplementedError("masked")


def base_steps(epi: Epilogue, template) -> str:
    """Steps for the GEMM's own result: alpha * acc (+ beta * its addmm/baddbmm input)."""
    value = "acc"
    if template.alpha != 1.0:
        epi.steps.append(["g0", "mul", value, float(template.alpha)])
        value = "g0"
    if template.op in ("addmm", "baddbmm"):
        inp = template.inputs[0]
        layout = inp.get_layout()
        size = V.graph.sizevars.optimization_hints(layout.size)
        strides = _static_ints(layout.stride)
        n = len(template.get_size())
        strides = (0,) * (n - len(strides)) + strides  # broadcast leading dims
        row = strides[-1] == 1 and all(s == 0 or sz == 1 for s, sz in zip(strides[:-1], size[:-1]))
        operand = Operand(inp.get_name(), strides if not row else (0,) * (n - 1) + (1,),
                          _static_ints([layout.offset])[0], inp.get_dtype())
        if row and template.beta == 1.0:
            epi.row = operand
            epi.steps.append(["g1", "add", value, "row"])
        else:
            if strides[-1] != 1:
                raise NotImplementedError("addmm input not contiguous along N")
            epi.full = operand
            epi.steps.append(["g1", "mul", "full", float(template.beta)])
            epi.steps.append(["g2", "add", value, "g1"])
            value = "g2"
            return value
        value = "g1"
    return value


def translate(template, nodes) -> Epilogue:
    """The epilogue program of `template` followed by the scheduler `nodes` (in order)."""
    epi = Epilogue()
    gemm_value = base_steps(epi, template)
    recorder = _Recorder(epi, template.get_name(), gemm_value)
    size = list(template.get_size())
    with V.set_ops_handler(recorder):
        for snode in nodes:
            node = snode.node
            if not isinstance(node, ir.ComputedBuffer) or not isinstance(node.data, ir.Pointwise):
                raise NotImplementedError(f"{snode.get_name()} is not a pointwise node")
            if not V.graph.sizevars.statically_known_list_equals(node.get_size(), size):
                raise NotImplementedError("epilogue iterates another shape than the GEMM output")
            recorder.index_vars = node.data._index(node.data.ranges)
            node.get_store_function()(recorder.index_vars)
    if not epi.written:
        raise NotImplementedError("no epilogue output")
    epi.out = V.graph.get_buffer(epi.written[-1])
    layout = epi.out.get_layout()
    if not _row_major(layout.size, layout.stride):
        raise NotImplementedError("the epilogue output is not row-major")
    out_dtype = epi.out.get_dtype()
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"output dtype {out_dtype}")
    for operand in (epi.row, epi.full):
        if operand is not None and operand.dtype != out_dtype:
            raise NotImplementedError(f"input {operand.name} is {operand.dtype}, the output {out_dtype}")
    return epi
