"""The MoE up projection with its gate fused (issue 14): a post-grad graph pass (Inductor's
`post_grad_custom_pre_pass`, with enable()'s fuse_moe_gate: under max-autotune by default, see
moe_pass.py) that finds

    gate, up = torch._grouped_mm(x, w_gate_up, offs).chunk(2, dim=-1)      (or torch.split in halves)
    h = F.silu(gate) * up

as transformers' grouped_mm experts and torchtitan-style MoE code write it, and replaces it by one
call of `torch.ops.inductor_cute.grouped_mm_gated(x, w_gate_up, offs, "silu")`: our grouped GEMM
with the SwiGLU in its epilogue (ops.grouped_mm_gated), so the (tokens, 2F) product is never
written and read back. Under max-autotune with our backend its configs are autotuned
(gate_lowering.py); otherwise Inductor calls the op as a fallback kernel, with the heuristic
default config.

The patterns are Inductor's own pattern matcher's (`register_replacement`): the search functions
are traced through the same decompositions as the graph, so the form silu takes after them
(fp32 upcast, exp, div) matches whatever this torch version makes of it. A match is taken only
when its intermediates have no other users (a training graph that saves gate and up for the
backward keeps them), the split is into equal halves, and our kernel serves the call
(`gate_decline_reason`); the op itself falls back to the unfused computation for what only real
tensors show (an unaligned data pointer) and off CUDA.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ...kernels.gemm import grouped_config
from . import gate_lowering as _gate_lowering
from . import nodes
from . import runtime as _runtime
from .lowering import GroupedCall, decline_reason

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- the custom op

SCHEMA = "grouped_mm_gated(Tensor a, Tensor b, Tensor offs, str activation) -> Tensor"
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))

DEVICE_TYPES = ("cuda",)  # where the fused kernel runs (the CPU tests add "cpu")
unfused = _runtime.unfused_gate  # the op's computation without the fused kernel


def grouped_mm_gated_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a @ b_gate) * (a @ b_up) per group in one launch; what the pass decided on fake
    tensors but a real one refuses (an unaligned data pointer), and any device but CUDA, runs
    unfused."""
    if a.device.type in DEVICE_TYPES:
        return _runtime.fused_product(a, b, offs, activation)
    return unfused(a, b, offs, activation)


_LIBRARY.impl("grouped_mm_gated", grouped_mm_gated_op, "CompositeExplicitAutograd")


@torch.library.register_fake("inductor_cute::grouped_mm_gated", lib=_LIBRARY)
def _grouped_mm_gated_fake(a, b, offs, activation):
    return a.new_empty(a.shape[0], b.shape[-1] // 2)


OP = torch.ops.inductor_cute.grouped_mm_gated.default
_gate_lowering.ensure_fallback(OP)  # Inductor's fallback kernel, for gate_lowering to stand in for

# ---------------------------------------------------------------------------- the decision


def _output_code() -> str:
    """What this compile emits: the op is a Python custom op, not for AOTInductor or the C++ wrapper."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    return "aot" if getattr(V, "aot_compilation", False) else "cpp_wrapper" if config.cpp_wrapper else "python"


def _ints(values) -> tuple:
    return tuple(v if type(v) is int else None for v in values)


def gate_decline_reason(a, b, offs, activation: str) -> str | None:
    """Why the fused kernel does not take act(gate) * up of _grouped_mm(a, b, offs) (fake tensors),
    in one line; None when it does."""
    return product_decline_reason(a.shape, a.stride(), a.dtype, a.device, b, offs, activation)


def product_decline_reason(a_shape, a_stride, a_dtype, device, b, offs, activation: str, rows: str = "") -> str | None:
    """Why our kernel does not take the grouped product of an a of this shape, strides, dtype and
    device with b and offs (fake tensors), gated by `activation` when one is named, its rows
    gathered by an index of dtype `rows` when one is named (gather.py); None when it does."""
    if device.type not in DEVICE_TYPES:
        return f"device {device.type} is not CUDA"
    if b.dim() != 3 or (activation and (type(b.shape[-1]) is not int or b.shape[-1] % 2)):
        return f"b of shape {tuple(b.shape)} has no static even number of columns to halve"
    n_out = b.shape[-1] // 2 if activation else b.shape[-1]
    call = GroupedCall(a_size=_ints(a_shape), a_stride=_ints(a_stride), b_size=_ints(b.shape),
                       b_stride=_ints(b.stride()), offs_size=_ints(offs.shape),
                       out_size=_ints((a_shape[0], n_out)), out_stride=_ints((n_out, 1)),
                       a_dtype=a_dtype, b_dtype=b.dtype, offs_dtype=offs.dtype, out_dtype=a_dtype,
                       device_type="cuda", output_code=_output_code())
    reason = decline_reason(call)
    if reason:
        return reason
    groups, k, n = b.shape
    return grouped_config.unsupported_reason(grouped_config.GroupedProblem(gate=activation, rows=rows), n=n, k=k,
                                             groups=groups)


# ---------------------------------------------------------------------------- the patterns

def _chunked(a, b, offs):
    return unfused(a, b, offs, "silu")


def _split(a, b, offs):
    half = b.shape[-1] // 2
    gate, up = torch._grouped_mm(a, b, offs).split([half, half], dim=-1)
    return F.silu(gate) * up


def _fused(a, b, offs):
    return OP(a, b, offs, "silu")


_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


def _halves(match) -> bool:
    """The pattern's split cuts the product's last dim into two equal halves. (The matcher checks
    this already: it traces the search function again at the match's shapes, sizes literal; kept
    as the statement of what the rewrite needs.)"""
    split = next(n for n in match.nodes if n.op == "call_function" and n.target in _SPLITS)
    n = split.args[0].meta["val"].shape[-1]
    sizes = split.args[1]
    sizes = [sizes] * 2 if isinstance(sizes, int) else list(sizes)
    return type(n) is int and n % 2 == 0 and all(type(s) is int and s == n // 2 for s in sizes)


def _taken(match) -> bool:
    if not _halves(match):
        return False
    a, b, offs = (match.kwargs[name].meta["val"] for name in ("a", "b", "offs"))
    reason = gate_decline_reason(a, b, offs, "silu")
    if reason:
        log.info("inductor-cute leaves a gated grouped_mm %s x %s unfused: %s", tuple(a.shape), tuple(b.shape), reason)
    return reason is None


def _register(patterns) -> None:
    from torch._inductor.pattern_matcher import fwd_only, register_replacement

    example = [torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(2, 32, 64, dtype=torch.bfloat16),
               torch.empty(2, dtype=torch.int32)]
    for search in (_chunked, _split):
        register_replacement(search, _fused, example, fwd_only, [patterns], extra_check=_taken)


PATTERNS = nodes.LazyPatterns("inductor_cute_grouped_gate", _register)


def fuse_grouped_gates(graph: torch.fx.Graph) -> int:
    """Replace each act(gate) * up of a grouped_mm product by one fused call; the number made."""
    made = PATTERNS.apply(graph)
    if made:
        log.info("inductor-cute fused %d MoE gate(s) into grouped_mm_gated", made)
    return made
