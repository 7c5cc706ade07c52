"""inductor/gemm/shared_a.py on the CPU: the post-grad pass that turns the decode mm's sharing
their activation (q/k/v, gate/up) into one gemv_shared_a call, on graphs traced with fake CUDA
tensors; the op's fallback for what only real tensors show; enable(group_gemv=True)'s config."""

import hashlib
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.source import ConstantSource
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import inductor_cute
from inductor_cute.inductor import install
from inductor_cute.inductor.gemm import shared_a

BF16 = torch.bfloat16
MM = torch.ops.aten.mm.default
K = 64


def trace(fn, x_shape, ns, dtype=BF16, k=K, symbolic_m=False):
    """fn's graph as Inductor decomposes it, on fake CUDA tensors x (x_shape) and weights (n, k)."""
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        if symbolic_m:
            x_shape = (env.create_symintnode(env.create_symbol(x_shape[0], ConstantSource("m")), hint=x_shape[0]),
                       *x_shape[1:])
        x = torch.empty(x_shape, dtype=dtype, device="cuda")
        weights = [torch.empty(n, k, dtype=dtype, device="cuda") for n in ns]
        gm = make_fx(fn, decomposition_table=select_decomp_table())(x, *weights)
    gm.graph.eliminate_dead_code()  # the decompositions leave unused casts
    return gm


def linears(x, *weights):
    return tuple(F.linear(x, w) for w in weights)


def calls(gm, target):
    return gm.graph.find_nodes(op="call_function", target=target)


@pytest.fixture
def cpu_op():
    """The op on CPU tensors as the reference matmul (fp32 accumulation), for running graphs here."""
    lib = torch.library.Library("inductor_cute", "IMPL")
    lib.impl("gemv_shared_a", lambda a, ws: [(a.float() @ w.float().t()).to(a.dtype) for w in ws], "CPU")
    yield
    lib._destroy()


def run(gm, x_shape, ns, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(x_shape, generator=g).to(BF16)] + [torch.randn(n, K, generator=g).to(BF16) for n in ns]
    return gm(*args), args


def test_qkv_becomes_one_call_with_three_getitems(cpu_op):
    ns = (32, 16, 16)
    gm = trace(linears, (8, K), ns)
    expected, args = run(gm, (8, K), ns)
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    (call,) = calls(gm, shared_a.OP)
    x_node, *weight_nodes = gm.graph.find_nodes(op="placeholder")
    assert call.args == (x_node, weight_nodes)
    items = calls(gm, operator.getitem)
    assert [i.args for i in items] == [(call, 0), (call, 1), (call, 2)]
    assert [tuple(i.meta["val"].shape) for i in items] == [(8, n) for n in ns]
    assert all(i.meta["val"].dtype == BF16 and i.meta["val"].device.type == "cuda" for i in items)
    assert [tuple(v.shape) for v in call.meta["val"]] == [(8, n) for n in ns]
    assert not calls(gm, MM) and not calls(gm, torch.ops.aten.permute.default)  # mm's and transposes gone
    got = gm(*args)
    x, *weights = args
    for out, ref, w in zip(got, expected, weights):
        reference = x.double() @ w.double().t()
        torch.testing.assert_close(out.double(), reference, atol=2e-2 * reference.abs().max().item(), rtol=0)
        assert out.shape == ref.shape and out.dtype == ref.dtype


def test_gate_up_pair_is_grouped_in_fp16_too():
    gm = trace(linears, (1, K), (128, 128), dtype=torch.float16)
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    (call,) = calls(gm, shared_a.OP)
    assert len(call.args[1]) == 2 and len(calls(gm, operator.getitem)) == 2


def test_four_siblings_make_a_group_of_three_and_leave_one_mm(cpu_op):
    ns = (32, 16, 16, 8)
    gm = trace(linears, (16, K), ns)
    expected, args = run(gm, (16, K), ns)
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    (call,) = calls(gm, shared_a.OP)
    (left,) = calls(gm, MM)
    assert [w.meta["val"].shape[0] for w in call.args[1]] == [32, 16, 16]  # the first three in graph order
    assert left.args[1].args[0].meta["val"].shape[0] == 8
    for out, ref in zip(gm(*args), expected):
        torch.testing.assert_close(out.float(), ref.float(), atol=0.1, rtol=0.02)


def test_five_siblings_make_groups_of_three_and_two():
    gm = trace(linears, (8, K), (8, 16, 24, 32, 40))
    assert shared_a.group_shared_a_mms(gm.graph) == 2
    gm.graph.lint()
    assert sorted(len(c.args[1]) for c in calls(gm, shared_a.OP)) == [2, 3] and not calls(gm, MM)


def test_llama_qkv_is_grouped_but_its_gate_up_weights_are_too_large():
    # Llama-3.1-8B at M = 8: q/k/v 32 + 8 + 8 MiB, gate/up 112 MiB each (above MAX_WEIGHT_BYTES)
    assert shared_a.group_shared_a_mms(trace(linears, (8, 4096), (4096, 1024, 1024), k=4096).graph) == 1
    gm = trace(linears, (8, 4096), (14336, 14336), k=4096)
    assert shared_a.group_shared_a_mms(gm.graph) == 0 and len(calls(gm, MM)) == 2


