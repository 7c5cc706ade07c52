"""The flex_attention higher-order op under torch.compile: decoding-shaped calls whose score_mod and
mask_mod we can translate into score / mask programs (kernels/common/programs/score.py), with or
without a BlockMask our kernel can walk, run our split-KV kernel (`ops.flex_decode`); with
enable(flex_prefill=True), inference calls with longer queries run our prefill kernel
(host.flex_prefill) on the same terms; with enable(flex_backward=True), training graphs' calls run
them too when our backward (backward.py) can take the call as well; everything else goes to the
stock lowering, unchanged.

inductor/install.py wraps `torch._inductor.lowering.lowerings[flex_attention]`. A call we accept is
the custom op `torch.ops.inductor_cute.flex_decode` in the graph (its schema gives the outputs'
layouts); output code calls a launcher of runtime.py defined for the call site in its header
(plain values: a graph served from the FX cache works in a fresh process).

The decision is `decline_reason(FlexProblem)`: plain values, so it is testable without a graph.
The query length picks the kernel (`FlexProblem.kernel`); the checks common to both run once, then
that kernel's own limits (head dims, dtypes, block sizes) and the settings that offer it. A
training call is decided once for both of its graphs: the forward's lowering and the backward's
(backward.py) each ask decline_reason, whose training checks (`_training_reason`, and a score_mod
our backward can differentiate) cover the backward kernel's limits too, so both run our kernels or
both the stock ones. (A score_mod whose captured tensor needs a gradient is seen by the backward's
lowering alone: it takes the stock backward, which reads our forward's out and lse as its own.)
The mods' graphs are translated by translate.py; their captured buffers (of any rank, bool and
int64 included) and integer operands reach the kernel flattened and converted by `kernel_buffers`.
Torch-version differences are confined to `_block_mask_fields` and `_backward_lists`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

from ...kernels.common.units import LOG2E
from . import prefill as _prefill  # noqa: F401 (registers torch.ops.inductor_cute.flex_prefill)
from . import runtime as _runtime
from .translate import (Captured, describe, is_full, is_identity_score_mod,  # noqa: F401 (re-exported)
                        is_noop_mask_mod, mask_program, score_program, SizeOperand)

log = logging.getLogger(__name__)

_HOP = torch.ops.higher_order.flex_attention
_MAX_GRID_Z = 65535  # ops.flex_decode's limit on batch x KV heads (one CTA row per pair)
_WHOLE_SEQUENCE_BLOCK = 1 << 30  # flex_attention's block size for "no block mask": one block spans any length
# Kernel options that change nothing we compute: Triton performance hints and backward switches.
_NEUTRAL_OPTIONS = frozenset({"PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ",
                              "OUTPUT_LOGSUMEXP"})


# ---------------------------------------------------------------------------- the custom op

# Defined on a plain Library rather than with torch.library.custom_op: a call then costs one Python
# kernel behind the C++ dispatcher, not custom_op's Python autograd, redispatch and aliasing checks
# (about half its host cost per call, measured by benchmarks/flex_host_overhead.py). Same name and
# schema as before: output code in Inductor's FX cache calls it unchanged.
SCHEMA = ("flex_decode(Tensor q, Tensor k, Tensor v, float scale, str score_mod, Tensor[] score_tensors, "
          "str mask_mod, Tensor[] mask_tensors, Tensor? kv_num_blocks, Tensor? kv_indices, "
          "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, SymInt kv_block_size, SymInt q_block_size) "
          "-> (Tensor, Tensor)")
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def flex_decode_op(q, k, v, scale: float, score_mod: str, score_tensors: list, mask_mod: str, mask_tensors: list,
                   kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size: int,
                   q_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.flex_decode for compiled graphs: (out, lse), lse in natural-log units; score_mod and
    mask_mod are programs' texts, "" for none; the block-mask tensors are None without one. Runs
    through runtime.py's launchers: checked once per layout, then a remembered launch."""
    return _runtime.flex_decode(q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks,
                                kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size)


