"""Accumulating scatters by a sort's permutation made gathers (issue 14): Inductor's
`joint_custom_pre_pass` with enable(moe_scatters=True), the default, on CUDA tensors only. It runs
on the joint forward + backward graph, where a backward's index can still be traced to the sort in
the forward.

An MoE block permutes its n = tokens * k (token, slot) pairs into expert order with a sort's
indices `perm` (a permutation of range(n)) and puts them back after the experts. Where it moves
rows by gathers (`x[perm // k]`, `rows[inverse]`), their backward is an accumulating scatter into
zeros, `index_put(zeros, [idx], grad, accumulate=True)`; where it combines by scatter-add, as
torchtitan does (`out.scatter_add(0, (perm // k)[:, None].expand(-1, hidden), rows)`), the forward
is one too. Inductor makes each a fill of the zeros and an atomic add per element (the Qwen3-30B-A3B
block's training step at 4096 tokens, H100: 41 + 165 us for the combine's backward, 5 + 84 for the
permute's). But with such an index every destination row receives a known set of source rows, so
the scatter is a gather, with inverse = scatter(empty(n), 0, perm, arange(n)) (the graph's own
where it has one):

  index            scatter                         gather
  perm             out[perm[j]] += v[j]            out += v[inverse]
  inverse of perm  out[inverse[j]] += v[j]         out += v[perm]
  perm // k        out[perm[j] // k] += v[j]       out += v[inverse].view(n // k, k, ...).sum(1)

The k-fold sums run in fp32 for fp16/bf16 values, in a fixed order (slot 0 first): deterministic
where the atomics were not. One difference: an element scattered as -0.0 into zeros stays -0.0 (0.0 + -0.0 is +0.0).

Taken: `aten.index_put` (accumulate) with one 1-D index over the first dimension, and
`aten.scatter_add` over dim 0 whose index is that 1-D index broadcast along the rows; the values
exactly (n, *row) for a destination (n // k or n, *row), static sizes, floating-point values;
the permutation from a sort of a 1-D tensor (through views), `perm // k` a floor division by a
positive int. Everything else stays as it was.
"""

from __future__ import annotations

import logging
import operator
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..settings import source_hash
from . import nodes

log = logging.getLogger(__name__)

aten, prims = torch.ops.aten, torch.ops.prims
DEVICE_TYPES = ("cuda",)  # where the rewrite applies (the CPU tests add "cpu")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Up to this k, a token's k rows are added as k gathers (a pointwise kernel, each load a whole row);
# beyond it, summed as a (tokens, k, row) reduction over k, which Inductor's kernel reads k rows
# apart across neighbouring threads: 160 us for 134 MB (k = 8, H100) against ~50 at copy speed.
MAX_UNROLLED_K = 32
# what the replacement keeps of its own (the rest, provenance, it takes from the scatter; not the
# scatter's op, which would name its kernels)
_OWN_META = ("val", "tensor_meta", "eager_input_vals", "original_aten")


def _static_length(node) -> int | None:
    """n where `node`'s value is a 1-D tensor of a static length n, else None."""
    v = nodes.value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or type(v.shape[0]) is not int:
        return None
    return v.shape[0]


def _permutation(node) -> torch.fx.Node | None:
    """The sort-indices node `node` is (through views that keep it 1-D), if it is a sort's indices
    of a 1-D tensor: a permutation of range(n)."""
    n = _static_length(node)
    node = nodes.through_views(node)
    if n is None or not (isinstance(node, torch.fx.Node) and node.target is operator.getitem
                         and node.args[1] == 1 and node.args[0].target in nodes.SORTS):
        return None
    return node if _static_length(node.args[0].args[0]) == n else None


def _inverse_of(node) -> torch.fx.Node | None:
    """perm where `node` is `scatter(t, 0, perm, arange(n))` of n elements: perm's inverse (each
    element of t is overwritten, perm being a permutation)."""
    n = _static_length(node)
    node = nodes.through_views(node)
    if n is None or not isinstance(node, torch.fx.Node) or node.target is not aten.scatter.src or len(node.args) != 4:
        return None
    t, dim, index, src = node.args
    perm = _permutation(index)
    if dim not in (0, -1) or perm is None or _static_length(t) != n or _static_length(perm) != n:
        return None
    if nodes.value(node).dtype not in (torch.int32, torch.int64):  # narrower: no index (and wraps past its range)
        return None
    return perm if _is_arange(src, n) else None


