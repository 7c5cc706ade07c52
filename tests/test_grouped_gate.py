"""The MoE gate fusion pass (inductor/grouped/gate.py) on the CPU: on graphs traced as Inductor
traces them (fake tensors, its decompositions), act(gate) * up of a fused gate_up grouped_mm
becomes one grouped_mm_gated call where the kernel serves it, and nothing changes where it does
not; torch.compile with enable(fuse_moe_gate=True) emits the call; enable() installs and removes
the pass. CPU tensors stand in for CUDA ones (`DEVICE_TYPES` patched), and the op then computes
unfused, so results are compared with the function as written.
GPU runs of the kernel: tests/gpu/test_grouped_gemm_gpu.py (gated)."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import inductor_cute
from inductor_cute.host import grouped_gemm as host_grouped
from inductor_cute.inductor.grouped import gate
from inductor_cute.inductor.grouped.moe_pass import moe_pass

BF16 = torch.bfloat16
E, F_, K = 3, 48, 64  # experts, expert FFN width (half the fused weight's rows), hidden


def transformers_experts(x, w_gate_up, offs):
    """transformers' grouped_mm experts: w (E, 2F, K) transposed, chunk, act(gate) * up."""
    gate_, up = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
    return F.silu(gate_) * up


def torchtitan_style(x, w_gate_up, offs):
    """The weight held (E, K, 2F), split in named halves."""
    h = torch._grouped_mm(x, w_gate_up, offs)
    gate_, up = torch.split(h, [F_, F_], dim=-1)
    return F.silu(gate_) * up


def inputs(experts=E, two_f=2 * F_, held="out-in", tokens=40):
    """x (tokens, K), the fused weight held (experts, 2F, K) as nn.Linear holds it ("out-in") or
    (experts, K, 2F) ("in-out"), int32 offsets with empty groups."""
    x = torch.randn(tokens, K).to(BF16)
    w = torch.randn(*((experts, two_f, K) if held == "out-in" else (experts, K, two_f))).div(8).to(BF16)
    return x, w, torch.tensor([10] * (experts - 1) + [tokens], dtype=torch.int32).clamp(max=tokens)


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(gate, "DEVICE_TYPES", ("cuda", "cpu"))


def traced(fn, *args):
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("fn,held", [(transformers_experts, "out-in"), (torchtitan_style, "in-out")])
def test_the_gated_up_projection_becomes_one_call(cpu_counts_as_cuda, fn, held):
    x, w, offs = inputs(held=held)
    gm = traced(fn, x, w, offs)
    assert gate.fuse_grouped_gates(gm.graph) == 1
    gm.recompile()
    assert gate.OP in targets(gm) and torch.ops.aten._grouped_mm.default not in targets(gm)
    torch.testing.assert_close(gm(x, w, offs), fn(x, w, offs))


