"""One launch for the decode GEMMs that share their activation: a post-grad graph pass (on with
enable() unless the user has a post-grad pass of their own; enable(group_gemv=False) turns it off)
that replaces the q/k/v (or gate/up) `mm(x, w.t())` nodes of one x by one call of
`torch.ops.inductor_cute.gemv_shared_a(x, [w, ...])`, the custom op of ops.gemv_shared_a
(host/gemm.py). Inductor emits the op as an extern fallback call.

A group is 2 or 3 mm's, in graph order, of one x (M <= 16 static rows, K-major, bf16/fp16, on
CUDA) against the transposes of contiguous (N_i, K) graph inputs or constants, with sizes the
grouped GEMV takes (gemv_config.unsupported_reason) and weights of at most MAX_WEIGHT_BYTES.
Anything else, symbolic sizes included, is left as it is. "One x" is one node, or views of one
node to one shape: Inductor's decomposition of a 3-D linear gives each projection its own reshape
of the hidden states, and the post-grad graph keeps them apart.
"""

from __future__ import annotations

import logging
import operator
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ...errors import UnsupportedError
from ...host import gemm as _host_gemm
from ...host.common import DTYPE_NAMES
from ..settings import source_hash

log = logging.getLogger(__name__)

# A weight above this is left to its own mm. Measured on the H200 at M = 8 (eleventh session,
# benchmarks/results/autotune-timing-h200-20261204-s11.txt): q/k/v of Llama-3.1-8B (32 + 8 + 8 MiB)
# take 21.2 us grouped against 28.8 us as three cuBLAS calls, but gate/up (112 MiB each) 62.7 us
# against 59.7: at that size one launch saves little and our one-weight GEMV trails cuBLAS (34.8
# against 29.9 us for 14336 x 4096), which the group inherits.
MAX_WEIGHT_BYTES = 64 << 20

# ---------------------------------------------------------------------------- the custom op

