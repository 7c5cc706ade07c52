"""The grouped GEMM's host side on the CPU: which layout of the weight the kernel gets (views, not
copies, for what torch's MoE layers pass), the weight-gradient form's operand views and results (a
kernel computing on CPU tensors from the views it is given), and the refusals that need no GPU."""

import pytest
import torch

from inductor_cute import UnsupportedError, ops
from inductor_cute.host import grouped_gemm as host_grouped
from inductor_cute.host.grouped_gemm import _b_operand, _operand, _tma_view, grouped_mm



def test_transposed_weights_are_k_major_views():
    w = torch.randn(4, 256, 128).bfloat16()  # (E, N, K) as stored by an MoE layer
    b = w.transpose(1, 2)  # (E, K, N)
    view, major = _b_operand(b)
    assert major == "k" and view.data_ptr() == w.data_ptr()
    assert view.shape == (256, 128, 4) and view.stride() == (128, 1, 256 * 128)


def test_row_major_weights_are_n_major_views():
    b = torch.randn(4, 128, 256).bfloat16()
    view, major = _b_operand(b)
    assert major == "n" and view.data_ptr() == b.data_ptr() and view.stride() == (1, 256, 128 * 256)


def test_weights_with_unaligned_strides_are_copied_k_major():
    b = torch.randn(3, 64, 70).bfloat16()[:, :, :64]  # rows 140 bytes apart: neither layout is TMA-able
    view, major = _b_operand(b)
    assert major == "k" and view.stride()[1] == 1
    assert torch.equal(view.permute(2, 1, 0), b)


def test_single_group_gets_a_packed_batch_stride():
    b = torch.randn(1, 64, 32).bfloat16()
    view = _tma_view(b, 2)
    assert view.stride(0) % 8 == 0 and view.stride()[1:] == (32, 1)


def test_cpu_tensors_are_refused():
    with pytest.raises(UnsupportedError, match="CUDA device"):
        grouped_mm(torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16(),
                   torch.tensor([4, 8], dtype=torch.int32))


# ---- the weight-gradient form: a (M, tokens) x b (tokens, N) -> (groups, M, N)

def test_autograd_operands_of_the_weight_gradient_are_views():
    x, grad = torch.randn(96, 64).bfloat16(), torch.randn(96, 32).bfloat16()
    a, major = _operand(grad.t(), ((0, "m"), (1, "k")))  # what autograd passes: grad_out.t()
    assert major == "m" and a.data_ptr() == grad.data_ptr() and a.stride() == (1, 32)
    b, major = _operand(x, ((1, "n"), (0, "k")))
    assert major == "n" and b.data_ptr() == x.data_ptr()
    tokens_contiguous = torch.randn(32, 96).bfloat16()
    a, major = _operand(tokens_contiguous, ((0, "m"), (1, "k")))
    assert major == "k" and a.data_ptr() == tokens_contiguous.data_ptr()


