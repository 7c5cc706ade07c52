"""Training graphs through our flex kernels on the CPU (enable(flex_backward=True)): a compiled
training step runs our forward op and our backward op (both call sites in the output code) and
its gradients match an fp32 reference; the forward's and the backward's lowerings see the same
problem and reach the same decision, declines included (a block mask only the forward takes);
score_mods (softcap, ALiBi's captured slopes) and MLA's head dims run our backward; a captured
tensor that needs a gradient takes the stock backward; the setting is opt-in. CPU stand-ins
(tests/flex_support.py) run the ops' contracts in fp32: the backward's from the forward's out and
natural-log lse, so the lse's units are checked too.
GPU twin: tests/gpu/test_flex_backward_lowering_gpu.py."""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.attention.flex_attention as flex_api
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute
from inductor_cute.host import flex as host_flex
from inductor_cute.host import flex_backward as host_backward
from inductor_cute.inductor.flex import backward
from inductor_cute.inductor.flex import lowering as flex
from inductor_cute.inductor.flex.runtime import FlexBackwardLauncher
from inductor_cute.inductor.flex.translate import SizeOperand
from inductor_cute.kernels.common.programs import score as sp

from flex_support import OUR_CALL, OUR_PREFILL_CALL, accept_cpu, decline_reason, hopper  # noqa: F401

OUR_BACKWARD_CALL = "inductor_cute.inductor.flex.runtime.FlexBackwardLauncher("


def _backward_stand_in(q, k, v, out, lse, grad_out, scale, score_mod, score_tensors, mask_mod, mask_tensors,
                       kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                       full_q_num_blocks, full_q_indices, kv_block_size, q_block_size):
    """The backward op's contract in fp32: P from the forward's natural-log lse, delta from its out,
    the score program's derivative by autograd of its reference evaluation; the BlockMask's
    backward lists must list the forward lists' blocks, transposed; a mask of finer blocks than the
    kernels' walked as the host walks it (both list sets coarsened, the states term added)."""
    if kv_num_blocks is not None:
        (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), \
            (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices), mask_mod, mask_tensors, kv_block_size, \
            q_block_size = host_backward.walked_block_masks(
                (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices),
                (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices), mask_mod or None, mask_tensors,
                kv_block_size, q_block_size, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
    mask_mod, mask_dtypes, mask_slots = host_flex._score_mod_operands(mask_mod or None, mask_tensors, q.device, "mask")
    mask_tensors = mask_slots[:len(mask_dtypes)]
    score_mod, score_dtypes, score_slots = host_flex._score_mod_operands(score_mod or None, score_tensors, q.device)
    score_tensors = score_slots[:len(score_dtypes)]
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1:3]
    g = heads // kv_heads
    forward_lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    shape = (batch, heads, q_len, kv_len)
    keep = sp.reference_keep(shape, mask_mod, mask_tensors, forward_lists, kv_block_size, q_block_size)
    if kv_num_blocks is not None:  # the same blocks, each as full (or partial) in both list sets
        backward_lists = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
        for full_only in (False, True):
            fwd, bwd = ((torch.zeros_like(t[0]) if full_only else t[0], *t[1:]) for t in (forward_lists, backward_lists))
            visited = sp.reference_keep(shape, "", (), fwd, kv_block_size, q_block_size)
            visited_t = sp.reference_keep((batch, heads, kv_len, q_len), "", (), bwd, q_block_size, kv_block_size)
            assert torch.equal(visited, visited_t.transpose(-1, -2)), "backward lists disagree with the forward's"
    kf, vf = (t.float().repeat_interleave(g, 1) for t in (k, v))
    raw = (q.float() @ kf.transpose(-1, -2) * scale).requires_grad_()
    scored = raw
    if score_mod:  # (a compiled backward runs with autograd off)
        idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(raw.shape)]
        with torch.enable_grad():
            scored = sp.reference(score_mod, raw, *idx, score_tensors)
    s = scored.detach().masked_fill(~keep, float("-inf"))
    p = (s - lse[..., None]).exp().nan_to_num(0.0)
    do = grad_out.float()
    ds = p * (do @ vf.transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    if score_mod:  # through the score program: dL/draw = dL/dscored * dscored/draw
        (ds,) = torch.autograd.grad(scored, raw, ds)

    def per_kv_head(x):  # and, for k and v of batch 1 shared by the query batches, over those
        x = x.view(batch, kv_heads, g, *x.shape[2:]).sum(2)
        return x.sum(0, keepdim=True) if k.shape[0] == 1 < batch else x

    dq = ds @ kf * scale
    dk = per_kv_head(ds.transpose(-1, -2) @ q.float() * scale)
    dv = per_kv_head(p.transpose(-1, -2) @ do)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@functools.cache
def _register_backward_stand_in():
    backward.register_kernel("cpu", _backward_stand_in)


def _through_the_backward_op(self, *args):
    return torch.ops.inductor_cute.flex_backward.default(*args)


@pytest.fixture
def cpu_training(monkeypatch):
    accept_cpu_training(monkeypatch)


def accept_cpu_training(monkeypatch):
    """cpu_accepted, the backward op's stand-in too, and flex_attention's refusal of CPU gradients lifted."""
    accept_cpu(monkeypatch)
    _register_backward_stand_in()
    monkeypatch.setattr(FlexBackwardLauncher, "call", _through_the_backward_op)
    monkeypatch.setattr(FlexBackwardLauncher, "call_static", _through_the_backward_op)
    monkeypatch.setattr(flex_api, "_validate_device", lambda *args: None)


def _record(monkeypatch, accept: bool) -> list:
    seen = []

    def record(problem):
        seen.append((problem, decline_reason(problem)))
        return None if accept else seen[-1][1]

    monkeypatch.setattr(flex, "decline_reason", record)
    return seen


@pytest.fixture
def decisions(monkeypatch):
    return _record(monkeypatch, accept=False)


@pytest.fixture
def pretended(monkeypatch):
    """Every decision recorded, then taken whatever it said: a declined training call compiles on
    the CPU (the stock lowerings have no CPU training kernel) and both graphs' decisions are seen."""
    return _record(monkeypatch, accept=True)


def qkv(batch=1, heads=4, kv_heads=2, q_len=256, kv_len=256, dqk=64, dv=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, heads, q_len, dqk, generator=g).to(dtype),
            torch.randn(batch, kv_heads, kv_len, dqk, generator=g).to(dtype),
            torch.randn(batch, kv_heads, kv_len, dv, generator=g).to(dtype))