def test_mms_of_different_activations_are_not_grouped():
    def two_inputs(x, wq, wk):
        return F.linear(x, wq), F.linear(x + 1, wk)

    gm = trace(two_inputs, (8, K), (32, 16))
    before = str(gm.graph)
    assert shared_a.group_shared_a_mms(gm.graph) == 0
    assert str(gm.graph) == before


@pytest.mark.parametrize("case", ["M=32", "M=0", "fp32", "symbolic M", "N not a multiple of 8", "K not a multiple of 8",
                                  "transposed x"])
def test_what_the_grouped_gemv_cannot_take_is_left_alone(case):
    x_shape, ns, kwargs, fn = (8, K), (32, 16, 16), {}, linears
    if case == "M=32":
        x_shape = (32, K)
    elif case == "M=0":
        x_shape = (0, K)
    elif case == "fp32":
        kwargs = {"dtype": torch.float32}
    elif case == "symbolic M":
        kwargs = {"symbolic_m": True}
    elif case == "N not a multiple of 8":
        ns = (32, 12)  # the one mm that fits has no partner
    elif case == "K not a multiple of 8":
        x_shape, kwargs = (8, 60), {"k": 60}
    elif case == "transposed x":  # x.t() of a (K, M) input: column-major A
        x_shape, fn = (K, 8), lambda x, *ws: linears(x.t(), *ws)
    gm = trace(fn, x_shape, ns, **kwargs)
    assert calls(gm, MM)
    before = str(gm.graph)
    assert shared_a.group_shared_a_mms(gm.graph) == 0
    assert str(gm.graph) == before


def test_decode_hidden_states_viewed_once_per_projection_are_grouped(cpu_op):
    """Llama decode: x (B, 1, D). Inductor's decomposition gives each linear its own (B, D) reshape
    of x, and the post-grad graph keeps them apart: views of one node to one shape count as one x."""
    ns = (32, 16, 16)
    gm = trace(linears, (8, 1, K), ns)
    expected, args = run(gm, (8, 1, K), ns)
    views = {mm.args[0] for mm in calls(gm, MM)}
    assert len(views) == 3 and len({v.args[0] for v in views}) == 1  # one view each, of the same x
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    (call,) = calls(gm, shared_a.OP)
    assert call.args[0] in views and len(calls(gm, call.args[0].target)) == 1 + 3  # the others' views gone
    for out, ref in zip(gm(*args), expected):
        assert out.shape == ref.shape == (8, 1, ref.shape[-1])
        torch.testing.assert_close(out.float(), ref.float(), atol=0.1, rtol=0.02)


def test_a_transpose_with_other_users_stays():
    def reused(x, wq, wk):
        return F.linear(x, wq), F.linear(x, wk), wq.t() * 2

    gm = trace(reused, (8, K), (32, 16))
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    (permute,) = calls(gm, torch.ops.aten.permute.default)
    assert permute.args[0].name == "wq_1" and not calls(gm, MM)


def test_constant_weights_defined_after_the_first_mm_move_before_the_call():
    """Frozen parameters are get_attr nodes, which may come where they are first used: after the first mm."""
    gm = trace(linears, (4, K), (32, 16, 16))
    for i, w in enumerate(gm.graph.find_nodes(op="placeholder")[1:]):
        gm.register_buffer(f"weight{i}", w.meta["val"])
        with gm.graph.inserting_before(next(iter(w.users))):
            constant = gm.graph.get_attr(f"weight{i}")
        constant.meta["val"] = w.meta["val"]
        w.replace_all_uses_with(constant)
        gm.graph.erase_node(w)
    gm.graph.lint()
    first_mm = calls(gm, MM)[0]
    nodes = list(gm.graph.nodes)
    assert sum(n.op == "get_attr" and nodes.index(n) > nodes.index(first_mm) for n in nodes) == 2
    assert shared_a.group_shared_a_mms(gm.graph) == 1
    gm.graph.lint()
    (call,) = calls(gm, shared_a.OP)
    assert [w.target for w in call.args[1]] == ["weight0", "weight1", "weight2"]


def test_the_pass_is_a_custom_graph_pass_keyed_on_this_modules_source():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    assert isinstance(shared_a.GROUP_GEMV_PASS, CustomGraphPass)
    uuid = shared_a.GROUP_GEMV_PASS.uuid()
    assert uuid == shared_a.GroupGemvPass().uuid() == hashlib.sha256(Path(shared_a.__file__).read_bytes()).hexdigest()
    gm = trace(linears, (8, K), (32, 16))
    shared_a.GROUP_GEMV_PASS(gm.graph)
    assert len(calls(gm, shared_a.OP)) == 1


