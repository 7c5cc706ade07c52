"""The MoE permute's row gather fused into the grouped GEMM (issue 14): a rewrite, in the MoE
post-grad pass (moe_pass.py, with enable()'s fuse_moe_gather: under max-autotune by default), of

    rows = x[idx]                                   (aten.index.Tensor, idx 1-D int32/int64)
    torch._grouped_mm(rows, w, offs)                or gate.py's grouped_mm_gated(rows, w, offs, act)

as torchtitan-style MoE code writes the expert inputs (x[order // top_k]), into one call of
`torch.ops.inductor_cute.grouped_mm_rows(x, idx, w, offs, act)`: our grouped GEMM reading x's rows
through idx in its A loads (ops.grouped_mm(..., rows=idx)), so the (tokens * top_k, hidden) copy is
never written and read back. Under max-autotune with our backend its configs are autotuned
(gate_lowering.py); otherwise Inductor calls the op as a fallback kernel with the heuristic config.

A match is taken only when every user of the gathered rows is such a product (torchtitan's w1 and
w3 products of the same rows are both rewritten; a training graph that saves the rows for the
weight gradient keeps the copy, and so the unfused calls) and our kernel serves each call
(`rows_decline_reason`); the op falls back to the unfused computation for what only real tensors
show (an unaligned data pointer) and off CUDA. The fused computation is the unfused one's, bit for
bit: the same products in the same order, only the rows' source differs. Index semantics are
torch's (a negative index counts from x's end; one outside x stops the kernel, as torch's
device-side check does), except that index entries past offs[-1], whose rows no group takes, are
never read, so a bad one there goes unnoticed.
"""

from __future__ import annotations

import logging

import torch

from . import gate_lowering as _gate_lowering
from . import runtime as _runtime
from . import gate as _gate
from . import nodes
from .gate import OP as GATED_OP
from .gate import product_decline_reason

log = logging.getLogger(__name__)

SCHEMA = "grouped_mm_rows(Tensor a, Tensor rows, Tensor b, Tensor offs, str activation) -> Tensor"
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def grouped_mm_rows_op(a: torch.Tensor, rows: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                       activation: str) -> torch.Tensor:
    """_grouped_mm(a[rows], b, offs), gated by `activation` when one is named, in one launch."""
    if a.device.type in _gate.DEVICE_TYPES:  # (read at the call: the CPU tests add "cpu")
        return _runtime.fused_product(a, b, offs, activation, rows=rows)
    return _runtime.unfused_product(a, b, offs, activation, rows)


_LIBRARY.impl("grouped_mm_rows", grouped_mm_rows_op, "CompositeExplicitAutograd")


@torch.library.register_fake("inductor_cute::grouped_mm_rows", lib=_LIBRARY)
def _grouped_mm_rows_fake(a, rows, b, offs, activation):
    return a.new_empty(rows.shape[0], b.shape[-1] // 2 if activation else b.shape[-1])


OP = torch.ops.inductor_cute.grouped_mm_rows.default
_gate_lowering.ensure_fallback(OP)  # Inductor's fallback kernel, for gate_lowering to stand in for

_INDEX = torch.ops.aten.index.Tensor
_GROUPED_MM = torch.ops.aten._grouped_mm.default


def rows_decline_reason(x, idx, b, offs, activation: str) -> str | None:
    """Why the gathered kernel does not take _grouped_mm(x[idx], b, offs) (fake tensors; gated by
    `activation` when one is named), in one line; None when it does."""
    if x.dim() != 2 or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        return f"x[idx] of x {tuple(x.shape)} and idx {idx.dtype} {tuple(idx.shape)} is not a row gather"
    if idx.device != x.device:
        return f"the index is on {idx.device}, x on {x.device}"
    if type(x.shape[0]) is int and x.shape[0] == 0:
        return "x has no rows"
    if x.stride(-1) != 1 or type(x.stride(0)) is not int or x.stride(0) % 8:
        return f"x of strides {tuple(x.stride())} is not row-major with 16-byte rows"
    # the product's checks: those of the unfused call on the (contiguous) gathered rows
    return product_decline_reason((idx.shape[0], x.shape[1]), (x.shape[1], 1), x.dtype, x.device, b, offs,
                                  activation, rows=str(idx.dtype).removeprefix("torch."))


def _product_args(node: torch.fx.Node):
    """(a, b, offs, activation) of a grouped product we rewrite: _grouped_mm's forward form with
    offsets, no bias and no other output dtype than a's, or the fused gate's op; None otherwise."""
    if node.op != "call_function":
        return None
    if node.target is _GROUPED_MM:
        args = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), node.args)) | dict(node.kwargs)
        a, out_dtype = args.get("self"), args.get("out_dtype")
        if args.get("offs") is None or args.get("bias") is not None or nodes.value(a) is None or \
                out_dtype not in (None, nodes.value(a).dtype):
            return None
        return a, args["mat2"], args["offs"], ""
    if node.target is GATED_OP and len(node.args) == 4:
        return node.args
    return None


def _gather_args(node) -> tuple | None:
    """(x, idx) of `x[idx]` with one index tensor, for the first dim, None otherwise."""
    if not isinstance(node, torch.fx.Node) or node.target is not _INDEX or len(node.args) != 2:
        return None
    x, indices = node.args
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
        return None
    return x, indices[0]


def _declined(x, idx, products: list) -> str | None:
    """Why the products (a, b, offs, activation, node) of x[idx] are not all rewritten; None when they are."""
    for a, b, offs, activation, _ in products:
        values = [nodes.value(n) for n in (x, idx, b, offs)]
        if any(v is None for v in values):
            return "an operand without a traced value"
        reason = rows_decline_reason(*values, activation)
        if reason:
            return reason
    return None


def fuse_row_gathers(graph: torch.fx.Graph) -> int:
    """Replace each grouped product of gathered rows by one gathered call; the number made. The
    rows x[idx] may feed several products (torchtitan multiplies them by w1 and w3 apart): all of
    them are rewritten, or none, where the rows have another use (a training graph saves them)."""
    made = 0
    for gather_node in list(graph.nodes):
        gather = _gather_args(gather_node)
        if gather is None or not gather_node.users:
            continue
        products = [_product_args(user) for user in gather_node.users]
        if any(p is None or p[0] is not gather_node for p in products):
            continue
        x, idx = gather
        products = [(*p, user) for p, user in zip(products, gather_node.users)]
        reason = _declined(x, idx, products)
        if reason:
            log.info("inductor-cute leaves a grouped_mm of gathered rows unfused: %s", reason)
            continue
        for _, b, offs, activation, node in products:
            with graph.inserting_before(node):
                fused = graph.call_function(OP, (x, idx, b, offs, activation))
            # the product's value and provenance; not its eager_input_vals (its own op's arguments)
            fused.meta.update({key: value for key, value in node.meta.items() if key != "eager_input_vals"})
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            made += 1
        graph.erase_node(gather_node)
    if made:
        log.info("inductor-cute fused %d row gather(s) into grouped_mm_rows", made)
    return made