# A plain Library, as the flex ops (flex/lowering.py says why); importing this module registers it,
# and enable() with grouping on imports it, so output code from Inductor's FX cache finds the op.
SCHEMA = "gemv_shared_a(Tensor a, Tensor[] weights) -> Tensor[]"
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def gemv_shared_a_op(a: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[a @ w.t() for w in weights] in one launch. The pass decided on fake tensors; what only a
    real tensor shows (a misaligned data pointer) falls back to one torch.mm per weight."""
    try:
        return _host_gemm.gemv_shared_a(a, weights)
    except UnsupportedError as e:
        log.debug("gemv_shared_a: %s; one torch.mm per weight instead", e)
        return [torch.mm(a, w.t()) for w in weights]


def register_kernel(device_type: str, fn) -> None:
    """Run `fn` (gemv_shared_a_op's signature) for the op's calls on `device_type`."""
    _LIBRARY.impl("gemv_shared_a", fn, torch._C._dispatch_key_for_device(device_type))


register_kernel("cuda", gemv_shared_a_op)


@torch.library.register_fake("inductor_cute::gemv_shared_a", lib=_LIBRARY)
def _gemv_shared_a_fake(a, weights):
    return [a.new_empty(a.shape[0], w.shape[0]) for w in weights]


OP = torch.ops.inductor_cute.gemv_shared_a.default

# ---------------------------------------------------------------------------- the graph pass

_MM = torch.ops.aten.mm.default
_PERMUTE = torch.ops.aten.permute.default
_T = torch.ops.aten.t.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], torch.fx.Node)


def _activation(x: torch.fx.Node):
    """What identifies x's values: the node, or (source, shape) for a view of a source."""
    return (x.args[0], tuple(x.args[1])) if _is_view(x) else x


def _weight_of(w_t) -> torch.fx.Node | None:
    """w when `w_t` is w.t() (permute [1, 0] or t) of a graph input or constant; None otherwise."""
    if not isinstance(w_t, torch.fx.Node) or w_t.op != "call_function":
        return None
    if not (w_t.target is _T or (w_t.target is _PERMUTE and list(w_t.args[1]) == [1, 0])):
        return None
    w = w_t.args[0]
    return w if isinstance(w, torch.fx.Node) and w.op in ("placeholder", "get_attr") else None


def _static(t) -> bool:
    """A 2-D fake tensor with plain-int sizes, strides and offset (nothing symbolic)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2
            and all(type(s) is int for s in (*t.shape, *t.stride(), t.storage_offset())))


def _groupable(mm: torch.fx.Node) -> bool:
    """mm(x, w.t()) that ops.gemv_shared_a can take as one weight of a group."""
    from ...kernels.gemm import gemv_config
    from ...kernels.gemm.config import GemmProblem

    x, w_t = mm.args
    w = _weight_of(w_t)
    if w is None or not isinstance(x, torch.fx.Node):
        return False
    xv, wv = x.meta.get("val"), w.meta.get("val")
    if not (_static(xv) and _static(wv) and _static(mm.meta.get("val"))):
        return False
    if xv.device.type != "cuda" or wv.device != xv.device or xv.dtype not in (torch.bfloat16, torch.float16) \
            or wv.dtype != xv.dtype:
        return False
    (m, k), (n, wk) = xv.shape, wv.shape
    # K-major rows with 16-byte aligned starts and row strides (8 elements of 2 bytes)
    rows_fit = xv.stride(1) == 1 and (m == 1 or xv.stride(0) % 8 == 0) and xv.storage_offset() % 8 == 0
    if wk != k or not rows_fit or not wv.is_contiguous() or wv.storage_offset() % 8:
        return False
    if n * k * wv.element_size() > MAX_WEIGHT_BYTES:
        return False
    problem = GemmProblem(DTYPE_NAMES[xv.dtype], DTYPE_NAMES[xv.dtype], "k", "k")
    return gemv_config.unsupported_reason(problem, m=m, n=n, k=k) is None


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """Groupable mm's by their x, in graph order, in chunks of at most MAX_WEIGHTS; single ones dropped."""
    from ...kernels.gemm.gemv_config import MAX_WEIGHTS

    by_x: dict = {}
    for node in graph.find_nodes(op="call_function", target=_MM):
        if _groupable(node):
            by_x.setdefault(_activation(node.args[0]), []).append(node)
    chunks = [mms[i:i + MAX_WEIGHTS] for mms in by_x.values() for i in range(0, len(mms), MAX_WEIGHTS)]
    return [c for c in chunks if len(c) > 1]


def _place_before(first: torch.fx.Node, weights: list[torch.fx.Node], order: dict) -> bool:
    """Make every weight defined before `first`: a constant (no inputs) may move up; a graph input
    after it (never seen in practice) cannot, and the group is dropped."""
    late = [w for w in weights if order[w] > order[first]]
    if any(w.op == "placeholder" for w in late):
        return False
    for w in late:
        first.prepend(w)
        order[w] = order[first] - 0.5  # keeps `order` true for the groups after this one
    return True


def group_shared_a_mms(graph: torch.fx.Graph) -> int:
    """Replace each group of mm(x, w_i.t()) by one gemv_shared_a(x, [w_i]) call; the number of
    calls made."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    made = 0
    for mms in _groups(graph):
        first, x = mms[0], mms[0].args[0]
        transposes = [mm.args[1] for mm in mms]
        other_views = [mm.args[0] for mm in mms[1:] if mm.args[0] is not x]  # views of x's source (_activation)
        weights = [_weight_of(w_t) for w_t in transposes]
        if not _place_before(first, weights, order):
            continue
        # x is an input of `first`, so defined before it; every use of a member comes after `first`
        with graph.inserting_before(first):
            call = graph.call_function(OP, (x, weights))
            call.meta["val"] = [mm.meta["val"] for mm in mms]
            if "stack_trace" in first.meta:
                call.meta["stack_trace"] = first.meta["stack_trace"]
            for i, mm in enumerate(mms):
                item = graph.call_function(operator.getitem, (call, i))
                item.meta["val"] = mm.meta["val"]
                mm.replace_all_uses_with(item)
        for mm in mms:
            graph.erase_node(mm)
        for node in dict.fromkeys([*transposes, *other_views]):
            if not node.users:
                graph.erase_node(node)
        made += 1
    if made:
        log.debug("gemv_shared_a: %d grouped calls", made)
    return made


class GroupGemvPass(CustomGraphPass):
    """The `config.post_grad_custom_post_pass` of enable() with grouping on; its uuid (this module's
    source) enters the FX graph cache key."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_shared_a_mms(graph)

    def uuid(self) -> str:
        return _SOURCE_HASH


_SOURCE_HASH = source_hash(sys.modules[__name__])
GROUP_GEMV_PASS = GroupGemvPass()
