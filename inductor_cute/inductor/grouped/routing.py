"""The MoE router's top-k and the permute's sort made cheap (issue 14): two rewrites in the MoE
post-grad pass (moe_pass.py, with enable(moe_routing=True), the default), on CUDA tensors only.

1. The permute sorts the flattened expert ids, `argsort(topk(...).indices.flatten(), stable=True)`.
   Those ids are int64, so the sort aten falls back to (Inductor lowers sorts of at most 512
   elements only) is cub's radix sort with eight 8-bit passes, each a kernel launch plus a memset;
   but a top-k index is below the size of the dimension it was taken over (128 experts), so the
   keys are sorted as uint8 (at most 256 experts) or int16 (at most 32768): one or two passes, the
   same order, and a sort that is stable stays stable. Sorted keys (the sort's values) are widened
   back to the original dtype.
2. `topk` over a dimension of at most 512 (the router's experts) becomes a stable sort in that
   order and a slice of its first k: aten's top-k of 128 experts runs a radix select and a bitonic
   sort of the k (~38 us at 4096 tokens on an H100, for 2 MB read), where a sort that short is a
   Triton kernel of Inductor's own (one row per program, in registers) that can read the softmax
   before it. The same elements come out, in the same order: the k largest, ties taken in index
   order as aten's top-k takes them, NaN counted largest (or smallest: largest=False) as both
   order them; one difference: -0.0 and +0.0 are equal to the sort (index order) where aten's
   top-k ranks +0.0 higher. The sorted rows are written whole (6 bytes an element) before the
   slices: at most 1.5x the bytes of the top-k's input, which the unrewritten graph holds in
   memory anyway, and which the sort's kernel may compute instead of reading (the softmax).

Nothing else changes: no other sort is narrowed (the keys must come from a top-k's indices through
views only), and a top-k over a longer or symbolic dimension, of bools, or where Inductor would not
make the sort a Triton kernel (persistent reductions off), stays aten's.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._inductor import config as inductor_config

from . import nodes

log = logging.getLogger(__name__)

aten = torch.ops.aten
DEVICE_TYPES = ("cuda",)  # where the rewrites apply (the CPU tests add "cpu")
MAX_SORTED_TOPK = 512  # Inductor's Triton sort takes rows up to this length (ir.Sort.create)
_TOPK_SIGNATURE = ("self", "k", "dim", "largest", "sorted")


def _topk_args(node) -> dict | None:
    """topk's arguments by name (defaults filled in) if `node` is a top-k on a CUDA tensor, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not aten.topk.default:
        return None
    args = {"dim": -1, "largest": True, "sorted": True} | dict(zip(_TOPK_SIGNATURE, node.args)) | dict(node.kwargs)
    x = nodes.value(args["self"])
    if x is None or x.device.type not in DEVICE_TYPES or x.dim() == 0:
        return None
    return args


def _index_bound(node) -> int | None:
    """An exclusive upper bound of the values of `node` where it is a top-k's indices seen through
    views (the size of the dimension the top-k ran over, when static), else None."""
    node = nodes.through_views(node)
    if not (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 1):
        return None
    args = _topk_args(node.args[0])
    if args is None:
        return None
    size = nodes.value(args["self"]).shape[args["dim"]]
    return size if type(size) is int else None


def _narrow_dtype(bound: int) -> torch.dtype | None:
    if bound <= 256:
        return torch.uint8
    if bound <= 32768:
        return torch.int16
    return None


def narrow_sort_keys(graph: torch.fx.Graph) -> int:
    """Sort top-k indices as the narrowest integer that holds them (rewrite 1); the number narrowed."""
    narrowed = 0
    for sort in list(graph.nodes):
        if sort.op != "call_function" or sort.target not in nodes.SORTS:
            continue
        keys = sort.args[0]
        bound, value = _index_bound(keys), nodes.value(keys)
        dtype = _narrow_dtype(bound) if bound is not None else None
        if dtype is None or value is None or value.dtype not in (torch.int32, torch.int64):
            continue
        with graph.inserting_before(sort):
            narrow = nodes.call(graph, torch.ops.prims.convert_element_type.default, (keys, dtype), like=keys)
        sort.replace_input_with(keys, narrow)
        wide_dtype = value.dtype
        for user in list(sort.users):  # the sorted keys, widened back for whoever reads them
            if user.target is operator.getitem and user.args[1] == 0 and user.users:
                with graph.inserting_after(user):
                    wide = nodes.call(graph, torch.ops.prims.convert_element_type.default, (user, wide_dtype),
                                      like=user)
                user.replace_all_uses_with(wide, delete_user_cb=lambda n: n is not wide)
        with nodes.value(narrow).fake_mode:  # the sort's own traced values, of the narrow keys
            sort.meta["val"] = sort.target(nodes.value(narrow), *sort.args[1:], **sort.kwargs)
        for user in sort.users:
            if user.target is operator.getitem:
                user.meta["val"] = sort.meta["val"][user.args[1]]
        narrowed += 1
    return narrowed


def topk_as_sort(graph: torch.fx.Graph) -> int:
    """Replace each top-k over a static dimension of at most MAX_SORTED_TOPK elements by a stable
    sort and slices (rewrite 2); the number replaced."""
    replaced = 0
    for node in list(graph.nodes):
        args = _topk_args(node)
        if args is None:
            continue
        x = nodes.value(args["self"])
        if x.dtype == torch.bool or not inductor_config.triton.persistent_reductions:
            continue  # aten refuses bools; without persistent reductions the sort would be aten's too
        dim = args["dim"] % x.dim()
        n, k = x.shape[dim], args["k"]
        if type(n) is not int or type(k) is not int or not 1 < n <= MAX_SORTED_TOPK or not 0 <= k <= n:
            continue
        outputs = [user for user in node.users if user.target is operator.getitem]
        if len(outputs) != len(node.users):
            continue
        with graph.inserting_before(node):
            sort = nodes.call(graph, aten.sort.stable, (args["self"],),
                              {"stable": True, "dim": dim, "descending": bool(args["largest"])}, like=args["self"])
            parts = [nodes.call(graph, operator.getitem, (sort, i), like=args["self"]) for i in (0, 1)]
            firsts = [nodes.call(graph, aten.slice.Tensor, (part, dim, 0, k), like=args["self"]) for part in parts]
            # contiguous, as top-k's outputs are (a view of them may need it)
            firsts = [nodes.call(graph, aten.clone.default, (first,), {"memory_format": torch.contiguous_format},
                                 like=args["self"]) for first in firsts]
        for user in outputs:
            user.replace_all_uses_with(firsts[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        replaced += 1
    return replaced


def rewrite_routing(graph: torch.fx.Graph) -> None:
    """Both rewrites, keys first (they are recognised by the top-k their indices come from)."""
    narrowed, replaced = narrow_sort_keys(graph), topk_as_sort(graph)
    if narrowed or replaced:
        log.info("inductor-cute: %d sort(s) of top-k indices narrowed, %d top-k(s) made sorts", narrowed, replaced)