def test_unaligned_weight_gradient_operands_are_copied_in_the_first_layout():
    wide = torch.randn(96, 70).bfloat16()[:, :64]  # neither mode TMA-able (rows 140 bytes apart)
    a, major = _operand(wide.t(), ((0, "m"), (1, "k")))
    assert major == "m" and a.stride() == (1, 64) and torch.equal(a, wide.t())
    b, major = _operand(wide, ((1, "n"), (0, "k")))
    assert major == "n" and b.stride() == (64, 1) and torch.equal(b, wide)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """ops.grouped_mm on CPU tensors, every kernel computing from the views it is given."""
    launches = []

    def get_kernel(spec):
        def kernel(a, b, offs, out, rows=None, gate=None, up=None):  # rows: gathered rows; gate, up: saved halves
            launches.append((spec, (a, b, offs, out)))
            a = a if rows is None else a[rows]
            start = 0
            for g, end in enumerate(offs.tolist()):
                if b.dim() == 2:  # weight gradient: a (M, T), b (N, T), out (M, N, E)
                    out[:, :, g] = (a[:, start:end].float() @ b[:, start:end].float().t()).to(out.dtype)
                elif spec.kwargs.get("gate_grad"):  # the gate's gradient: b (F, K, E), gate, up (T, F), out (T, 2F)
                    y = a[start:end].float() @ b[:, :, g].float().t()
                    gate_, up_ = gate[start:end].float(), up[start:end].float()
                    s = torch.sigmoid(gate_)
                    out[start:end] = torch.cat([y * up_ * s * (1 + gate_ * (1 - s)), y * gate_ * s], -1).to(out.dtype)
                elif spec.kwargs.get("gate"):  # gated forward: b (2F, K, E), out (T, F)
                    prod = a[start:end].float() @ b[:, :, g].float().t()
                    f = out.shape[1]
                    act = getattr(torch.nn.functional, spec.kwargs["gate"])
                    out[start:end] = (act(prod[:, :f]) * prod[:, f:]).to(out.dtype)
                else:  # forward: a (T, K), b (N, K, E), out (T, N)
                    out[start:end] = (a[start:end].float() @ b[:, :, g].float().t()).to(out.dtype)
                start = end
        return kernel

    monkeypatch.setattr(host_grouped, "check_cuda", lambda *tensors: None)
    monkeypatch.setattr(host_grouped, "sm_count", lambda index: 132)
    monkeypatch.setattr(host_grouped, "get_kernel", get_kernel)
    host_grouped._grouped_kernel.cache_clear()
    yield launches
    host_grouped._grouped_kernel.cache_clear()


def test_the_weight_gradient_runs_on_the_right_views(cpu_kernels):
    sizes = [30, 0, 50, 7]  # an empty group, 9 tokens past the last offset
    x, grad = torch.randn(96, 64).bfloat16(), torch.randn(96, 40).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = ops.grouped_mm(grad.t(), x, offs)  # as autograd calls it: (groups, N=40, K=64)
    spec, (a, b, _, d) = cpu_kernels[-1]
    assert spec.module.endswith("grouped_wgrad_sm90") and (spec.kwargs["a_major"], spec.kwargs["b_major"]) == ("m", "n")
    assert a.shape == (40, 96) and b.shape == (64, 96) and d.shape == (40, 64, 4) and d.data_ptr() == out.data_ptr()
    starts = [0, *offs.tolist()[:-1]]
    want = torch.stack([grad[s:e].float().t() @ x[s:e].float() for s, e in zip(starts, offs.tolist())])
    torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=2e-2)
    assert out.shape == (4, 40, 64) and (out[1] == 0).all()