def training_step(q, k, v, flex_prefill=True, dynamic=None, **mods):
    """A compiled flex_attention forward and loss.backward() with enable(flex_backward=True):
    (out, (dq, dk, dv), the output code of both graphs). The loss weighs out by fixed random
    weights, so grad_out is a plain tensor."""
    torch._dynamo.reset()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    weights = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(1))
    fn = torch.compile(functools.partial(flex_attention, enable_gqa=True, **mods), dynamic=dynamic)

    def step():
        out = fn(*leaves)
        (out.float() * weights).sum().backward()
        return out

    with inductor_cute.enable(flex_decode=True, flex_prefill=flex_prefill, flex_backward=True), \
            inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(step)
    torch._dynamo.reset()
    return out, [t.grad for t in leaves], weights, "\n".join(codes)


def reference_grads(q, k, v, weights, mask_mod=None, score_mod=None):
    """fp32 gradients of sum(weights * softmax(q k^T / sqrt(d)) v) (GQA, score_mod and mask_mod densely)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    idx = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), float("-inf"))
    out = s.softmax(-1).nan_to_num(0.0) @ v.repeat_interleave(g, 1)
    (out * weights).sum().backward()
    return out, [q.grad, k.grad, v.grad]


def assert_grads_match(grads, ref):
    for name, got, want in zip("qkv", grads, ref):
        assert got is not None and got.shape == want.shape, name
        err = (got.float() - want).abs().max().item()
        assert err < 2e-2 * max(1.0, want.abs().max().item()), f"d{name}: max error {err:.3e}"


def causal(b, h, m, n):
    return m >= n


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def test_a_training_step_with_a_causal_block_mask_runs_our_forward_and_backward(cpu_training, decisions):
    q, k, v = qkv(q_len=256, kv_len=256, heads=4, kv_heads=2)
    block_mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
    out, grads, weights, code = training_step(q, k, v, block_mask=block_mask)
    assert assert_both_graphs_agree(decisions) is None
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1 and OUR_CALL not in code
    ref_out, ref = reference_grads(q, k, v, weights, causal)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert_grads_match(grads, ref)


def test_a_training_step_under_dynamic_shapes_runs_our_kernels(cpu_training, decisions):
    q, k, v = qkv(q_len=200, kv_len=200, heads=4, kv_heads=2)
    block_mask = create_block_mask(causal, None, None, 200, 200, device="cpu")
    out, grads, weights, code = training_step(q, k, v, dynamic=True, block_mask=block_mask)
    assert assert_both_graphs_agree(decisions) is None
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights, causal)[1])


def test_a_training_step_with_a_bias_of_symbolic_batch_and_length_runs_our_kernels(cpu_training, decisions):
    """dynamic=True with a captured (batch, kv_len) bias: both sizes symbolic, the row stride read
    from the kv_len operand Dynamo captures beside it, in the forward and the backward."""
    q, k, v = qkv(batch=3, q_len=200, kv_len=300, heads=8, kv_heads=2)
    bias = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))

    def biased(s, b, h, m, n):
        return s + bias[b, n]

    out, grads, weights, code = training_step(q, k, v, dynamic=True, score_mod=biased)
    assert assert_both_graphs_agree(decisions) is None
    assert any(isinstance(size, SizeOperand) for c in decisions[0][0].score_buffers for size in c.shape)
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    ref_out, ref = reference_grads(q, k, v, weights, score_mod=biased)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert_grads_match(grads, ref)


@pytest.mark.parametrize("q_len, dynamic, forward", [(16, None, OUR_CALL), (200, True, OUR_PREFILL_CALL)],
                         ids=["decode", "prefill dynamic"])
def test_a_training_step_without_a_block_mask_runs_our_kernels(cpu_training, decisions, q_len, dynamic, forward):
    q, k, v = qkv(q_len=q_len, kv_len=300, heads=8, kv_heads=2)
    out, grads, weights, code = training_step(q, k, v, flex_prefill=forward == OUR_PREFILL_CALL, dynamic=dynamic)
    assert assert_both_graphs_agree(decisions) is None
    assert decisions[0][0].keys_all_in_blocks  # both see flex_attention's "no block mask"
    other = OUR_PREFILL_CALL if forward == OUR_CALL else OUR_CALL
    assert code.count(forward) == 1 and code.count(OUR_BACKWARD_CALL) == 1 and other not in code
    assert_grads_match(grads, reference_grads(q, k, v, weights)[1])


def assert_both_graphs_agree(seen) -> str | None:
    """The forward's and the backward's lowerings saw the same call and decided the same: returns the reason."""
    (fwd, fwd_reason), (bwd, bwd_reason) = seen
    graphs = ("score_graph", "mask_graph")
    plain = [f.name for f in dataclasses.fields(flex.FlexProblem) if f.name not in graphs]
    assert {n: getattr(fwd, n) for n in plain} == {n: getattr(bwd, n) for n in plain}
    assert fwd.translated == bwd.translated and not fwd.inference
    assert fwd_reason == bwd_reason
    return fwd_reason


CAUSAL_256 = functools.partial(create_block_mask, causal, None, None, 256, 256, device="cpu")
DECLINED = {  # qkv's arguments, the call's mods, what the reason says (the forward alone would take it)
    "head dims 256/256": ({"dqk": 256, "dv": 256}, lambda: {"block_mask": CAUSAL_256()}, "backward: head dims 256/256"),
}


@pytest.mark.parametrize("block_size", [64, (256, 64), (64, 128), (32, 64)])
def test_a_training_step_with_finer_blocks_than_the_kernels_runs_our_kernels(cpu_training, decisions, block_size):
    """BLOCK_SIZE 64 and mixed: the forward walks the mask at its blocks and the backward at 128 x 128,
    both lists coarsened from the forward's with the states term (the stand-ins run the hosts' walks)."""
    q, k, v = qkv(batch=2, q_len=300, kv_len=300, heads=4, kv_heads=2)
    block_mask = create_block_mask(causal, 2, None, 300, 300, device="cpu", BLOCK_SIZE=block_size)
    out, grads, weights, code = training_step(q, k, v, block_mask=block_mask)
    assert assert_both_graphs_agree(decisions) is None
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    ref_out, ref = reference_grads(q, k, v, weights, causal)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert_grads_match(grads, ref)


@pytest.mark.parametrize("case", DECLINED.values(), ids=DECLINED.keys())
def test_what_the_backward_declines_the_forward_declines_too(cpu_training, pretended, case):
    sizes, mods, reason = case
    training_step(*qkv(**sizes), **mods())
    assert reason in assert_both_graphs_agree([(dataclasses.replace(p, device=torch.device("cuda", 0)), r)
                                               for p, r in pretended])


def test_both_graphs_agree_on_a_call_they_take(cpu_training, pretended):
    training_step(*qkv(), block_mask=CAUSAL_256())
    assert assert_both_graphs_agree(pretended) is None


@pytest.fixture(scope="module")
def training_problem() -> flex.FlexProblem:
    """The problem a training graph's forward saw for a causal BlockMask call (GQA 2, d64, bf16)."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        accept_cpu_training(monkeypatch)
        seen = _record(monkeypatch, accept=True)
        training_step(*qkv(), block_mask=CAUSAL_256())
    finally:
        monkeypatch.undo()
    return dataclasses.replace(seen[0][0], device=torch.device("cuda", 0))