def register_kernel(device_type: str, fn) -> None:
    """Run `fn` (flex_decode_op's signature) for the op's calls on `device_type` ("cpu" for tests)."""
    _LIBRARY.impl("flex_decode", fn, torch._C._dispatch_key_for_device(device_type))


register_kernel("cuda", flex_decode_op)


@torch.library.register_fake("inductor_cute::flex_decode", lib=_LIBRARY)
def _flex_decode_fake(q, k, v, scale, *programs_and_block_mask):
    batch, heads, q_len, _ = q.shape
    return q.new_empty(batch, heads, q_len, v.shape[-1]), q.new_empty(batch, heads, q_len, dtype=torch.float32)


def _streamable(t: torch.Tensor) -> torch.Tensor:
    """k or v as the kernel streams them (unit last stride, other strides multiples of 8
    elements, 16-byte aligned start); ops.flex_decode refuses to copy the KV cache, but a graph
    may hand us a view that does not fit (e.g. a slice of the head dim), so copy it here."""
    fits = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st > 0 and st % 8 == 0 for sz, st in zip(t.shape[:-1], t.stride()[:-1]) if sz > 1))
    return t if fits else t.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------- the decision

@dataclasses.dataclass(frozen=True)
class FlexProblem:
    """One flex_attention call as the decision sees it. Sizes are ints, None where symbolic."""

    device: torch.device
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # q, k, v
    heads: int | None
    kv_heads: int | None
    q_len: int | None
    head_dim_qk: int | None
    head_dim_v: int | None
    operands_match: bool  # k and v agree with q on batch and head dim, with each other on heads and length
    score_graph: torch.fx.GraphModule
    score_buffers: tuple[Captured, ...]  # the score_mod's captured buffers (translate.py)
    mask_graph: torch.fx.GraphModule
    mask_buffers: tuple[Captured, ...]  # the mask_mod's
    keys_all_in_blocks: bool  # the block-sparse tensors visit every key (no block mask was given)
    block_sizes: tuple  # the block mask's (KV, Q) block sizes
    mask_heads: int | None  # the block mask's head dim (1: broadcast)
    block_tensors_ok: bool  # the block-mask tensors are int32 and on q's device
    scale: Any
    kernel_options: dict
    inference: bool
    size_guards: tuple = ()  # (a, b) dynamic sizes equal at the hints, not provably: guarded when taken
    q_len_hint: int | None = None  # the query length at its size hint (a symbolic q_len's)
    flex_decode: bool = True  # enable()'s settings for this compile: the kernels of ours on offer
    flex_prefill: bool = False
    kv_batch_broadcast: bool = False  # k and v of batch 1 for every query batch (a shared, paged cache)
    flex_backward: bool = False  # training graphs may run our kernels (enable(flex_backward=True))
    backward_lists_ok: bool = True  # the block mask's backward lists (q_num_blocks, q_indices) are there, int32

    @property
    def kernel(self) -> str:
        """"prefill" for a query longer than the decode kernel takes (at the size hint when
        symbolic: taking it guards that), else "decode"."""
        from ...kernels.attention.flex_decode_config import MAX_Q_LEN

        q_len = self.q_len if self.q_len is not None else self.q_len_hint
        return "prefill" if q_len is not None and q_len > MAX_Q_LEN else "decode"

    @functools.cached_property
    def translated(self) -> tuple[tuple[str, str] | None, str | None]:
        """((score program, mask program), None), or (None, why a mod cannot be translated). Each
        graph is translated once per call: the decision and the lowering read this."""
        try:
            score = score_program(self.score_graph, self.score_buffers, self.dtypes[0])
        except ValueError as e:
            return None, f"a score_mod we cannot translate: {e}"
        try:
            mask = mask_program(self.mask_graph, self.mask_buffers)
        except ValueError as e:
            return None, f"a mask_mod we cannot translate: {e}"
        return (score, mask), None


