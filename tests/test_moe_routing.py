"""The MoE routing rewrites (inductor/grouped/routing.py) on the CPU: on graphs traced with fake
tensors, the sort of a top-k's indices sorts uint8/int16 keys and a short top-k becomes a stable
sort and slices, and the rewritten graph computes what the function does on fresh random data;
what the rewrites must not touch stays; torch.compile with enable() applies them by default.
CPU tensors stand in for CUDA ones (`DEVICE_TYPES` patched).
GPU runs (Inductor's Triton sort, aten's top-k on ties): tests/gpu/test_moe_routing_gpu.py."""

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import inductor_cute
from inductor_cute.inductor.grouped import routing
from inductor_cute.inductor.grouped.moe_pass import moe_pass

aten = torch.ops.aten


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(routing, "DEVICE_TYPES", ("cuda", "cpu"))


def traced(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def rewritten(fn, *args):
    gm = traced(fn, *args)
    routing.rewrite_routing(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


TOP_K = 8


def route_and_permute(logits):
    """An MoE router as the models suite's block writes it: softmax, top-k, renormalised weights,
    the flattened expert ids sorted (stable) into the permute's order, rows per expert."""
    weights, experts = logits.float().softmax(dim=-1).topk(TOP_K, dim=-1)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(logits.shape[-1], dtype=torch.int64).scatter_add(0, flat, torch.ones_like(flat))
    return weights / weights.sum(-1, keepdim=True), experts, order, counts


def sorted_ids_too(logits):
    """The sorted expert ids read back (the sort's values), as a permute that keeps them would."""
    _, experts = logits.topk(2, dim=-1)
    keys, order = torch.sort(experts.view(-1), stable=True)
    return keys, order


def sort_dtypes(gm):
    graph = getattr(gm, "graph", gm)  # a GraphModule or its graph
    return [n.args[0].meta["val"].dtype for n in graph.nodes if n.target in (aten.sort.stable, aten.sort.default)]


@pytest.mark.parametrize("experts,key_dtype", [(128, torch.uint8), (256, torch.uint8), (300, torch.int16)])
def test_the_permute_sorts_narrow_keys_and_the_router_a_stable_sort(cpu_counts_as_cuda, experts, key_dtype):
    logits = torch.randn(300, experts)  # fp32 softmax of distinct logits: no ties
    gm = rewritten(route_and_permute, logits)
    assert aten.topk.default not in targets(gm)
    # the permute's sort of the ids first, then the router's sort of its probabilities
    assert key_dtype in sort_dtypes(gm) and torch.float32 in sort_dtypes(gm)
    fresh = torch.randn(300, experts)
    for got, want in zip(gm(fresh), route_and_permute(fresh), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        exact = not want.is_floating_point()  # (the traced softmax is the decomposed one: ulps apart)
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)


def test_sorted_keys_read_back_keep_their_dtype(cpu_counts_as_cuda):
    logits = torch.randn(77, 40)
    gm = rewritten(sorted_ids_too, logits)
    assert torch.uint8 in sort_dtypes(gm)
    keys, order = gm(logits)
    want_keys, want_order = sorted_ids_too(logits)
    assert keys.dtype == torch.int64
    assert torch.equal(keys, want_keys) and torch.equal(order, want_order)


def smallest_unsorted(x):
    return torch.topk(x, 3, dim=0, largest=False, sorted=False)


def test_a_smallest_top_k_along_another_dim(cpu_counts_as_cuda):
    x = torch.randn(50, 7)
    gm = rewritten(smallest_unsorted, x)
    assert aten.topk.default not in targets(gm)
    values, indices = gm(x)
    want = torch.topk(x, 3, dim=0, largest=False, sorted=True)  # sorted: one valid order of the unsorted set
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)


def long_top_k(x):
    return torch.topk(x, 4, dim=-1)


def other_sort(x, ids):
    return torch.sort(ids, stable=True), torch.topk(x, 2, dim=-1).values


def test_what_the_rewrites_leave_alone(cpu_counts_as_cuda):
    # a top-k over more than Inductor's Triton sort takes stays aten's
    assert targets(rewritten(long_top_k, torch.randn(4, 513))).count(aten.topk.default) == 1
    # a sort of ids that do not come from a top-k's indices is not narrowed; the top-k whose
    # values alone are used still becomes a sort
    gm = rewritten(other_sort, torch.randn(6, 10), torch.randint(0, 5, (64,)))
    assert torch.int64 in sort_dtypes(gm) and aten.topk.default not in targets(gm)


def bool_top_k(x):
    return torch.topk(x > 0, 2, dim=-1)


def test_no_sort_where_inductor_would_not_make_it_a_triton_kernel_or_aten_refuses(cpu_counts_as_cuda):
    with inductor_config.patch({"triton.persistent_reductions": False}):
        assert aten.topk.default in targets(rewritten(long_top_k, torch.randn(4, 100)))
    gm = traced(bool_top_k, torch.randn(4, 10))  # aten's top-k refuses bools: so must the compiled graph
    routing.rewrite_routing(gm.graph)
    assert aten.topk.default in targets(gm)


def test_off_cuda_nothing_changes():
    gm = rewritten(route_and_permute, torch.randn(16, 128))  # DEVICE_TYPES unpatched: CPU tensors
    assert aten.topk.default in targets(gm) and torch.uint8 not in sort_dtypes(gm)


def test_enable_installs_the_routing_rewrites_by_default_and_compiled_results_hold(cpu_counts_as_cuda, monkeypatch):
    rewritten_graphs = []

    def recording(graph):  # the pass's graph after the rewrites
        rewrite_routing(graph)
        rewritten_graphs.append([n.target for n in graph.nodes] + sort_dtypes(graph))

    rewrite_routing = routing.rewrite_routing
    monkeypatch.setattr(routing, "rewrite_routing", recording)
    assert inductor_config.post_grad_custom_pre_pass is None
    with inductor_cute.enable():
        installed = inductor_config.post_grad_custom_pre_pass
        assert installed is moe_pass(None, None, True)
        torch._dynamo.reset()
        compiled = torch.compile(route_and_permute)
        logits = torch.randn(64, 128)
        with inductor_config.patch(force_disable_caches=True):  # a cached graph would skip the pass
            results = compiled(logits)
        for got, want in zip(results, route_and_permute(logits), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (after,) = rewritten_graphs
    assert aten.topk.default not in after and torch.uint8 in after
    assert inductor_config.post_grad_custom_pre_pass is None
    with inductor_cute.enable(moe_routing=False, fuse_moe_gate=False, fuse_moe_gather=False):
        assert inductor_config.post_grad_custom_pre_pass is None


def test_a_users_pre_pass_is_kept_by_default_and_refused_when_asked():
    def users_pass(graph):
        return None

    with inductor_config.patch(post_grad_custom_pre_pass=users_pass):
        with inductor_cute.enable():
            assert inductor_config.post_grad_custom_pre_pass is users_pass
        with pytest.raises(RuntimeError, match="moe_routing"):
            inductor_cute.enable(moe_routing=True)