@pytest.mark.parametrize("change, reason", [
    (dict(flex_backward=False), "opt-in: enable(flex_backward=True)"),
    (dict(dtypes=(torch.float32,) * 3), "backward: dtype float32"),
    (dict(head_dim_qk=256, head_dim_v=256), "backward: head dims 256/256"),
    (dict(block_sizes=(128, 96)), "backward block mask: block mask query block size 96"),
    (dict(block_sizes=(64, 64), mask_buffers=(None,) * 4), "backward block mask: 64 x 64 blocks"),
    (dict(backward_lists_ok=False), "backward lists"),
    (dict(flex_prefill=False), "prefill kernel is opt-in"),  # the forward's kernel is on offer for training too
])
def test_training_calls_are_declined_with_the_reason(training_problem, hopper, change, reason):
    assert decline_reason(training_problem) is None
    assert reason in decline_reason(dataclasses.replace(training_problem, **change))


def test_head_dims_not_yet_checked_on_a_gpu_keep_training_stock(training_problem, hopper, monkeypatch):
    from inductor_cute.kernels.attention import flex_backward_config as fbc

    monkeypatch.setattr(fbc, "GPU_UNCHECKED_HEAD_DIMS", {(64, 64)})  # the problem's head dims
    assert decline_reason(training_problem) == "backward: head dims 64/64 are not yet checked on a GPU"