def _is_arange(node, n: int) -> bool:
    if not isinstance(node, torch.fx.Node) or _static_length(node) != n:
        return False
    if node.target is prims.iota.default:
        return node.args[0] == n and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1
    return node.target is aten.arange.default and node.args[0] == n


def _floor_divided(node) -> tuple | None:
    """(x, k) where `node` is x // k for a positive int k."""
    node = nodes.through_views(node)
    if not isinstance(node, torch.fx.Node):
        return None
    floor = node.target is aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor"
    if not (floor or node.target is aten.floor_divide.default):
        return None
    x, k = node.args
    return (x, k) if type(k) is int and k > 0 else None


def _classify(index) -> tuple | None:
    """(perm, k, inverted) for an index that is perm (k 1), perm's inverse (inverted) or perm // k."""
    perm = _permutation(index)
    if perm is not None:
        return perm, 1, False
    perm = _inverse_of(index)
    if perm is not None:
        return perm, 1, True
    divided = _floor_divided(index)
    perm = _permutation(divided[0]) if divided is not None else None
    return None if perm is None else (perm, divided[1], False)


def _row_index(index) -> torch.fx.Node | None:
    """idx where scatter_add's index is a 1-D idx broadcast along the rows: expand(idx.view(n, 1, ...))."""
    if not isinstance(index, torch.fx.Node):
        return None
    if _static_length(index) is not None:
        return index
    if index.target is not aten.expand.default:
        return None
    column = index.args[0]
    v, i = nodes.value(column), nodes.value(index)
    # (n, 1, ..., 1) expanded to (n, row...): not a column expand adds leading dims to (or grows dim 0 of)
    if v is None or v.dim() != i.dim() or v.shape[0] != i.shape[0] or any(s != 1 for s in v.shape[1:]):
        return None
    source = column
    while isinstance(source, torch.fx.Node) and source.target in (*nodes.VIEWS, aten.unsqueeze.default):
        source = source.args[0]
        if _static_length(source) == v.shape[0]:
            return source
    return None


def _scatter_args(node: torch.fx.Node) -> tuple | None:
    """(destination, 1-D index, values) of an accumulating row scatter we may rewrite."""
    if node.target is aten.index_put.default and len(node.args) >= 3:
        base, indices, values, *rest = node.args
        accumulate = rest[0] if rest else node.kwargs.get("accumulate", False)
        if not accumulate or len(indices) != 1 or _static_length(indices[0]) is None:
            return None
        return base, indices[0], values
    if node.target is aten.scatter_add.default and len(node.args) == 4:
        base, dim, index, values = node.args
        b, i, v = (nodes.value(x) for x in (base, index, values))
        if not all(isinstance(x, torch.Tensor) for x in (b, i, v)) or dim not in (0, -b.dim()) or i.shape != v.shape:
            return None
        idx = _row_index(index)
        return None if idx is None else (base, idx, values)
    return None


def _sizes_fit(base, values, n: int, k: int) -> bool:
    b, v = nodes.value(base), nodes.value(values)
    if not isinstance(b, torch.Tensor) or not isinstance(v, torch.Tensor) or b.device.type not in DEVICE_TYPES:
        return False
    static = all(type(s) is int for s in (*b.shape, *v.shape))
    return (static and b.dim() >= 1 and b.shape[0] * k == n and tuple(v.shape) == (n, *b.shape[1:])
            and b.dtype == v.dtype and b.dtype.is_floating_point)


def _is_zeros(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is aten.full.default and node.args[1] == 0
            and not isinstance(node.args[1], bool))