def test_token_major_operands_need_a_token_count_of_multiples_of_8(cpu_kernels):
    for tokens, majors in ((96, ("k", "k")), (90, ("m", "n"))):
        a = torch.randn(16, 96).bfloat16()[:, :tokens]  # tokens contiguous, rows 192 bytes apart
        b = torch.randn(8, 96).bfloat16()[:, :tokens].t()
        ops.grouped_mm(a, b, torch.tensor([tokens // 2, tokens], dtype=torch.int32))
        spec, _ = cpu_kernels[-1]
        assert (spec.kwargs["a_major"], spec.kwargs["b_major"]) == majors


def test_no_tokens_give_zero_gradients_without_a_launch(cpu_kernels):
    out = torch.full((3, 16, 8), float("nan"), dtype=torch.bfloat16)
    got = ops.grouped_mm_wgrad(torch.empty(16, 0, dtype=torch.bfloat16), torch.empty(0, 8, dtype=torch.bfloat16),
                               torch.zeros(3, dtype=torch.int32), out)
    assert got is out and (out == 0).all() and not cpu_kernels


@pytest.mark.parametrize("a_shape,b_shape,offs_dtype,match", [
    ((16, 32), (30, 8), torch.int32, "a has 32 tokens but b has 30"),
    ((12, 32), (32, 8), torch.int32, "M=12"),
    ((16, 32), (32, 12), torch.int32, "N=12"),
    ((16, 32), (32, 8), torch.int64, "int32"),
])
def test_weight_gradients_we_cannot_take_are_refused(cpu_kernels, a_shape, b_shape, offs_dtype, match):
    with pytest.raises(UnsupportedError, match=match):
        ops.grouped_mm(torch.randn(*a_shape).bfloat16(), torch.randn(*b_shape).bfloat16(),
                       torch.tensor([16, 32], dtype=offs_dtype))
    with pytest.raises(UnsupportedError, match="out must be"):
        ops.grouped_mm_wgrad(torch.randn(16, 32).bfloat16(), torch.randn(32, 8).bfloat16(),
                             torch.tensor([16, 32], dtype=torch.int32), torch.empty(2, 8, 16, dtype=torch.bfloat16))


class OpsGroupedMM(torch.autograd.Function):
    """torch._grouped_mm's forward form with both gradients through ops.grouped_mm (as
    tests/gpu/test_grouped_wgrad_gpu.py runs it on the GPU)."""

    @staticmethod
    def forward(ctx, x, b, offs):
        ctx.save_for_backward(x, b, offs)
        return ops.grouped_mm(x, b, offs)

    @staticmethod
    def backward(ctx, grad):
        x, b, offs = ctx.saved_tensors
        return ops.grouped_mm(grad, b.transpose(-2, -1), offs), ops.grouped_mm(x.t(), grad, offs), None


def test_moe_gradients_through_ops_match_fp32(cpu_kernels):
    sizes = [40, 0, 70, 18]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x, w = torch.randn(128, 64).bfloat16().requires_grad_(), torch.randn(4, 32, 64).div(8).bfloat16()  # w (E, N, K)
    w.requires_grad_()
    grad = torch.randn(128, 32).bfloat16()
    OpsGroupedMM.apply(x, w.transpose(-2, -1), offs).backward(grad)
    dx, dw = x.grad, w.grad
    ends = offs.tolist()
    rows = list(zip([0, *ends[:-1]], ends))
    dx_ref = torch.cat([grad[s:e].float() @ w[g].detach().float() for g, (s, e) in enumerate(rows)])
    dw_ref = torch.stack([grad[s:e].float().t() @ x[s:e].detach().float() for s, e in rows])
    assert dx.shape == x.shape and dw.shape == w.shape
    kinds = [(spec.module.rsplit(".", 1)[-1], spec.kwargs["b_major"]) for spec, _ in cpu_kernels]
    assert kinds == [("grouped_sm90", "k"), ("grouped_sm90", "n"), ("grouped_wgrad_sm90", "n")]
    torch.testing.assert_close(dx.float(), dx_ref, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(dw.float(), dw_ref, atol=5e-2, rtol=2e-2)
    assert (dw[1] == 0).all()


def test_the_gated_up_projection_passes_the_fused_weight_and_a_half_width_output(cpu_kernels):
    sizes = [30, 0, 50, 7]
    x = torch.randn(90, 64).bfloat16()
    w = torch.randn(4, 2 * 48, 64).div(8).bfloat16()  # (E, 2F, K): gate rows, then up rows
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = ops.grouped_mm_gated(x, w.transpose(-2, -1), offs)
    spec, (a, b, _, d) = cpu_kernels[-1]
    assert spec.kwargs["gate"] == "silu" and spec.kwargs["b_major"] == "k"
    assert b.shape == (96, 64, 4) and d.shape == (90, 48) and out.shape == (90, 48)
    start, want = 0, []
    for g, end in enumerate(offs.tolist()):
        prod = x[start:end].float() @ w[g].float().t()
        want.append(torch.nn.functional.silu(prod[:, :48]) * prod[:, 48:])
        start = end
    torch.testing.assert_close(out[:87].float(), torch.cat(want), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="softplus"), "gate activation 'softplus'"),
    (dict(activation=""), "an activation is required"),
    (dict(out=torch.empty(16, 48, dtype=torch.bfloat16)), "out must be bfloat16 of shape \\(16, 24\\)"),
])
def test_gated_calls_we_cannot_take_are_refused(cpu_kernels, kwargs, match):
    x, w = torch.randn(16, 32).bfloat16(), torch.randn(2, 32, 48).bfloat16()
    with pytest.raises(UnsupportedError, match=match):
        ops.grouped_mm_gated(x, w, torch.tensor([8, 16], dtype=torch.int32), **kwargs)


def test_a_gated_weight_needs_eight_output_columns_per_half(cpu_kernels):
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        ops.grouped_mm_gated(torch.randn(16, 32).bfloat16(), torch.randn(2, 32, 40).bfloat16(),
                             torch.tensor([8, 16], dtype=torch.int32))


def test_the_gate_gradient_is_silu_and_mul_backward_of_the_product(cpu_kernels):
    sizes, f, k = [30, 0, 17, 5], 64, 48  # an empty group, 4 tokens past the last offset
    tokens = sum(sizes) + 4
    a, w = torch.randn(tokens, k).bfloat16(), torch.randn(len(sizes), f, k).div(4).bfloat16()
    h = torch.randn(tokens, 2 * f).bfloat16()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = torch.full((tokens, 2 * f), float("nan"), dtype=torch.bfloat16)
    got = ops.grouped_mm_gate_grad(a, w.transpose(-2, -1), offs, *h.chunk(2, dim=-1), "silu", out)  # b a view
    spec, (_, b, _, d) = cpu_kernels[-1]
    assert got is out and d.data_ptr() == out.data_ptr() and spec.kwargs["gate_grad"] == "silu"
    assert spec.kwargs["b_major"] == "k" and b.shape == (f, k, len(sizes))
    # autograd's gradient of silu(gate) * up at h, for the output gradient y = the grouped product
    y = torch._grouped_mm(a.float(), w.transpose(-2, -1).float(), offs=offs)
    h_ = h[:offs[-1]].float().requires_grad_()
    gate_, up = h_.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate_) * up).backward(y[:offs[-1]])
    torch.testing.assert_close(out[:offs[-1]].float(), h_.grad, atol=5e-2, rtol=2e-2)
    assert out[offs[-1]:].isnan().all()  # rows past the last group are not written