def test_a_training_step_with_k_and_v_shared_by_the_query_batches_runs_our_kernels(cpu_training, decisions):
    # one K/V of batch 1 for every query batch (PyTorch's tests make such calls): dk and dv of
    # batch 1 sum over the query batches, as autograd of the broadcast does
    q, k, v = qkv(batch=3, q_len=256, kv_len=256)
    k, v = k[:1], v[:1]
    # (flex_attention wants a block mask of the query batch when k and v have another)
    mask = create_block_mask(causal, 3, None, 256, 256, device="cpu")
    out, grads, weights, code = training_step(q, k, v, block_mask=mask)
    assert OUR_PREFILL_CALL in code and OUR_BACKWARD_CALL in code
    assert decisions and all(reason is None for _, reason in decisions)
    assert all(p.kv_batch_broadcast for p, _ in decisions)
    ref_out, ref = reference_grads(q, k, v, weights, causal)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    assert_grads_match(grads, ref)


def test_inference_calls_ignore_the_backward_limits(training_problem, hopper):
    """Inference is decided as before: no backward setting, lists or head dims of the backward."""
    inference = dataclasses.replace(training_problem, inference=True, flex_backward=False, backward_lists_ok=False,
                                    head_dim_qk=192, head_dim_v=128)
    assert decline_reason(inference) is None


