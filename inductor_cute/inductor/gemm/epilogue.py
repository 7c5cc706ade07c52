"""Inductor pointwise nodes after a GEMM -> an epilogue program for our kernel.

The nodes' store functions run under a handler that records every op as a program step
(kernels/common/programs/epilogue.py); the registry's `handler` names say which handler methods
are program ops as they are. Anything the kernel cannot do raises NotImplementedError with the
reason, which turns the fusion down: Inductor then runs the pointwise nodes as a Triton kernel.

Index spaces: the GEMM output is (M, N) or (L, M, N), contiguous. An epilogue node may iterate
the same elements with M split into several dimensions (a Linear on (B, S, D) is an mm on
(B*S, D) viewed back as (B, S, N)); every index it uses must be affine in its loop variables and
is mapped back onto the GEMM's (rows, N) grid.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.ops_handler import DefaultHandler
from torch._inductor.utils import sympy_product
from torch._inductor.virtualized import V

from ...kernels.common.programs.epilogue import dumps
from ...kernels.common.programs.registry import handler_ops
from .runtime import input_role

_HANDLED = handler_ops()  # ops-handler method -> epilogue op (relu, square, casts... have methods below)
_FLOATS = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Operand:
    """An extra input of the fused kernel: buffer `name` seen as the GEMM output's shape with
    `strides` (one per GEMM output dimension) from `offset`."""

    name: str
    strides: tuple  # ints or expressions of dynamic sizes
    offset: object
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


def _ints(exprs) -> tuple[int, ...]:
    out = []
    for e in exprs:
        e = sympy.sympify(e)
        if not e.is_Integer:
            raise NotImplementedError(f"symbolic stride or offset {e}")
        out.append(int(e))
    return tuple(out)


def _row_major_strides(sizes) -> list:
    strides, step = [], sympy.S.One
    for size in reversed(list(sizes)):
        strides.append(step)
        step = step * size
    return strides[::-1]


class _Space:
    """The loop variables of one epilogue node and how they map onto the GEMM output."""

    def __init__(self, node_sizes, gemm_sizes):
        sizevars = V.graph.sizevars
        self.sizes = list(node_sizes)
        gemm_sizes = list(gemm_sizes)
        if not sizevars.statically_known_equals(self.sizes[-1], gemm_sizes[-1]) or \
                not sizevars.statically_known_equals(sympy_product(self.sizes), sympy_product(gemm_sizes)):
            raise NotImplementedError("the epilogue iterates other elements than the GEMM output")
        # leading node dims that make up the GEMM's leading dims (batch L, when the GEMM has one)
        self.lead = 0
        if len(gemm_sizes) == 3:
            if len(self.sizes) < 3 or not sizevars.statically_known_equals(self.sizes[0], gemm_sizes[0]):
                raise NotImplementedError("the epilogue regroups the GEMM's batch")
            self.lead = 1
        self.flat = None  # set per node: the row-major flat index of its loop variables

    def gemm_strides(self, index, vars_) -> tuple[tuple, object]:
        """(strides over the GEMM output's dims, offset) of an affine index, or raise. Strides
        and offset may be expressions of dynamic sizes; the N stride must be 0 or 1."""
        sizevars = V.graph.sizevars
        strides = [sympy.expand(s) for s in sizevars.stride_vars(index, vars_)]
        offset = sympy.expand(sizevars.offset_var(index, vars_))
        if sympy.expand(index - offset - sum(s * v for s, v in zip(strides, vars_))) != 0:
            raise NotImplementedError(f"index {index} is not affine in the loop variables")
        if strides[-1] not in (0, 1) or any(sizevars.optimization_hint(s) < 0 for s in (*strides, offset)):
            raise NotImplementedError(f"strides {strides} (need a non-negative layout, unit along N)")
        # the node dims between the batch and N form the GEMM's M: they must merge into one
        m_dims = list(range(self.lead, len(self.sizes) - 1))
        for hi, lo in zip(m_dims, m_dims[1:]):
            if not sizevars.statically_known_equals(strides[hi], strides[lo] * self.sizes[lo]) and \
                    not (strides[hi] == 0 and strides[lo] == 0):
                raise NotImplementedError("an input's rows do not follow the GEMM's row order")
        m_stride = strides[m_dims[-1]] if m_dims else sympy.S.Zero
        return (*strides[:self.lead], m_stride, strides[-1]), offset


class _Recorder(DefaultHandler):
    """Ops handler that turns pointwise bodies into program steps."""

    def __init__(self, epi: Epilogue, gemm, gemm_value: str):
        self.epi = epi
        self.gemm = gemm
        self.values = {gemm.get_name(): gemm_value}  # buffer -> program value
        self.narrowed = {}  # value rounded to a 16-bit float -> that dtype: only a store may use it
        self.space = None
        self.vars = None
        self.counter = itertools.count()

    def step(self, op, *args):
        if any(a in self.narrowed for a in args):
            raise NotImplementedError("arithmetic on a value rounded to 16 bits")
        name = f"v{next(self.counter)}"
        self.epi.steps.append([name, op, *args])
        return name

    def _default(self, name, args, kwargs):
        if name in _HANDLED and not kwargs:
            op = _HANDLED[name]
            values = args[1:] if op == "where" else args
            if all(isinstance(a, float) for a in values):
                raise NotImplementedError(f"{name} of constants only")
            return self.step(op, *args)
        raise NotImplementedError(f"op {name} has no CuTe epilogue form")

    # ---- ops with their own meaning
    def constant(self, value, dtype):
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise NotImplementedError("non-finite constant")
        return value

    def relu(self, x):
        return self.step("maximum", x, 0.0)  # propagates NaN, as torch.relu does

    def square(self, x):
        return self.step("mul", x, x)

    def to_dtype(self, x, dtype, src_dtype=None, use_compute_types=True):
        if isinstance(x, float):
            return x
        if x in self.narrowed:
            if dtype == self.narrowed[x] and use_compute_types:
                return x  # the rounded value seen in its compute type (emulated casts): still rounded
            raise NotImplementedError("a value rounded to 16 bits is used again")
        if dtype in _FLOATS:
            return x
        if dtype in (torch.float16, torch.bfloat16) and use_compute_types and \
                inductor_config.triton.codegen_upcast_to_fp32:
            # Inductor's Triton code keeps 16-bit values in fp32 between ops (`x.to(tl.float32)`):
            # an fp16/bf16 op inside a pointwise body (silu, gelu, mul in bf16) rounds nothing
            # until the store. The fused kernel does the same; it rounds once, when it stores.
            return x
        if dtype in (torch.float16, torch.bfloat16):
            narrowed = self.step("mul", x, 1.0)  # the kernel rounds once, when it stores
            self.narrowed[narrowed] = dtype
            return narrowed
        raise NotImplementedError(f"cast to {dtype}")

    def load(self, name, index):
        if name == self.gemm.get_name():
            if sympy.expand(index - self.space.flat) != 0:
                raise NotImplementedError("the GEMM output is read with another indexing")
            return self.values[name]
        if name in self.values:
            return self.values[name]
        return self._operand(name, index)

    def _operand(self, name, index):
        strides, offset = self.space.gemm_strides(index, self.vars)
        gemm_sizes = V.graph.sizevars.optimization_hints(self.gemm.get_size())
        hint = V.graph.sizevars.optimization_hint
        buf = V.graph.get_buffer(name) or V.graph.graph_inputs.get(name)
        if buf is not None:  # every element the kernel will read must lie inside the buffer
            last = hint(offset) + sum((size - 1) * hint(s) for size, s in zip(gemm_sizes, strides))
            if last >= hint(sympy_product(buf.get_size())) + hint(buf.get_layout().offset):
                raise NotImplementedError(f"input {name} would be read out of bounds")
        if all(s == 0 for s in strides[:-1]) and strides[-1] == 1:
            slot = "row"
        elif strides[-1] == 1 and hint(strides[-2]) != 0:
            slot = "full"
        else:
            raise NotImplementedError(f"input {name} is not a row or a full tensor (strides {strides})")
        operand = Operand(name, strides, offset, V.graph.get_dtype(name))
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
        if value in self.narrowed and self.narrowed.pop(value) != V.graph.get_dtype(name):
            raise NotImplementedError("a value rounded to 16 bits is stored in another dtype")
        if not self.epi.steps or self.epi.steps[-1][0] != value:
            value = self.step("mul", value, 1.0)  # the kernel stores the program's last step
        self.values[name] = value
        self.epi.written.append(name)

    # everything that would need indices, masks or randomness stays out
    def index_expr(self, *args, **kwargs):
        raise NotImplementedError("index_expr")

    def indirect_indexing(self, *args, **kwargs):
        raise NotImplementedError("indirect indexing")

    def masked(self, *args, **kwargs):
        raise NotImplementedError("masked")


def _base_steps(epi: Epilogue, template) -> str:
    """Steps for the GEMM's own result: alpha * acc (+ beta * its addmm/baddbmm input)."""
    value = "acc"
    if template.alpha != 1.0:
        epi.steps.append(["g0", "mul", value, template.alpha])
        value = "g0"
    if template.op not in ("addmm", "baddbmm"):
        return value
    inp = template.inputs[0]
    out_sizes = V.graph.sizevars.optimization_hints(template.get_size())
    sizes = list(V.graph.sizevars.optimization_hints(inp.get_size()))
    strides = list(_ints(inp.get_layout().stride))
    pad = len(out_sizes) - len(sizes)
    sizes, strides = [1] * pad + sizes, [0] * pad + strides  # broadcast leading dims
    strides = [0 if size == 1 else s for size, s in zip(sizes, strides)]
    role = input_role(sizes, strides, out_sizes[-1], template.beta)
    if role is None:
        return value
    operand_strides = tuple(strides) if role == "full" else (0,) * (len(out_sizes) - 1) + (1,)
    if role == "full" and (sizes != list(out_sizes) or strides[-1] != 1 or min(strides) < 0):
        raise NotImplementedError("the addmm input broadcasts in a way the kernel cannot read")
    operand = Operand(inp.get_name(), operand_strides, _ints([inp.get_layout().offset])[0], inp.get_dtype())
    setattr(epi, role, operand)
    if role == "row":
        epi.steps.append(["g1", "add", value, "row"])
        return "g1"
    epi.steps.append(["g1", "mul", "full", template.beta])
    epi.steps.append(["g2", "add", value, "g1"])
    return "g2"


def translate(template, nodes) -> Epilogue:
    """The epilogue program of `template` followed by the scheduler `nodes` (in order)."""
    layout = template.get_layout()
    if list(layout.stride) != _row_major_strides(layout.size):
        raise NotImplementedError("the GEMM output is not contiguous")
    epi = Epilogue()
    recorder = _Recorder(epi, template, _base_steps(epi, template))
    with V.set_ops_handler(recorder):
        for snode in nodes:
            node = snode.node
            if not isinstance(node, ir.ComputedBuffer) or not isinstance(node.data, ir.Pointwise):
                raise NotImplementedError(f"{snode.get_name()} is not a pointwise node")
            recorder.space = _Space(node.get_size(), template.get_size())
            recorder.vars = node.data._index(node.data.ranges)
            recorder.space.flat = sum(v * s for v, s in zip(recorder.vars, _row_major_strides(node.get_size())))
            out_layout = node.get_layout()
            if list(out_layout.stride) != _row_major_strides(out_layout.size):
                raise NotImplementedError(f"{node.get_name()} is not stored row-major")
            node.get_store_function()(recorder.vars)
    if not epi.written:
        raise NotImplementedError("no epilogue output")
    epi.out = V.graph.get_buffer(epi.written[-1])
    out_dtype = epi.out.get_dtype()
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NotImplementedError(f"output dtype {out_dtype}")
    for operand in (epi.row, epi.full):
        if operand is not None and operand.dtype != out_dtype:
            raise NotImplementedError(f"input {operand.name} is {operand.dtype}, the output {out_dtype}")
    return epi