class _Inverses:
    """perm's inverse permutation before a node: the graph's own scatter where it has one there,
    else one made right after perm."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.position = {node: i for i, node in enumerate(graph.nodes)}
        self.found = {}
        for node in graph.nodes:
            perm = _inverse_of(node) if node.target is aten.scatter.src else None
            if perm is not None:
                self.found.setdefault(perm, node)
        self.made = {}

    def before(self, node: torch.fx.Node, perm: torch.fx.Node) -> torch.fx.Node:
        found = self.found.get(perm)
        if found is not None and self.position[found] < self.position[node]:
            return found
        if perm not in self.made:
            self.made[perm] = self._make(perm)
        return self.made[perm]

    def _make(self, perm: torch.fx.Node) -> torch.fx.Node:
        """perm's inverse, with perm's provenance (activation-checkpoint and memory-budget tags too)."""
        n, v = _static_length(perm), nodes.value(perm)
        dtype_device = {"dtype": v.dtype, "device": v.device}

        def after(node, target, *args, **kwargs):
            with self.graph.inserting_after(node):
                made = nodes.call(self.graph, target, args, kwargs, like=perm)
            _take_provenance(made, perm)
            return made

        empty = after(perm, aten.empty.memory_format, [n], **dtype_device)
        positions = after(empty, prims.iota.default, n, start=0, step=1, requires_grad=False, **dtype_device)
        return after(positions, aten.scatter.src, empty, 0, perm, positions)


def _take_provenance(made: torch.fx.Node, source: torch.fx.Node) -> None:
    """`source`'s meta but for what `made` keeps of its own: where it came from, and the tags the
    partitioner reads (activation checkpointing's, a region's memory budget) on every node made."""
    made.meta.update({key: value for key, value in source.meta.items() if key not in _OWN_META})


def _gathered(graph, node, base, values, perm, k: int, inverted: bool, inverses: _Inverses) -> torch.fx.Node:
    """Scatter `node`'s result as a gather (module docstring), inserted at the graph's insertion point."""
    def call(target, *args, **kwargs):
        made = nodes.call(graph, target, args, kwargs, like=values)
        _take_provenance(made, node)
        return made

    dtype = nodes.value(values).dtype
    wide = dtype in _LOW_PRECISION and (k > 1 or not _is_zeros(base))

    def gather(index):
        rows = call(aten.index.Tensor, values, [index])
        return call(prims.convert_element_type.default, rows, torch.float32) if wide else rows

    if k == 1:
        rows = gather(perm if inverted else inverses.before(node, perm))
    else:
        slots = call(aten.view.default, inverses.before(node, perm), [nodes.value(base).shape[0], k])
        if k <= MAX_UNROLLED_K:  # k gathers added in a pointwise kernel: each load reads whole rows
            rows = gather(call(aten.select.int, slots, 1, 0))
            for slot in range(1, k):
                rows = call(aten.add.Tensor, rows, gather(call(aten.select.int, slots, 1, slot)))
        else:
            rows = call(aten.sum.dim_IntList, gather(slots), [1])
    if not _is_zeros(base):
        rows = call(aten.add.Tensor, call(prims.convert_element_type.default, base, torch.float32) if wide else base,
                    rows)
    return call(prims.convert_element_type.default, rows, dtype) if wide else rows


def gather_permuted_scatters(graph: torch.fx.Graph) -> int:
    """Rewrite each accumulating scatter whose index comes from a sort's permutation (module
    docstring) as a gather; the number rewritten."""
    inverses, rewritten = _Inverses(graph), 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        scatter = _scatter_args(node)
        kind = _classify(scatter[1]) if scatter is not None else None
        if kind is None or not _sizes_fit(scatter[0], scatter[2], _static_length(kind[0]), kind[1]):
            continue
        base, _, values = scatter
        with graph.inserting_before(node):
            result = _gathered(graph, node, base, values, *kind, inverses)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        if _is_zeros(base) and not base.users:
            graph.erase_node(base)
        rewritten += 1
    if rewritten:
        log.info("inductor-cute: %d accumulating scatter(s) by a sort's permutation made gathers", rewritten)
    return rewritten


class ScattersPass(CustomGraphPass):
    """The joint-graph pass; its uuid (this module and its helpers) enters the FX graph cache key."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        gather_permuted_scatters(graph)

    def uuid(self) -> str:
        return _SOURCE_HASH


_SOURCE_HASH = source_hash(nodes, sys.modules[__name__])
SCATTERS_PASS = ScattersPass()
