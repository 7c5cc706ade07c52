"""The accumulating scatters by a sort's permutation made gathers (inductor/grouped/scatters.py) on
the CPU: on graphs traced with fake tensors, each form (an MoE permute's and combine's backward,
torchtitan's scatter-add combine) becomes a gather and computes what the function does on fresh
random data; scatters whose index is not provably such a permutation stay; torch.compile with
enable() applies the pass to a training step's joint graph by default. CPU tensors stand in for
CUDA ones (`DEVICE_TYPES` patched). GPU runs: tests/gpu/test_moe_scatters_gpu.py."""

import operator

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import inductor_cute
from inductor_cute.inductor.grouped import scatters

aten = torch.ops.aten
TOKENS, TOP_K, HIDDEN, EXPERTS = 24, 4, 40, 6
PAIRS = TOKENS * TOP_K
SCATTERS = (aten.index_put.default, aten.scatter_add.default)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(scatters, "DEVICE_TYPES", ("cuda", "cpu"))


def traced(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def rewritten(fn, *args, expect: int):
    gm = traced(fn, *args)
    assert scatters.gather_permuted_scatters(gm.graph) == expect
    gm.graph.lint()
    gm.recompile()
    return gm


def order_of(experts):
    return torch.argsort(experts.flatten(), stable=True)


def inverse_of(order):
    return torch.empty_like(order).scatter(0, order, torch.arange(order.numel()))


# the backward of the permute x[order // k]: each token's k rows summed back
def permute_backward(experts, grad_rows):
    return torch.zeros(TOKENS, HIDDEN, dtype=grad_rows.dtype).index_put((order_of(experts) // TOP_K,), grad_rows,
                                                                          accumulate=True)


# the backward of the combine's gather rows[inverse]: each pair's row back in expert order
def combine_backward(experts, grad_pairs):
    index = inverse_of(order_of(experts))
    return torch.zeros(PAIRS, HIDDEN, dtype=grad_pairs.dtype).index_put((index,), grad_pairs, accumulate=True)


# the backward of weights.view(-1)[order]: a 1-D destination, the permutation itself as the index
def sorted_weights_backward(experts, grad):
    return torch.zeros(PAIRS, dtype=grad.dtype).index_put((order_of(experts),), grad, accumulate=True)


# torchtitan's combine into the shared expert's output
def scatter_add_combine(experts, shared, rows):
    index = (order_of(experts) // TOP_K).reshape(-1, 1).expand(-1, HIDDEN)
    return shared.scatter_add(0, index, rows)


def experts_ids():
    return torch.randint(0, EXPERTS, (TOKENS, TOP_K))


def fresh(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).mul(3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn, value_shapes", [
    (permute_backward, [(PAIRS, HIDDEN)]),
    (combine_backward, [(PAIRS, HIDDEN)]),
    (sorted_weights_backward, [(PAIRS,)]),
    (scatter_add_combine, [(TOKENS, HIDDEN), (PAIRS, HIDDEN)]),
])
def test_each_form_becomes_a_gather_and_computes_the_same(cpu_counts_as_cuda, fn, value_shapes, dtype):
    experts = experts_ids()
    values = [fresh(*shape, dtype=dtype) for shape in value_shapes]
    gm = rewritten(fn, experts, *values, expect=1)
    assert not set(SCATTERS) & set(targets(gm))
    want = fn(experts, *[v.double() for v in values])
    got, eager = gm(experts, *values), fn(experts, *values)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:  # another order of fp32 additions
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-5)
    else:  # the sums against an fp64 reference: no further from it than eager's bf16 ones
        assert (got.double() - want).abs().max() <= (eager.double() - want).abs().max()


@pytest.mark.parametrize("unrolled", [True, False])
def test_the_k_fold_sum_adds_k_gathers_up_to_a_bound_and_reduces_beyond_it(cpu_counts_as_cuda, monkeypatch,
                                                                          unrolled):
    monkeypatch.setattr(scatters, "MAX_UNROLLED_K", TOP_K if unrolled else TOP_K - 1)
    experts, grad_rows = experts_ids(), fresh(PAIRS, HIDDEN, dtype=torch.bfloat16)
    gm = rewritten(permute_backward, experts, grad_rows, expect=1)
    gathers = targets(gm).count(aten.index.Tensor)
    assert (gathers, aten.sum.dim_IntList in targets(gm)) == ((TOP_K, False) if unrolled else (1, True))
    want = permute_backward(experts, grad_rows.double())
    assert (gm(experts, grad_rows).double() - want).abs().max() <= \
        (permute_backward(experts, grad_rows).double() - want).abs().max()


def test_the_graphs_own_inverse_is_reused_and_one_is_made_where_it_has_none(cpu_counts_as_cuda):
    def both(experts, grad_rows, grad_pairs):  # the inverse exists (the combine's index): no second one
        order = order_of(experts)
        inverse = inverse_of(order)
        pairs = torch.zeros(PAIRS, HIDDEN).index_put((inverse,), grad_pairs, accumulate=True)
        tokens = torch.zeros(TOKENS, HIDDEN).index_put((order // TOP_K,), grad_rows, accumulate=True)
        return pairs, tokens

    args = experts_ids(), fresh(PAIRS, HIDDEN), fresh(PAIRS, HIDDEN)
    gm = rewritten(both, *args, expect=2)
    assert targets(gm).count(aten.scatter.src) == 1
    for got, want in zip(gm(*args), both(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    gm = rewritten(permute_backward, args[0], args[1], expect=1)  # no inverse in the graph: one made
    assert targets(gm).count(aten.scatter.src) == 1


def test_a_narrow_inverse_of_the_graphs_is_not_taken_for_an_index(cpu_counts_as_cuda):
    def int16_inverse_beside(experts, grad_rows):  # int16 "inverse" for some other use: no index
        order = order_of(experts)
        narrow = torch.empty(PAIRS, dtype=torch.int16).scatter(0, order, torch.arange(PAIRS, dtype=torch.int16))
        return permute_backward(experts, grad_rows), narrow

    args = experts_ids(), fresh(PAIRS, HIDDEN)
    gm = rewritten(int16_inverse_beside, *args, expect=1)
    assert targets(gm).count(aten.scatter.src) == 2  # the int16 one and an int64 one made
    for got, want in zip(gm(*args), int16_inverse_beside(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_every_node_made_carries_its_sources_provenance(cpu_counts_as_cuda):
    # (the partitioner reads activation-checkpoint tags and a region's memory budget on every node)
    gm = traced(permute_backward, experts_ids(), fresh(PAIRS, HIDDEN, dtype=torch.bfloat16))
    before = set(gm.graph.nodes)
    for node in before:
        node.meta["custom"] = {"mark": node.name}
    scatter = next(n for n in before if n.target is aten.index_put.default)
    perm = next(n for n in before if n.target is operator.getitem and n.args[1] == 1)
    assert scatters.gather_permuted_scatters(gm.graph) == 1
    made = [n for n in gm.graph.nodes if n not in before]
    inverse_part = {aten.empty.memory_format, torch.ops.prims.iota.default, aten.scatter.src}
    assert len(made) > 3 and {n.target for n in made} >= inverse_part
    for n in made:
        source = perm if n.target in inverse_part else scatter
        assert n.meta["custom"] == {"mark": source.name}, n


def not_a_sort(perm, grad_rows):  # a permutation the graph cannot prove is one
    return torch.zeros(TOKENS, HIDDEN).index_put((perm // TOP_K,), grad_rows, accumulate=True)


def rows_do_not_match(experts, grad_rows):  # n // k is TOKENS, the destination has one row more
    return torch.zeros(TOKENS + 1, HIDDEN).index_put((order_of(experts) // TOP_K,), grad_rows, accumulate=True)


def other_divisor(experts, grad_rows):  # perm // 3 over TOKENS * 4 pairs into 2 * TOKENS rows
    return torch.zeros(2 * TOKENS, HIDDEN).index_put((order_of(experts) // 3,), grad_rows, accumulate=True)


def not_accumulated(experts, grad_rows):  # the last write of each token wins: not a sum
    return torch.zeros(TOKENS, HIDDEN).index_put((order_of(experts) // TOP_K,), grad_rows, accumulate=False)


def sorted_along_rows(experts, grad):  # a 2-D sort's indices are no permutation of the flat range
    return torch.zeros(TOKENS, TOP_K).index_put((torch.sort(experts, dim=1).indices.flatten()[:TOKENS],),
                                                grad, accumulate=True)


def broadcast_values(experts, grad_row):  # one row for all pairs: the values are not (n, hidden)
    return torch.zeros(TOKENS, HIDDEN).index_put((order_of(experts) // TOP_K,), grad_row, accumulate=True)


def broadcast_along_dim_0(experts, values):  # index[i, j] = perm[j]: constant down the scatter's dim
    order = order_of(experts)
    return torch.zeros(PAIRS, PAIRS).scatter_add(0, order.clone().expand(PAIRS, PAIRS), values)


def column_with_a_leading_dim(experts, values):  # index[b, i, h] = perm[i]: an expand that adds dim 0
    order = order_of(experts)
    return torch.zeros(PAIRS, PAIRS, 3).scatter_add(0, order.view(PAIRS, 1).expand(PAIRS, PAIRS, 3), values)


@pytest.mark.parametrize("fn, args", [
    (broadcast_along_dim_0, lambda: (experts_ids(), fresh(PAIRS, PAIRS))),
    (column_with_a_leading_dim, lambda: (experts_ids(), fresh(PAIRS, PAIRS, 3))),
    (not_a_sort, lambda: (torch.randperm(PAIRS), fresh(PAIRS, HIDDEN))),
    (rows_do_not_match, lambda: (experts_ids(), fresh(PAIRS, HIDDEN))),
    (other_divisor, lambda: (experts_ids(), fresh(PAIRS, HIDDEN))),
    (not_accumulated, lambda: (experts_ids(), fresh(PAIRS, HIDDEN))),
    (sorted_along_rows, lambda: (experts_ids(), fresh(TOKENS, TOP_K))),
    (broadcast_values, lambda: (experts_ids(), fresh(HIDDEN))),
])
def test_scatters_not_provably_by_a_permutation_stay(cpu_counts_as_cuda, fn, args):
    args = args()
    gm = traced(fn, *args)
    before = targets(gm)
    assert scatters.gather_permuted_scatters(gm.graph) == 0
    assert targets(gm) == before
    gm.recompile()
    if fn is not not_accumulated:  # (which duplicate's write lands is unspecified)
        torch.testing.assert_close(gm(*args), fn(*args))


def test_off_cuda_nothing_changes():
    gm = traced(permute_backward, experts_ids(), fresh(PAIRS, HIDDEN))  # DEVICE_TYPES unpatched
    assert scatters.gather_permuted_scatters(gm.graph) == 0


ROUTER = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0))


def moe_permute_and_combine(x):
    """The models suite's MoE block without its experts (a pointwise stand-in): router, top-k,
    permute by gather, combine by gather and a weighted sum."""
    weights, experts = torch.nn.functional.linear(x, ROUTER.to(x.dtype)).float().softmax(-1).topk(TOP_K)
    order = order_of(experts)
    rows = torch.tanh(x[order // TOP_K])
    pairs = rows[inverse_of(order)].view(x.shape[0], TOP_K, -1)
    return (pairs.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def test_enable_installs_the_pass_by_default_and_a_compiled_training_step_keeps_its_gradients(
        cpu_counts_as_cuda, monkeypatch):
    counts = []

    def counting(graph):
        counts.append(gather(graph))
        return counts[-1]

    gather = scatters.gather_permuted_scatters
    monkeypatch.setattr(scatters, "gather_permuted_scatters", counting)
    assert inductor_config.joint_custom_pre_pass is None
    with inductor_cute.enable():
        assert inductor_config.joint_custom_pre_pass is scatters.SCATTERS_PASS
        torch._dynamo.reset()
        x = fresh(TOKENS, HIDDEN).requires_grad_()
        with inductor_config.patch(force_disable_caches=True):  # a cached graph would skip the pass
            out = torch.compile(moe_permute_and_combine)(x)
            (grad,) = torch.autograd.grad(out.square().sum(), x)
    assert counts == [2]  # the permute's and the combine's backward
    want = moe_permute_and_combine(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, torch.autograd.grad(want.square().sum(), x)[0], rtol=1e-5, atol=1e-4)
    assert inductor_config.joint_custom_pre_pass is None
    with inductor_cute.enable(moe_scatters=False):
        assert inductor_config.joint_custom_pre_pass is None


def test_a_users_joint_pass_is_kept_by_default_and_refused_when_asked():
    def users_pass(graph):
        return None

    with inductor_config.patch(joint_custom_pre_pass=users_pass):
        with inductor_cute.enable():
            assert inductor_config.joint_custom_pre_pass is users_pass
        with pytest.raises(RuntimeError, match="joint_custom_pre_pass is already set.*moe_scatters"):
            inductor_cute.enable(moe_scatters=True)