@pytest.mark.parametrize("h_shape,f,match", [((40, 96), 64, "gate and up must be"), ((40, 80), 40, "multiple of 32")])
def test_gate_gradients_we_cannot_take_are_refused(cpu_kernels, h_shape, f, match):
    a, w = torch.randn(40, 32).bfloat16(), torch.randn(2, 32, f).bfloat16()
    with pytest.raises(UnsupportedError, match=match):
        ops.grouped_mm_gate_grad(a, w, torch.tensor([16, 40], dtype=torch.int32),
                                 *torch.randn(*h_shape).bfloat16().chunk(2, dim=-1))


def test_gate_gradient_arguments_a_user_could_get_wrong(cpu_kernels):
    a, w, offs = torch.randn(40, 32).bfloat16(), torch.randn(2, 32, 64).bfloat16(), torch.tensor([16, 40]).int()
    h = torch.randn(40, 128).bfloat16()
    with pytest.raises(UnsupportedError, match="an activation is required"):
        ops.grouped_mm_gate_grad(a, w, offs, *h.chunk(2, dim=-1), "")
    with pytest.raises(UnsupportedError, match="shares memory"):  # in place over h: a tile re-reads stored rows
        ops.grouped_mm_gate_grad(a, w, offs, *h.chunk(2, dim=-1), "silu", out=h)
    with pytest.raises(UnsupportedError, match="gate and up must be"):
        ops.grouped_mm_gate_grad(a, w, offs, h, h, "silu")  # h itself, not its halves
    # halves whose rows are not 16-byte aligned are copied for the kernel
    odd = torch.randn(40, 65).bfloat16()[:, :64]
    ops.grouped_mm_gate_grad(a, w, offs, odd, h[:, 64:], "silu")
    spec, _ = cpu_kernels[-1]
    assert spec.kwargs["gate_grad"] == "silu"
