"""The gate's backward fusion (inductor/grouped/gate_grad.py) on the CPU: in a compiled training step
of MoE experts (grouped_mm up projection, silu(gate) * up, grouped_mm down projection), autograd's
SiLU-and-mul backward after the down projection's input gradient becomes one grouped_mm_gate_grad
call where the kernel serves it, the gradients stay the unfused ones, and nothing changes for
other activations; its lowering autotunes our configs against the unfused computation. CPU
tensors stand in for CUDA ones (`gate.DEVICE_TYPES` patched); the op then computes unfused.
GPU runs of the kernel: tests/gpu/test_grouped_gate_grad_gpu.py."""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute
from inductor_cute.inductor.grouped import gate, gate_grad, runtime
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates

BF16 = torch.bfloat16
E, F_, K, T = 3, 64, 32, 40


def experts(x, w_gate_up, w_down, offs, act=F.silu):
    """transformers' grouped_mm experts: weights held (E, out, in), chunked gate|up."""
    gate_, up = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate_) * up, w_down.transpose(1, 2), offs=offs)


def split_experts(x, w_gate_up, w_down, offs):
    """torchtitan-style: the fused weight held (E, in, out), split in named halves."""
    h = torch._grouped_mm(x, w_gate_up, offs=offs)
    gate_, up = torch.split(h, [F_, F_], dim=-1)
    return torch._grouped_mm(F.silu(gate_) * up, w_down.transpose(1, 2), offs=offs)


def gelu_experts(x, w_gate_up, w_down, offs):
    return experts(x, w_gate_up, w_down, offs, act=lambda t: F.gelu(t, approximate="tanh"))


def params(held="out-in", f=F_):
    torch.manual_seed(0)
    x = torch.randn(T, K).to(BF16).requires_grad_()
    w_gu = torch.randn(*((E, 2 * f, K) if held == "out-in" else (E, K, 2 * f))).div(6).to(BF16).requires_grad_()
    w_down = torch.randn(E, K, f).div(8).to(BF16).requires_grad_()
    return x, w_gu, w_down, torch.tensor([10, 10, T], dtype=torch.int32)  # an empty group


def looped_grads(fn, x, w_gu, w_down, offs, grad):
    """The gradients in fp32, one matmul per group (the reference: CPU autograd of _grouped_mm
    is not what is being tested)."""
    def grouped(a, b, offs):
        starts = [0, *offs.tolist()[:-1]]
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])

    leaves = [t.detach().float().requires_grad_() for t in (x, w_gu, w_down)]
    original = torch._grouped_mm
    try:
        torch._grouped_mm = lambda a, b, offs=None: grouped(a, b, offs)
        fn(*leaves, offs).backward(grad.float())
    finally:
        torch._grouped_mm = original
    return [t.grad for t in leaves]


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(gate, "DEVICE_TYPES", ("cuda", "cpu"))


def compiled_step(fn, args, dynamic_tokens=False, **enable_kwargs):
    """(gradients, output code of every graph) of one compiled step of fn on args."""
    x, w_gu, w_down, offs = args
    torch._dynamo.reset()
    for t in (x, w_gu, w_down):
        t.grad = None
    # (no cached graphs: an earlier test's compile of the same function counted CPU as CUDA)
    with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False), \
            inductor_cute.enable(**enable_kwargs):
        def step():
            if dynamic_tokens:  # as Dynamo marks a size that changed between calls
                torch._dynamo.mark_dynamic(x, 0)
            out = torch.compile(fn)(x, w_gu, w_down, offs)
            out.backward(torch.ones_like(out))
        _, codes = run_and_get_code(step)
    return [t.grad.clone() for t in (x, w_gu, w_down)], "\n".join(codes)


@pytest.mark.parametrize("fn,held", [(experts, "out-in"), (split_experts, "in-out")])
def test_the_backward_fuses_the_gates_gradient_into_the_down_projections(cpu_counts_as_cuda, fn, held):
    args = params(held)
    grads, code = compiled_step(fn, args, fuse_moe_gate=True)
    assert "torch.ops.inductor_cute.grouped_mm_gate_grad.default(" in code
    assert "silu_backward" not in code  # no pointwise kernel of it left
    want = looped_grads(fn, *args, torch.ones(T, K))
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)


def test_a_dynamic_token_count_is_fused_too(cpu_counts_as_cuda):
    args = params()
    grads, code = compiled_step(experts, args, dynamic_tokens=True, fuse_moe_gate=True)
    assert "torch.ops.inductor_cute.grouped_mm_gate_grad.default(" in code
    for got, ref in zip(grads, looped_grads(experts, *args, torch.ones(T, K))):
        torch.testing.assert_close(got.float(), ref, atol=0.1, rtol=0.05)


def test_without_the_switch_or_for_another_activation_nothing_changes(cpu_counts_as_cuda):
    _, code = compiled_step(experts, params(), fuse_moe_gate=False)
    assert "grouped_mm_gate_grad" not in code
    _, code = compiled_step(gelu_experts, params(), fuse_moe_gate=True)
    assert "grouped_mm_gate_grad" not in code