def decline_reason(p: FlexProblem) -> str | None:
    """Why neither of our kernels takes this call (the stock lowering does); None if `p.kernel` does."""
    problem = _device_reason(p.device)
    if problem:
        return problem
    if len(set(p.dtypes)) != 1:
        return f"q, k and v dtypes differ: {p.dtypes}"
    if None in (p.heads, p.kv_heads, p.head_dim_qk, p.head_dim_v) or (p.q_len is None and p.kernel == "decode"):
        return "heads, query length or head dims are symbolic"
    if not p.operands_match:
        return "k and v do not match q (batch, head dims) or each other"
    if p.kv_heads == 0 or p.heads % p.kv_heads:
        return f"{p.heads} query heads are not a multiple of {p.kv_heads} KV heads"
    if not p.inference:
        problem = _training_reason(p)
        if problem:
            return problem
    problem = _kernel_reason(p)
    if problem:
        return problem
    if not isinstance(p.scale, (int, float)):
        return f"scale is not a constant ({p.scale!r})"
    if not p.keys_all_in_blocks:
        problem = _block_mask_reason(p)
        if problem:
            return problem
    programs, problem = p.translated
    if problem:
        return problem
    if not p.inference and programs[0]:
        # our backward differentiates the score program itself (programs/score_grad.py)
        from ...kernels.common.programs.score_grad import derivative_error

        dtypes = tuple(str(c.kernel_dtype).removeprefix("torch.") for c in p.score_buffers)
        problem = derivative_error(programs[0], dtypes)
        if problem:
            return f"a score_mod our backward cannot differentiate: {problem}"
        if p.kernel_options.get("PRESCALE_QK"):
            # the stock backward (taken for a captured tensor that needs a gradient, which only its
            # lowering sees) would apply the score_mod to prescaled scores, unlike our forward
            return "kernel_options PRESCALE_QK with a score_mod in a training graph"
    return _options_reason(p.kernel_options)


def _training_reason(p: FlexProblem) -> str | None:
    """Why a training graph's call cannot run our forward and our backward both. The forward's and
    the backward's lowerings (backward.py) each ask decline_reason about the same call, so they
    agree: both graphs run our kernels, or both the stock ones (whose lse the other side reads)."""
    from ...host.common import DTYPE_NAMES
    from ...kernels.attention import flex_backward_config as fbc

    if not p.flex_backward:
        return "a training graph (our backward is opt-in: enable(flex_backward=True))"
    problem = fbc.unsupported_reason(p.head_dim_qk, p.head_dim_v, DTYPE_NAMES.get(p.dtypes[0], str(p.dtypes[0])))
    if problem:
        return f"backward: {problem}"
    if (p.head_dim_qk, p.head_dim_v) in fbc.GPU_UNCHECKED_HEAD_DIMS:
        return f"backward: head dims {p.head_dim_qk}/{p.head_dim_v} are not yet checked on a GPU"
    if not p.keys_all_in_blocks:
        kv_block_size, q_block_size = p.block_sizes
        if not (isinstance(kv_block_size, int) and isinstance(q_block_size, int)):
            return f"block mask block sizes {p.block_sizes} are not constants"
        problem = fbc.block_mask_reason(kv_block_size, q_block_size, len(p.mask_buffers))  # finer: walked
        if problem:
            return f"backward block mask: {problem}"
        if not p.backward_lists_ok:
            return "a block mask without int32 backward lists (q_num_blocks, q_indices) on the query's device"
    return None