def test_the_op_runs_our_kernel(cpu_counts_as_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(host_grouped, "grouped_mm_gated", lambda *args, **kwargs: calls.append(args) or "ours")
    x, w, offs = inputs()
    assert gate.grouped_mm_gated_op(x, w.transpose(-2, -1), offs, "silu") == "ours"
    assert calls[0][0] is x and calls[0][3] == "silu"


def test_what_our_kernel_refuses_falls_back_unfused(cpu_counts_as_cuda, monkeypatch):
    def refuse(*args, **kwargs):
        raise inductor_cute.UnsupportedError("unaligned")

    monkeypatch.setattr(host_grouped, "grouped_mm_gated", refuse)
    x, w, offs = inputs()
    assert torch.equal(gate.grouped_mm_gated_op(x, w.transpose(-2, -1), offs, "silu"),
                       transformers_experts(x, w, offs))


def saves_gate(x, w, offs):
    gate_, up = torch._grouped_mm(x, w.transpose(-2, -1), offs).chunk(2, dim=-1)
    return F.silu(gate_) * up, gate_  # gate used again (as a training graph saves it)


def uneven_split(x, w, offs):
    gate_, up = torch._grouped_mm(x, w.transpose(-2, -1), offs).split([32, 64], dim=-1)
    return F.silu(gate_) * up[:, :32]


def sigmoid_gate(x, w, offs):
    gate_, up = torch._grouped_mm(x, w.transpose(-2, -1), offs).chunk(2, dim=-1)
    return torch.sigmoid(gate_) * up


@pytest.mark.parametrize("fn,args", [
    (saves_gate, inputs()),
    (uneven_split, inputs()),
    (sigmoid_gate, inputs()),
    (transformers_experts, inputs(experts=600)),  # more groups than the kernel's tables hold
    (transformers_experts, inputs(two_f=2 * 44)),  # 44 output columns: not 8-aligned
])
def test_everything_else_is_left_as_it_is(cpu_counts_as_cuda, fn, args):
    gm = traced(fn, *args)
    before = targets(gm)
    assert gate.fuse_grouped_gates(gm.graph) == 0
    assert targets(gm) == before


def test_nothing_is_fused_off_cuda():
    gm = traced(transformers_experts, *inputs())
    assert gate.fuse_grouped_gates(gm.graph) == 0


def test_declines_name_their_reason():
    x, w, offs = inputs()
    assert "CUDA" in gate.gate_decline_reason(x, w.transpose(-2, -1), offs, "silu")


def test_torch_compile_emits_the_fused_call(cpu_counts_as_cuda):
    from torch._inductor.utils import run_and_get_code

    x, w, offs = inputs()
    torch._dynamo.reset()
    with inductor_cute.enable(fuse_moe_gate=True):
        assert inductor_config.post_grad_custom_pre_pass is moe_pass(True, None, True)
        out, (code, *_) = run_and_get_code(torch.compile(transformers_experts), x, w, offs)
    assert "inductor_cute.grouped_mm_gated" in code
    torch.testing.assert_close(out, transformers_experts(x, w, offs))
    assert inductor_config.post_grad_custom_pre_pass is None  # removed with disable


def test_a_users_pre_pass_is_not_replaced():
    def users_pass(graph):
        return None

    with inductor_config.patch(post_grad_custom_pre_pass=users_pass):
        with pytest.raises(RuntimeError, match="post_grad_custom_pre_pass is already set"):
            inductor_cute.enable(fuse_moe_gate=True)
        with inductor_cute.enable():  # without the gate fusion the user's pass stays
            assert inductor_config.post_grad_custom_pre_pass is users_pass


def test_transformers_qwen3_moe_experts_are_fused(cpu_counts_as_cuda):
    """A transformers Qwen3-MoE sparse block (grouped_mm experts, the default where torch has
    grouped_mm), compiled: its gate_up projection and SiLU-mul become one gated call."""
    transformers = pytest.importorskip("transformers")
    from torch._inductor.utils import run_and_get_code

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=K, intermediate_size=96, moe_intermediate_size=F_, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(BF16).eval()
    block = model.model.layers[0].mlp
    if getattr(model.config, "_experts_implementation", None) != "grouped_mm":
        pytest.skip("this transformers runs its experts without grouped_mm")
    x = torch.randn(2, 20, K).to(BF16)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_cute.enable(fuse_moe_gate=True):
        out, codes = run_and_get_code(torch.compile(block), x)
        want = block(x)
    assert "torch.ops.inductor_cute.grouped_mm_gated.default(" in "\n".join(codes)
    out, want = (o[0] if isinstance(o, tuple) else o for o in (out, want))
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


def test_the_patterns_register_under_torch_2_11s_init_once_fakemode(cpu_counts_as_cuda, monkeypatch):
    # torch 2.11's init_once_fakemode calls the function with the device by position (2.13 passes it
    # only to a function naming it); the GPU machine's torch is 2.11, and the pass failed there
    from torch._inductor import pattern_matcher

    calls = []

    def init_once_fakemode_2_11(fn):
        def lazy_init(input_device=None):
            calls.append(input_device)
            with torch._subclasses.FakeTensorMode():
                return fn(input_device)
        return lazy_init

    monkeypatch.setattr(pattern_matcher, "init_once_fakemode", init_once_fakemode_2_11)
    monkeypatch.setattr(gate.PATTERNS, "patterns", None)
    x, w, offs = inputs()
    gm = traced(transformers_experts, x, w, offs)
    assert gate.fuse_grouped_gates(gm.graph) == 1 and calls == [None]
