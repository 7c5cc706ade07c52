"""The MoE gate's backward fused into the down projection's input gradient (issue 14): a rewrite, in
the MoE post-grad pass (moe_pass.py, with enable()'s fuse_moe_gate, as gate.py's forward fusion),
of what autograd makes of `silu(gate) * up` with `gate, up = h.chunk(2, -1)` in a training graph's
backward,

    y = torch._grouped_mm(grad_out, w_down, offs)           the down projection's input gradient
    grad_h = cat([silu_backward(y * up, gate), y * silu(gate)], 1)

(gate and up: the halves of h = [gate | up], split in the backward from the saved h, or saved
themselves) into one call of
`torch.ops.inductor_cute.grouped_mm_gate_grad(grad_out, w_down, offs, gate, up, "silu")`:
our grouped GEMM with SiLU-and-mul's backward in its epilogue (ops.grouped_mm_gate_grad), so y is
never written and read back, and the separate pointwise kernel (reading y and h, writing grad_h)
goes. Under max-autotune with our backend its configs are autotuned against the unfused
computation (gate_lowering.py); otherwise Inductor calls the op as a fallback kernel with the
heuristic config.

The patterns are traced as gate.py's are (Inductor's decompositions, so silu and silu_backward
take whatever form this torch gives them), then deduplicated as AOTAutograd deduplicates a joint
graph (its CSE: silu and its backward upcast the gate once). A match is taken only when y has no
other users and our kernel serves the call (`gate_grad_decline_reason`); the op falls back to the
unfused computation for what only real tensors show and off CUDA.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import gate as _gate
from . import gate_lowering as _gate_lowering
from . import nodes
from . import runtime as _runtime
from .gate import product_decline_reason
from ...kernels.gemm import grouped_config

log = logging.getLogger(__name__)

SCHEMA = "grouped_mm_gate_grad(Tensor a, Tensor b, Tensor offs, Tensor gate, Tensor up, str activation) -> Tensor"
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def grouped_mm_gate_grad_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor,
                            up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient of [gate | up] in act(gate) * up for the output gradient _grouped_mm(a, b,
    offs), in one launch; any device but CUDA (gate.DEVICE_TYPES) runs unfused."""
    if a.device.type in _gate.DEVICE_TYPES:
        return _runtime.fused_gate_grad(a, b, offs, gate, up, activation)
    return _runtime.unfused_gate_grad(a, b, offs, gate, up, activation)


_LIBRARY.impl("grouped_mm_gate_grad", grouped_mm_gate_grad_op, "CompositeExplicitAutograd")


@torch.library.register_fake("inductor_cute::grouped_mm_gate_grad", lib=_LIBRARY)
def _grouped_mm_gate_grad_fake(a, b, offs, gate, up, activation):
    return a.new_empty(a.shape[0], 2 * b.shape[-1])


OP = torch.ops.inductor_cute.grouped_mm_gate_grad.default
_gate_lowering.ensure_fallback(OP)  # Inductor's fallback kernel, for gate_lowering to stand in for


def gate_grad_decline_reason(a, b, offs, gate, up, activation: str) -> str | None:
    """Why our kernel does not take [gate | up]'s gradient for the output gradient _grouped_mm(a,
    b, offs) (fake tensors), in one line; None when it does."""
    reason = product_decline_reason(a.shape, a.stride(), a.dtype, a.device, b, offs, "")
    if reason:
        return reason
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    for half in (gate, up):  # (sizes compared without guards: a dynamic row count is a symbol)
        if half.dim() != 2 or half.dtype != a.dtype or half.device != a.device or not all(
                statically_known_true(x == y) for x, y in zip(half.shape, (a.shape[0], b.shape[-1]))):
            return f"gate or up {half.dtype} {tuple(half.shape)} is not the product's shape, dtype and device"
    groups, k, n = b.shape
    return grouped_config.unsupported_reason(grouped_config.GroupedProblem(gate_grad=activation), n=n, k=k,
                                             groups=groups)


# ---------------------------------------------------------------------------- the patterns

def _search(a, b, offs, gate, up, dim):
    y = torch._grouped_mm(a, b, offs)
    return torch.cat([torch.ops.aten.silu_backward(y * up, gate), y * F.silu(gate)], dim)


def _fused(a, b, offs, gate, up):
    return OP(a, b, offs, gate, up, "silu")


def _taken(match) -> bool:
    a, b, offs, gate, up = (match.kwargs[name].meta["val"] for name in ("a", "b", "offs", "gate", "up"))
    reason = gate_grad_decline_reason(a, b, offs, gate, up, "silu")
    if reason:
        log.info("inductor-cute leaves a gate's gradient after grouped_mm %s x %s unfused: %s", tuple(a.shape),
                 tuple(b.shape), reason)
    return reason is None


def _traced_deduplicated(fn, args, *rest, **kwargs):
    """Inductor's forward trace of a search function, then AOTAutograd's CSE of the joint graph."""
    from torch._functorch.compile_utils import fx_graph_cse
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args, *rest, **kwargs)
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()
    return gm


def _with_dim(dim: int):
    """The search function with the cat's dim fixed (the pattern's inputs are its parameters)."""
    def search(a, b, offs, gate, up):
        return _search(a, b, offs, gate, up, dim)

    return search


def _register(patterns) -> None:
    from torch._inductor.pattern_matcher import register_replacement

    example = [torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(2, 32, 64, dtype=torch.bfloat16),
               torch.empty(2, dtype=torch.int32), torch.empty(16, 64, dtype=torch.bfloat16),
               torch.empty(16, 64, dtype=torch.bfloat16)]
    for dim in (1, -1):  # autograd's cat of the halves' gradients, as the graph spells its dim
        register_replacement(_with_dim(dim), _fused, example, _traced_deduplicated, [patterns], extra_check=_taken)


PATTERNS = nodes.LazyPatterns("inductor_cute_grouped_gate_grad", _register)


def fuse_gate_grads(graph: torch.fx.Graph) -> int:
    """Replace each SiLU-and-mul backward of a grouped_mm product by one fused call; the number made."""
    made = PATTERNS.apply(graph)
    if made:
        log.info("inductor-cute fused %d MoE gate gradient(s) into grouped_mm_gate_grad", made)
    return made