def _kernel_reason(p: FlexProblem) -> str | None:
    """Why the kernel for this query length is not on offer or cannot take these sizes."""
    from ...host.common import DTYPE_NAMES
    from ...kernels.attention import flex_decode_config as fdc
    from ...kernels.attention import flex_prefill_config as fpc

    dtype = DTYPE_NAMES.get(p.dtypes[0], str(p.dtypes[0]))
    q_len = p.q_len if p.q_len is not None else p.q_len_hint
    if p.kernel == "prefill":
        if not p.flex_prefill:
            return f"query length {q_len} is outside the decode kernel's range 1..{fdc.MAX_Q_LEN} (our prefill " \
                   "kernel is opt-in: enable(flex_prefill=True))"
        return fpc.unsupported_reason(p.head_dim_qk, p.head_dim_v, dtype)
    if not p.flex_decode:
        return "flex_decode is off (enable(flex_decode=True) offers our decode kernel)"
    return fdc.unsupported_reason(p.head_dim_qk, p.head_dim_v, dtype, p.heads // p.kv_heads, q_len)


def _block_mask_reason(p: FlexProblem) -> str | None:
    """Why our kernel cannot walk this BlockMask (the kernel's sparse_block_reason says what it needs)."""
    from ...kernels.attention import flex_decode_config as fdc
    from ...kernels.attention import flex_prefill_config as fpc

    kv_block_size, q_block_size = p.block_sizes
    if not (isinstance(kv_block_size, int) and isinstance(q_block_size, int)):
        return f"block mask block sizes {p.block_sizes} are not constants"
    if p.mask_heads is None:
        return "the block mask's head dim is symbolic"
    if not p.block_tensors_ok:
        return "block-mask tensors that are not int32 on the query's device"
    if p.mask_heads not in (1, p.heads):
        return f"a block mask of {p.mask_heads} heads for {p.heads} query heads"
    if p.kernel == "prefill":  # one CTA per query head: any mask heads, any GQA ratio
        problem = fpc.block_mask_reason(kv_block_size, q_block_size, fpc.HEAD_DIMS[(p.head_dim_qk, p.head_dim_v)],
                                        len(p.mask_buffers))
        return f"block mask: {problem}" if problem else None
    kv_block = fdc.kv_block_for(p.head_dim_qk, p.head_dim_v, kv_block_size)
    problem = fdc.sparse_block_reason(kv_block_size, kv_block, q_block_size, p.q_len)
    return f"block mask: {problem}" if problem else None


def _device_reason(device: torch.device) -> str | None:
    from ...errors import UnsupportedError
    from ...runtime import device_arch

    if device.type != "cuda":
        return f"device {device}"
    try:
        device_arch(device)
    except UnsupportedError as e:
        return str(e)
    return None


def _options_reason(options: dict) -> str | None:
    if options.get("BACKEND", "AUTO") != "AUTO":
        return f"kernel_options BACKEND={options['BACKEND']!r} asks for a stock kernel"
    if options.get("OUTPUT_MAX"):
        return "max_scores requested (our kernel does not keep the row max)"
    if options.get("FORCE_USE_FLEX_ATTENTION"):
        return "kernel_options FORCE_USE_FLEX_ATTENTION asks for the stock kernel"
    other = sorted(set(options) - _NEUTRAL_OPTIONS - {"BACKEND", "OUTPUT_MAX", "FORCE_USE_FLEX_ATTENTION"})
    if other:
        return f"kernel_options {other} tune the stock kernels"
    return None


def _block_mask_fields(block_mask: tuple) -> tuple:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, Q block size, KV block
    size, mask graph) of the HOP's block-mask tuple (BlockMask.as_tuple()). It has 13 entries in
    torch 2.11 and 17 in 2.13 (backward-only orderings were added in the middle); the fields we
    read sit at the same places from either end."""
    return (*block_mask[2:6], *block_mask[-3:])


def _backward_lists(block_mask: tuple) -> tuple:
    """(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) of the block-mask tuple: right
    after the forward lists in torch 2.11 and 2.13 alike."""
    return tuple(block_mask[6:10])


# where each flex HOP takes its block-mask tuple: the forward's and the backward's calls
_BLOCK_MASK_ARG = {_HOP: 4, torch.ops.higher_order.flex_attention_backward: 9}


def _keys_all_in_blocks(node: torch.fx.Node, kv_len) -> bool:
    """Whether the block-sparse tensors visit every key: true for the mask flex_attention builds
    when given none (one partial block at index 0, spanning the whole sequence, no full blocks),
    recognised from the FX nodes that build it. A BlockMask passed in is data we cannot see.

    A training graph's backward receives those tensors as inputs saved by the forward, not the
    nodes that build them: there (and, to agree, in the training forward too) the mask is also
    recognised by what both graphs see, whole-sequence block sizes and one block per row. Only a
    BlockMask built by hand with 2**30-key blocks, no full blocks and lists other than [0] would
    look the same to the backward and not to the forward."""
    arg = _BLOCK_MASK_ARG.get(node.target)
    if arg is None or len(node.args) <= arg:
        return False
    num_blocks, indices, full_num_blocks, _, q_block, block, _ = _block_mask_fields(node.args[arg])
    visible = (full_num_blocks is None and isinstance(block, int) and isinstance(q_block, int)
               and min(block, q_block) >= _WHOLE_SEQUENCE_BLOCK
               and _fake_shape(num_blocks) == (1, 1, 1) and _fake_shape(indices) == (1, 1, 1, 1))
    if node.target is not _HOP:
        return visible
    spans = isinstance(block, int) and (block >= _WHOLE_SEQUENCE_BLOCK
                                        or V.graph.sizevars.statically_known_leq(kv_len, block))
    built = full_num_blocks is None and is_full(num_blocks, 1) and is_full(indices, 0) and spans
    return built and (V.graph.is_inference or visible)


def _fake_shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _static(expr) -> int | None:
    try:
        return int(expr)
    except TypeError:  # a symbolic size
        return None


def _captured_buffers(buffers, device) -> tuple[Captured, ...]:
    """How the kernel reads a mod's captured buffers (`_captured`): a tensor's first symbolic size
    from its length, each later one from the integer operand that holds it (Dynamo lifts captured
    tensors' sizes into the mod; translate.SizeOperand)."""
    operands = {}
    for slot, buf in enumerate(buffers):
        if isinstance(buf, sympy.Expr) and not buf.is_number:
            operands.setdefault(buf, SizeOperand(slot))
    return tuple(_captured(buf, device, operands) for buf in buffers)


def _captured(buf, device, size_operands: dict) -> Captured:
    """How the kernel reads a captured buffer (translate.py): a tensor on `device`, or an integer
    operand (a SymInt, under dynamic shapes), which the lowering hands over as a 1-element tensor.
    `size_operands`: symbolic size -> the SizeOperand that holds it."""
    if isinstance(buf, ir.IRNode):
        shape = [_static(size) for size in buf.get_size()]
        symbolic = [dim for dim, s in enumerate(shape) if s is None]
        for dim in symbolic[1:]:  # the first is read from the buffer's length: no load
            shape[dim] = size_operands.get(buf.get_size()[dim])
        return describe(buf.get_dtype(), shape, buf.get_device() == device)
    if isinstance(buf, (int, sympy.Expr)) and not isinstance(buf, bool) and sympy.sympify(buf).is_integer:
        return describe(torch.int64, ())
    return Captured(problem=f"is not a tensor or an integer ({type(buf).__name__})")


def _block_size(size):
    """A BlockMask block size as an int: under dynamic=True it arrives as a symbol, which the stock
    lowerings specialise with guard_int too (the same guard, whoever takes the call)."""
    if isinstance(size, sympy.Expr) and not size.is_number:
        return V.graph.sizevars.guard_int(size)
    return int(size) if isinstance(size, (int, sympy.Integer)) else size


def _problem(query, key, value, subgraph, block_mask, scale, kernel_options, score_buffers=(),
             mask_buffers=()) -> FlexProblem:
    from ..settings import active_settings

    sizevars = V.graph.sizevars
    settings = active_settings()
    (bq, hq, lq, dqk), (bk, hk, lk, dk), (bv, hv, lv, dv) = (x.get_size() for x in (query, key, value))
    # dynamic sizes of separate inputs (q's batch and a KV cache view's) are separate symbols:
    # equal at their hints, they match under a guard that taking the call adds (_flex_attention)
    one = functools.partial(sizevars.statically_known_equals, 1)
    kv_batch_broadcast = one(bk) and one(bv) and not one(bq)  # one cache for every query batch (paged)
    pairs = ((dqk, dk), (hk, hv), (lk, lv), *(() if kv_batch_broadcast else ((bq, bk), (bq, bv))))
    size_guards = tuple((a, b) for a, b in pairs if not sizevars.statically_known_equals(a, b))
    hint = sizevars.optimization_hint
    operands_match = all(hint(a) == hint(b) for a, b in size_guards)
    *block_tensors, q_block, kv_block, mask_graph = _block_mask_fields(block_mask)
    present = [t for t in block_tensors if t is not None]
    int32_here = functools.partial(_int32_on, device=query.get_device())
    block_tensors_ok = all(map(int32_here, present))
    q_num, q_indices, full_q_num, full_q_indices = _backward_lists(block_mask)
    backward_lists_ok = (int32_here(q_num) and int32_here(q_indices)
                         and (full_q_num is None) == (full_q_indices is None) == (block_tensors[2] is None)
                         and all(int32_here(t) for t in (full_q_num, full_q_indices) if t is not None))
    return FlexProblem(
        device=query.get_device(), dtypes=(query.get_dtype(), key.get_dtype(), value.get_dtype()),
        heads=_static(hq), kv_heads=_static(hk), q_len=_static(lq), head_dim_qk=_static(dqk), head_dim_v=_static(dv),
        operands_match=operands_match, kv_batch_broadcast=kv_batch_broadcast,
        score_graph=subgraph.graph_module,
        score_buffers=_captured_buffers(score_buffers, query.get_device()),
        mask_graph=mask_graph.graph_module,
        mask_buffers=_captured_buffers(mask_buffers, query.get_device()),
        keys_all_in_blocks=_keys_all_in_blocks(V.graph.current_node, lk),
        block_sizes=(_block_size(kv_block), _block_size(q_block)),
        mask_heads=_static(block_tensors[0].get_size()[1]) if block_tensors[0] is not None else None,
        block_tensors_ok=block_tensors_ok and len(present) in (2, 4), scale=scale,
        kernel_options=dict(kernel_options), inference=V.graph.is_inference, size_guards=size_guards,
        q_len_hint=hint(lq), flex_decode=settings.flex_decode, flex_prefill=settings.flex_prefill,
        flex_backward=settings.flex_backward, backward_lists_ok=backward_lists_ok)


def _int32_on(t, device) -> bool:
    return isinstance(t, ir.IRNode) and t.get_dtype() == torch.int32 and t.get_device() == device


# ------------------------------------------------------------------------------- the lowering

class _FlexCall(ir.FallbackKernel):
    """A custom op of ours in the graph (its schema gives Inductor the outputs' layouts); in output
    code a call of the op's launcher (runtime.py, LAUNCHER) defined for this call site in the
    module's header (built from plain values, so a graph served from the FX cache works in a fresh
    process), with the op's arguments: Python calling Python, without the dispatcher's cost per call."""

    LAUNCHER = ""

    @staticmethod
    def site(args: list) -> dict:
        """The launcher's static values from the op's arguments (its schema's order)."""
        return dict(scale=float(args[3]), score_mod=args[4], mask_mod=args[6], kv_block_size=int(args[12]),
                    q_block_size=int(args[13]))

    def codegen(self, wrapper) -> None:
        from ..gemm.codegen import is_static, layout_exprs

        wrapper.add_import_once(f"import {_runtime.MODULE}")
        args, _ = self.unflatten_args(self.inputs, self.constant_args)
        site = self.site(args)
        static = is_static(site["kv_block_size"], site["q_block_size"],
                           *(e for node in self.inputs for e in layout_exprs(node)))
        name = f"icute_flex_{wrapper.next_kernel_suffix()}"
        method = "call_static" if static else "call"
        values = ", ".join(f"{key}={value!r}" for key, value in site.items())
        wrapper.define_kernel(name, f"{_runtime.MODULE}.{self.LAUNCHER}({values}).{method}", gpu=False)
        self.python_kernel_name = name
        super().codegen(wrapper)


class _FlexDecodeCall(_FlexCall):
    LAUNCHER = "FlexDecodeLauncher"


class _FlexPrefillCall(_FlexCall):
    LAUNCHER = "FlexPrefillLauncher"


def _flex_attention(query, key, value, subgraph, block_mask, scale, kernel_options,
                    score_mod_other_buffers, mask_mod_other_buffers):
    programs = ("", "")
    try:
        problem = None if V.graph.cpp_wrapper else _problem(query, key, value, subgraph, block_mask, scale,
                                                              kernel_options, score_mod_other_buffers,
                                                              mask_mod_other_buffers)
        reason = _call_reason(problem, query, key)
        if not reason:
            programs, reason = problem.translated  # what decline_reason translated
    except Exception as e:  # our decision must never fail a compile
        reason = f"the decision failed: {type(e).__name__}: {e}"
    if reason:
        from ..hooks import stock_lowering

        log.debug("inductor-cute: flex_attention left to the stock lowering: %s", reason)
        return stock_lowering(_HOP)(query, key, value, subgraph, block_mask, scale, kernel_options,
                                    realized(score_mod_other_buffers), realized(mask_mod_other_buffers))
    add_guards(problem, query)
    log.info("inductor-cute: flex_attention %s runs our %s kernel (score program %r, mask program %r%s)",
             list(query.get_size()), problem.kernel, *programs, "" if problem.keys_all_in_blocks else ", a block mask")
    *block_tensors, _, _, _ = _block_mask_fields(block_mask)
    kv_block, q_block = problem.block_sizes  # ints (a symbolic size was specialised in _problem)
    if problem.keys_all_in_blocks:  # flex_attention's "no block mask": walk the whole sequence
        block_tensors, q_block, kv_block = [None] * 4, 0, 0
    device = query.get_device()
    score_buffers = kernel_buffers(score_mod_other_buffers, problem.score_buffers, device)
    mask_buffers = kernel_buffers(mask_mod_other_buffers, problem.mask_buffers, device)
    return _lower_to_kernel(problem.kernel, query, key, value, float(scale), programs, score_buffers, mask_buffers,
                            block_tensors, kv_block, q_block)


def realized(captured: tuple) -> tuple:
    """The captured tensors, realized into buffers, for the stock lowering. It builds a mod's
    subgraph from them before it realizes them, so a tensor the same graph computes is inlined
    into the template; Triton's template code cannot inline a `constant_pad_nd` (ops.masked:
    "'function' object has no attribute 'graph'", torch 2.11). transformers pads its 2-D attention
    mask so, and a BlockMask traced into the graph (block_masks.py) keeps that pad in the graph."""
    for buf in captured:
        if isinstance(buf, ir.TensorBox):
            buf.realize()
    return captured


def add_guards(problem: FlexProblem, query) -> None:
    """The guards taking `problem` assumes: its dynamic sizes equal, a symbolic query length above
    the decode kernel's range (the prefill kernel's). Both lowerings of a training call add them."""
    for a, b in problem.size_guards:
        V.graph.sizevars.check_equals(a, b)
    if problem.q_len is None:
        from ...kernels.attention.flex_decode_config import MAX_Q_LEN

        V.graph.sizevars.check_lt(MAX_Q_LEN, query.get_size()[2])


def _call_reason(problem: FlexProblem | None, query, key) -> str | None:
    if problem is None:
        return "cpp_wrapper / AOTInductor output (our op is called from Python)"
    return decline_reason(problem) or _grid_reason(problem.kernel, query, key, problem.inference)


def _grid_reason(kernel: str, query, key, inference: bool = True) -> str | None:
    # Evaluated last: with a symbolic batch this adds a guard, which a call we decline should not get.
    batch, heads, q_len = query.get_size()[:3]
    if not inference:  # the backward's grids: heads and batch as y and z
        from ...host.flex_backward import MAX_GRID_YZ

        if not V.graph.sizevars.evaluate_expr(sympy.Le(sympy.Max(batch, heads), MAX_GRID_YZ)):
            return f"backward: batch or query heads exceed {MAX_GRID_YZ}"
    if kernel == "prefill":
        from torch.utils._sympy.functions import CeilDiv

        from ...host.flex_prefill import MAX_TILES
        from ...kernels.attention.flex_prefill_config import M_BLOCK

        if not V.graph.sizevars.evaluate_expr(sympy.Le(CeilDiv(q_len, M_BLOCK) * heads * batch, MAX_TILES)):
            return f"the prefill kernel's tiles (query blocks x heads x batch) exceed {MAX_TILES}"
        return None
    kv_heads = key.get_size()[1]
    if not V.graph.sizevars.evaluate_expr(sympy.Le(batch * kv_heads, _MAX_GRID_Z)):
        return f"batch x KV heads exceeds {_MAX_GRID_Z}"
    return None


def kernel_buffers(buffers, captured: tuple[Captured, ...], device) -> list:
    """A mod's captured buffers as the kernel reads them (`_kernel_buffer`), in order."""
    return [_kernel_buffer(buf, c, device) for buf, c in zip(buffers, captured)]


def _kernel_buffer(buf, captured: Captured, device):
    """A captured buffer as the kernel reads it (translate.Captured): flattened row-major into a 1-D
    tensor of its kernel dtype (bool 0/1 and int64 as int32), an integer operand a 1-element int32
    tensor. Inductor IR ops: the conversions are part of the compiled graph, not eager work."""
    from torch._inductor.lowering import full, lowerings

    if isinstance(buf, ir.IRNode) and captured.dtype == captured.kernel_dtype and len(buf.get_size()) == 1:
        return buf
    # Every layer of a model passes the same mask buffers: convert each once per graph
    converted = V.graph.__dict__.setdefault("_inductor_cute_flex_buffers", {})
    key = id(buf) if isinstance(buf, ir.IRNode) else buf
    if key not in converted:
        if not isinstance(buf, ir.IRNode):
            x = full([1], buf, dtype=torch.int32, device=device)
        else:
            x = buf
            if captured.dtype != captured.kernel_dtype:
                x = lowerings[torch.ops.prims.convert_element_type.default](x, captured.kernel_dtype)
            size = x.get_size()
            if len(size) != 1:
                x = lowerings[torch.ops.aten.reshape.default](x, [sympy.Mul(*size) if size else 1])
        converted[key] = (buf, x)  # the buffer too: its id stays its own while the graph lives
    return converted[key][1]


def _lower_to_kernel(kernel: str, query, key, value, scale: float, programs: tuple, score_buffers: list,
                     mask_buffers: list, block_tensors: list, kv_block: int, q_block: int):
    """The HOP's outputs (out, lse, max_scores) from our `kernel`'s op ("decode" or "prefill"): lse
    in log2 units like every flex kernel's; max_scores only allocated, as the stock kernels leave it
    when OUTPUT_MAX is off."""
    from torch._inductor.lowering import empty_strided, lowerings

    call, op = ((_FlexPrefillCall, torch.ops.inductor_cute.flex_prefill.default) if kernel == "prefill" else
                (_FlexDecodeCall, torch.ops.inductor_cute.flex_decode.default))
    out, lse = (ir.TensorBox.create(x)
                for x in call.create(op, query, key, value, scale, programs[0], score_buffers, programs[1],
                                     mask_buffers, *block_tensors, kv_block, q_block))
    lse2 = lowerings[torch.ops.aten.mul.Tensor](lse, LOG2E)
    max_scores = empty_strided(lse.get_size(), None, dtype=torch.float32, device=query.get_device())
    return out, lse2, max_scores