def test_fake_impl_gives_empty_outputs_in_as_dtype():
    with FakeTensorMode():
        a = torch.empty(8, K, dtype=torch.float16, device="cuda")
        outs = torch.ops.inductor_cute.gemv_shared_a(a, [torch.empty(n, K, dtype=torch.float16, device="cuda")
                                                         for n in (24, 8)])
    assert [(tuple(o.shape), o.dtype, o.device.type) for o in outs] == [((8, 24), torch.float16, "cuda"),
                                                                        ((8, 8), torch.float16, "cuda")]


# ---- the op's CUDA implementation, called directly on CPU tensors (every kernel a recorder)

def test_op_impl_runs_one_launch(cpu_gemm_kernels):
    a = torch.randn(8, K, dtype=BF16)
    outs = shared_a.gemv_shared_a_op(a, [torch.randn(n, K, dtype=BF16) for n in (32, 16, 16)])
    assert len(cpu_gemm_kernels.launches) == 1 and [tuple(o.shape) for o in outs] == [(8, 32), (8, 16), (8, 16)]


def test_op_impl_falls_back_to_mm_for_what_the_kernel_cannot_take(cpu_gemm_kernels):
    storage = torch.randn(8 * K + 1, dtype=BF16)
    a = storage[1:].view(8, K)  # 2-byte offset: rows not 16-byte aligned, only known on real tensors
    weights = [torch.randn(n, K, dtype=BF16) for n in (32, 16)]
    outs = shared_a.gemv_shared_a_op(a, weights)
    assert not cpu_gemm_kernels.launches
    for out, w in zip(outs, weights):
        torch.testing.assert_close(out, torch.mm(a, w.t()))


# ---- enable(group_gemv=True)

@pytest.fixture
def no_user_pass():
    assert inductor_config.post_grad_custom_post_pass is None and not install._saved
    yield
    while install._saved:
        inductor_cute.disable()
    assert inductor_config.post_grad_custom_post_pass is None


def test_enable_group_gemv_sets_the_pass_and_disable_restores(no_user_pass):
    with inductor_cute.enable():  # on by default
        assert inductor_config.post_grad_custom_post_pass is shared_a.GROUP_GEMV_PASS
    assert inductor_config.post_grad_custom_post_pass is None
    with inductor_cute.enable(group_gemv=False):
        assert inductor_config.post_grad_custom_post_pass is None
    with inductor_cute.enable(group_gemv=True):
        assert inductor_config.post_grad_custom_post_pass is shared_a.GROUP_GEMV_PASS
        from torch._inductor.virtualized import V

        assert V.choices.settings.group_gemv
        with inductor_cute.enable(group_gemv=True):  # nesting keeps ours
            assert inductor_config.post_grad_custom_post_pass is shared_a.GROUP_GEMV_PASS
        with inductor_cute.enable(group_gemv=False):  # a level without it has none
            assert inductor_config.post_grad_custom_post_pass is None
        assert inductor_config.post_grad_custom_post_pass is shared_a.GROUP_GEMV_PASS
    assert inductor_config.post_grad_custom_post_pass is None


def test_enable_refuses_to_replace_a_users_pass(no_user_pass):
    def users_pass(graph):
        pass

    with inductor_config.patch(post_grad_custom_post_pass=users_pass):
        with pytest.raises(RuntimeError, match="post_grad_custom_post_pass is already set"):
            inductor_cute.enable(group_gemv=True)
        assert not install._saved and inductor_config.post_grad_custom_post_pass is users_pass
        with inductor_cute.enable():  # the default leaves the user's pass in place and groups nothing
            assert inductor_config.post_grad_custom_post_pass is users_pass
            from torch._inductor.virtualized import V

            assert not V.choices.settings.group_gemv
        assert inductor_config.post_grad_custom_post_pass is users_pass


def _decomposed_with_coordinate_descent(ns, m):
    with inductor_config.patch(coordinate_descent_tuning=True):
        return trace(linears, (m, K), ns)


def test_keep_m1_mm_leaves_batch_1_products_for_autotuning_and_grouping(no_user_pass):
    # stock: under coordinate descent an M = 1 mm becomes mul + sum before lowering
    stock = _decomposed_with_coordinate_descent((128, 32, 32), 1)
    assert not calls(stock, MM) and calls(stock, torch.ops.aten.sum.dim_IntList)
    with inductor_cute.enable(keep_m1_mm=True):
        kept = _decomposed_with_coordinate_descent((128, 32, 32), 1)
        assert len(calls(kept, MM)) == 3 and not calls(kept, torch.ops.aten.sum.dim_IntList)
        assert shared_a.group_shared_a_mms(kept.graph) == 1  # and the three are one grouped call
        with inductor_config.patch(coordinate_descent_tuning=True):  # fp32 keeps Inductor's reduction
            assert calls(trace(linears, (1, K), (128,), dtype=torch.float32), torch.ops.aten.sum.dim_IntList)
    again = _decomposed_with_coordinate_descent((128, 32, 32), 1)  # disable() put the decomposition back
    assert not calls(again, MM) and calls(again, torch.ops.aten.sum.dim_IntList)