def test_widths_the_kernel_cannot_split_stay_unfused(cpu_counts_as_cuda, caplog):
    with caplog.at_level("INFO", logger="inductor_cute"):
        _, code = compiled_step(experts, params(f=40), fuse_moe_gate=True)  # F = 40: not 32-aligned
    assert "grouped_mm_gate_grad" not in code and "multiple of 32" in caplog.text


def test_nothing_is_fused_off_cuda():
    _, code = compiled_step(experts, params(), fuse_moe_gate=True)
    assert "grouped_mm_gate_grad" not in code


def test_the_op_runs_our_kernel_or_computes_unfused(cpu_counts_as_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(runtime.host_grouped, "grouped_mm_gate_grad",
                        lambda *args, config=None: calls.append(args) or "ours")
    a, w, offs, h = torch.randn(T, K).to(BF16), torch.randn(E, K, F_).to(BF16), params()[3], torch.randn(T, 2 * F_)
    gate_, up = h.to(BF16).chunk(2, dim=-1)
    assert gate_grad.grouped_mm_gate_grad_op(a, w, offs, gate_, up, "silu") == "ours"
    assert calls[0][0] is a and calls[0][3] is gate_ and calls[0][4] is up and calls[0][5] == "silu"

    def refuse(*args, **kwargs):
        raise inductor_cute.UnsupportedError("an unaligned pointer")

    monkeypatch.setattr(runtime.host_grouped, "grouped_mm_gate_grad", refuse)
    got = gate_grad.grouped_mm_gate_grad_op(a, w, offs, gate_, up, "silu")
    hh = h.to(BF16).float().requires_grad_()
    g32, u32 = hh.chunk(2, dim=-1)
    (F.silu(g32) * u32).backward(torch._grouped_mm(a, w, offs=offs).float())
    torch.testing.assert_close(got.float(), hh.grad, atol=5e-2, rtol=2e-2)


def test_the_launcher_runs_the_gate_gradient_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime.host_grouped, "grouped_mm_gate_grad",
                        lambda *args, config: calls.append((args, config)))
    config = runtime.as_tuple(GroupedConfig(128, 256, 64, 4, 2))
    a, b, offs, gate_, up, out = (torch.empty(1),) * 6
    runtime.grouped_mm_gate_grad(a, b, offs, gate_, up, out=out, config=config, activation="silu", gate_grad=True)
    (args, cfg), = calls
    assert args == (a, b, offs, gate_, up, "silu", out) and cfg == GroupedConfig(128, 256, 64, 4, 2)


def test_the_lowering_autotunes_our_configs_against_the_unfused_computation(monkeypatch):
    from test_grouped_lowering import lower, record_gated_selects

    def fused(a, w, offs, gate_, up):  # w (E, hidden, F): the down weight as nn.Linear holds it, N-major
        return gate_grad.OP(a, w, offs, gate_, up, "silu")

    tokens, hidden, f = 512, 256, 128
    specs = [((tokens, hidden), BF16), ((E, hidden, f), BF16), ((E,), torch.int32), ((tokens, f), BF16),
             ((tokens, f), BF16)]
    recorded = record_gated_selects(monkeypatch)
    _, code = lower(fused, specs, codegen=True, enable_kwargs={"fuse_moe_gate": True})
    (name, choices, kwargs, layout), = recorded
    problem = GroupedProblem("bfloat16", "bfloat16", "k", "n", gate_grad="silu")
    want = candidates(problem, tokens, f, hidden, E, 132)
    assert name == "grouped_mm_gate_grad" and want
    unfused, *ours = choices
    assert unfused.choice.name == "inductor_cute_grouped_mm_unfused"
    assert unfused.kwargs == {"activation": "silu", "gate_grad": True}
    assert [c.kwargs["config"] for c in ours] == [runtime.as_tuple(cfg) for cfg in want]
    assert all(c.problem == problem and c.kwargs["gate_grad"] for c in ours)
    assert list(layout.size) == [tokens, 2 * f]
    node = SimpleNamespace(get_device=lambda: torch.device("cpu"), get_dtype=lambda: torch.int32)
    offs = kwargs["input_gen_fns"][2](node)  # the offsets are the third input here
    assert offs[-1] == tokens and len(set(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())) > 1
    assert re.search(r"GroupedLauncher\(config=\(.*\), activation='silu'\)\.launch_gate_grad", code)


def test_the_unfused_choice_computes_what_the_op_does():
    a, w, offs = torch.randn(T, K).to(BF16), torch.randn(E, K, F_).to(BF16), params()[3]
    gate_, up = torch.randn(T, 2 * F_).to(BF16).chunk(2, dim=-1)
    out = torch.full((T, 2 * F_), float("nan"), dtype=BF16)
    runtime.grouped_mm_unfused(a, w, offs, gate_, up, out=out, activation="silu", gate_grad=True)
    assert torch.equal(out, runtime.unfused_gate_grad(a, w, offs, gate_, up, "silu"))


def test_the_pass_leaves_a_users_pre_pass_alone():
    def users_pass(graph):
        return None

    with inductor_config.patch(post_grad_custom_pre_pass=users_pass):
        with pytest.raises(RuntimeError, match="post_grad_custom_pre_pass is already set"):
            inductor_cute.enable(fuse_moe_gate=True)