def test_the_backward_op_fake_gives_each_gradient_its_input_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.empty(2, 8, 100, 64), torch.empty(2, 2, 300, 64), torch.empty(2, 2, 300, 64)
        out, lse = torch.empty(2, 8, 100, 64), torch.empty(2, 8, 100)
        dq, dk, dv = torch.ops.inductor_cute.flex_backward(q, k, v, out, lse, out, 0.125, "", [], "", [], *[None] * 8, 0, 0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_a_training_step_with_a_score_mod_runs_our_kernels(cpu_training, decisions):
    # softcap's tanh differentiated by our backward (programs/score_grad.py), over a causal BlockMask
    q, k, v = qkv(q_len=256, kv_len=256, heads=4, kv_heads=2)
    out, grads, weights, code = training_step(q, k, v, score_mod=softcap, block_mask=CAUSAL_256())
    assert assert_both_graphs_agree(decisions) is None
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert "score_mod=''" not in code.split(OUR_BACKWARD_CALL)[1].split(")")[0]  # the program reaches it
    ref_out, ref = reference_grads(q, k, v, weights, causal, softcap)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert_grads_match(grads, ref)


def test_a_score_mod_with_a_captured_tensor_and_head_dims_192_128_in_training(cpu_training, decisions):
    # ALiBi's slopes (captured, no gradient) reach the backward op as a tensor; MLA's head dims
    slopes = torch.rand(4)

    def alibi(score, b, h, m, n):
        return score + slopes[h] * (n - m)

    q, k, v = qkv(q_len=256, kv_len=256, heads=4, kv_heads=4, dqk=192, dv=128)
    out, grads, weights, code = training_step(q, k, v, score_mod=alibi, block_mask=CAUSAL_256())
    assert assert_both_graphs_agree(decisions) is None
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights, causal, alibi)[1])


def _joint_graph(captured_grads: list) -> object:
    """A stand-in of the backward HOP's joint graph: outputs (grad of score, four index grads,
    then one per captured tensor: a node where it needs a gradient, None where not)."""
    import types

    graph = torch.fx.Graph()
    score = graph.placeholder("score")
    grads = [graph.call_function(torch.neg, (score,)) if needs else None for needs in captured_grads]
    graph.output([score, None, None, None, None, *grads])
    return types.SimpleNamespace(graph_module=torch.fx.GraphModule(torch.nn.Module(), graph))


def test_a_captured_tensor_that_needs_a_gradient_takes_the_stock_backward():
    # our kernels compute no gradient for a score_mod's captured tensor (a learnable bias, say):
    # the backward's lowering alone sees that (the forward keeps ours: the stock backward reads
    # our out and lse as its own)
    assert backward._captured_gradient_reason(_joint_graph([]), 0) is None
    assert backward._captured_gradient_reason(_joint_graph([False, False]), 2) is None
    assert "needs a gradient" in backward._captured_gradient_reason(_joint_graph([False, True]), 2)
    assert "could not be read" in backward._captured_gradient_reason(object(), 1)


def test_prescale_qk_with_a_score_mod_leaves_a_training_call_stock(monkeypatch, hopper):
    # the stock backward (taken alone for a captured tensor needing a gradient) would apply the
    # score_mod to prescaled scores, which our forward did not: both graphs stay stock
    accept_cpu_training(monkeypatch)
    seen = _record(monkeypatch, accept=True)
    training_step(*qkv(), score_mod=softcap, block_mask=CAUSAL_256())
    problem = dataclasses.replace(seen[0][0], device=torch.device("cuda", 0))
    assert decline_reason(problem) is None
    assert "PRESCALE_QK" in decline_reason(dataclasses.replace(problem, kernel_options={"PRESCALE_QK": True}))
    assert decline_reason(dataclasses.replace(problem, inference=True, kernel_options={"PRESCALE_QK": True})) is None
