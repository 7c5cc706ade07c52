"""A compiled flex_attention training step on the H200 with inductor_cute.enable(flex_backward=True):
the forward graph runs our forward kernel (prefill, or decode for short queries) and the backward
graph our backward kernels (output code calls a FlexPrefillLauncher / FlexDecodeLauncher and a
FlexBackwardLauncher), and dq, dk, dv match an fp32 reference: causal BlockMask, GQA 4, d64 and
d128, bf16, a query length off the blocks, score_mods (softcap; ALiBi with captured slopes at
MLA's 192/128). With the setting off both graphs stay stock; a loss through the logsumexp, or a
score_mod's captured tensor that needs a gradient, keeps our forward and takes the stock
backward, which reads our out and lse. The allocator is poisoned with NaN first, so a gradient
element never written shows. CPU twin: tests/test_flex_backward_lowering.py."""

import functools
import math

import pytest
import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute

from .test_flex_prefill_gpu import poison_allocator

pytestmark = pytest.mark.gpu
OUR_PREFILL_CALL = "inductor_cute.inductor.flex.runtime.FlexPrefillLauncher("
OUR_DECODE_CALL = "inductor_cute.inductor.flex.runtime.FlexDecodeLauncher("
OUR_BACKWARD_CALL = "inductor_cute.inductor.flex.runtime.FlexBackwardLauncher("


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def causal(b, h, m, n):
    return m >= n


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def training_step(q, k, v, with_lse=False, flex_backward=True, **mods):
    """Compiled flex_attention, loss = sum(w * out) (+ sum(w2 * lse)), loss.backward():
    (dq, dk, dv, the weights, output code of both graphs)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn(*q.shape[:3], v.shape[-1], device="cuda")
    w2 = torch.randn(*q.shape[:3], device="cuda")
    fn = torch.compile(functools.partial(flex_attention, enable_gqa=True, return_lse=with_lse, **mods))

    def step():
        result = fn(*leaves)
        out, lse = result if with_lse else (result, None)
        loss = (out.float() * w).sum() + ((lse * w2).sum() if with_lse else 0)
        poison_allocator(8 * sum(t.numel() for t in leaves) + (1 << 20))
        loss.backward()

    with inductor_cute.enable(flex_decode=True, flex_prefill=True, flex_backward=flex_backward):
        _, codes = run_and_get_code(step)
    return [t.grad for t in leaves], (w, w2 if with_lse else None), "\n".join(codes)


def reference_grads(q, k, v, weights, score_mod=None, mask_mod=None):
    """fp32 autograd of sum(w * softmax(score_mod(q k^T / sqrt(d))) v) (+ sum(w2 * lse), natural log)."""
    w, w2 = weights
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = qf @ kf.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), float("-inf"))
    out = s.softmax(-1) @ vf.repeat_interleave(g, 1)
    loss = (out * w).sum() + ((s.logsumexp(-1) * w2).sum() if w2 is not None else 0)
    loss.backward()
    return [qf.grad, kf.grad, vf.grad]


def assert_grads_match(grads, ref):
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert got is not None and got.shape == want.shape and not got.isnan().any(), f"{name}: NaN or missing"
        err = (got.float() - want).abs().max().item()
        assert err < 2e-2 * max(1.0, want.abs().max().item()), f"{name}: max error {err:.3e}"


CASES = {  # batch, heads, kv heads, q length = kv length, head dim
    "causal GQA 4 d128": (2, 16, 4, 1024, 128),
    "causal GQA 4 d64": (2, 16, 4, 1024, 64),
    "causal GQA 4 d128 L1000": (1, 16, 4, 1000, 128),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_training_step_runs_our_forward_and_backward_and_matches(case):
    batch, heads, kv_heads, length, dim = case
    q, k, v = rand(batch, heads, length, dim), rand(batch, kv_heads, length, dim), rand(batch, kv_heads, length, dim)
    block_mask = create_block_mask(causal, None, None, length, length, device="cuda")
    grads, weights, code = training_step(q, k, v, block_mask=block_mask)
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights, mask_mod=causal))


def test_a_short_query_training_step_runs_our_decode_forward_and_backward():
    q, k, v = rand(2, 16, 64, 128), rand(2, 4, 512, 128), rand(2, 4, 512, 128)
    grads, weights, code = training_step(q, k, v)
    assert code.count(OUR_DECODE_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights))


def test_with_the_setting_off_both_graphs_stay_stock():
    q, k, v = rand(1, 8, 512, 64), rand(1, 2, 512, 64), rand(1, 2, 512, 64)
    block_mask = create_block_mask(causal, None, None, 512, 512, device="cuda")
    grads, weights, code = training_step(q, k, v, flex_backward=False, block_mask=block_mask)
    assert OUR_PREFILL_CALL not in code and OUR_DECODE_CALL not in code and OUR_BACKWARD_CALL not in code
    assert_grads_match(grads, reference_grads(q, k, v, weights, mask_mod=causal))


def test_score_mods_in_training_run_our_kernels():
    # softcap's tanh, and ALiBi's captured slopes (no gradient) at MLA's head dims
    q, k, v = rand(1, 8, 700, 128), rand(1, 2, 700, 128), rand(1, 2, 700, 128)
    block_mask = create_block_mask(causal, None, None, 700, 700, device="cuda")
    grads, weights, code = training_step(q, k, v, score_mod=softcap, block_mask=block_mask)
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights, score_mod=softcap, mask_mod=causal))
    slopes = torch.rand(8, device="cuda")

    def alibi(score, b, h, m, n):
        return score + slopes[h] * (n - m)

    q, k, v = rand(1, 8, 600, 192), rand(1, 8, 600, 192), rand(1, 8, 600, 128)
    block_mask = create_block_mask(causal, None, None, 600, 600, device="cuda")
    grads, weights, code = training_step(q, k, v, score_mod=alibi, block_mask=block_mask)
    assert code.count(OUR_PREFILL_CALL) == 1 and code.count(OUR_BACKWARD_CALL) == 1
    assert_grads_match(grads, reference_grads(q, k, v, weights, score_mod=alibi, mask_mod=causal))


def test_a_captured_tensor_that_needs_a_gradient_takes_the_stock_backward():
    # a learnable (head, key) bias: our forward, the stock backward (it differentiates the bias too).
    # Not a per-head bias: its gradient, the sum of a head's dS, is 0 up to rounding (each row of dS
    # sums to 0), and the H100 measured 0.2 of bf16 rounding against an fp32 reference of 6e-6
    q, k, v = rand(1, 8, 512, 128), rand(1, 2, 512, 128), rand(1, 2, 512, 128)
    bias = torch.randn(8, 512, device="cuda", requires_grad=True)

    def biased(score, b, h, m, n):
        return score + bias[h, n]

    block_mask = create_block_mask(causal, None, None, 512, 512, device="cuda")
    grads, weights, code = training_step(q, k, v, score_mod=biased, block_mask=block_mask)
    assert code.count(OUR_PREFILL_CALL) == 1 and OUR_BACKWARD_CALL not in code
    got_bias_grad, bias.grad = bias.grad, None
    assert_grads_match(grads, reference_grads(q, k, v, weights, score_mod=biased, mask_mod=causal))
    # (the reference's backward filled bias.grad in fp32)
    assert got_bias_grad is not None and not got_bias_grad.isnan().any()
    err = (got_bias_grad - bias.grad).abs().max().item()
    assert err < 2e-2 * max(1.0, bias.grad.abs().max().item()), f"bias grad: max error {err:.3e}"


def test_a_loss_through_the_logsumexp_takes_the_stock_backward_on_our_lse():
    q, k, v = rand(1, 8, 512, 128), rand(1, 2, 512, 128), rand(1, 2, 512, 128)
    block_mask = create_block_mask(causal, None, None, 512, 512, device="cuda")
    grads, weights, code = training_step(q, k, v, with_lse=True, block_mask=block_mask)
    assert code.count(OUR_PREFILL_CALL) == 1 and OUR_BACKWARD_CALL not in code
    assert_grads_match(grads, reference_grads(q, k, v, weights, mask_mod=causal))
