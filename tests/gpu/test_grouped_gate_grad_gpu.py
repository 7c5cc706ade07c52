"""The grouped GEMM with SwiGLU's backward in its epilogue (ops.grouped_mm_gate_grad; the MoE down
projection's input gradient) against fp32 autograd: the product y of the output gradient and the
down weight is the gradient of silu(gate) * up, and the kernel stores [gate | up]'s gradient from
the saved halves of h = [gate | up]. Skewed, empty and sub-tile groups, offsets off the tile, F not a
multiple of the tile (the gate half's subtiles past F must not land in the up half), both weight
layouts, the configs autotuning offers. Outputs are poisoned with NaN first."""

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.grouped_gemm import grouped_mm_gate_grad
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates

from .test_grouped_gemm_gpu import SIZES, offsets, reference, weights

pytestmark = pytest.mark.gpu

DEV = "cuda"
# the 128-row configs with the edge stores every offered config has, a 1x2 cluster with half tiles,
# a 2x1 cluster, and a 64-row config storing partial tiles element by element (no staging)
CONFIGS = [None,
           GroupedConfig(128, 256, 64, 4, 2, overlap_last=True, staged_partial=True),
           GroupedConfig(128, 128, 64, 6, 2, 1, 2, overlap_last=True, staged_partial=True, half_tiles=True),
           GroupedConfig(128, 256, 64, 4, 2, 2, 1, overlap_last=True, staged_partial=True),
           GroupedConfig(64, 128, 64, 8, 1)]


def reference_gate_grad(y, h):
    """autograd's gradient of silu(gate) * up at h = [gate | up] for the output gradient y (fp32)."""
    h = h.float().requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(y)
    return h.grad


def check_gate_grad(sizes, k, f, layout="k", tokens=None, config=None, seed=0):
    covered = sum(sizes)
    tokens = covered if tokens is None else tokens
    g = torch.Generator(device=DEV).manual_seed(seed + 7)
    a = torch.randn(tokens, k, device=DEV, generator=g).bfloat16()
    b = weights(len(sizes), k, f, layout, seed)
    h = torch.randn(tokens, 2 * f, device=DEV, generator=g).mul_(2).bfloat16()
    out = torch.full((tokens, 2 * f), float("nan"), device=DEV, dtype=torch.bfloat16)
    got = grouped_mm_gate_grad(a, b, offsets(sizes), *h.chunk(2, dim=-1), "silu", out=out, config=config)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    want = reference_gate_grad(reference(a, b, sizes), h[:covered])
    assert not out[:covered].isnan().any(), "elements of some group were not written"
    torch.testing.assert_close(out[:covered].float(), want, atol=4e-2, rtol=3e-2)
    assert out[covered:].isnan().all(), "rows past the last offset were written"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else c.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", ["skewed", "unaligned-offsets", "many-groups", "smaller-than-a-tile"])
@pytest.mark.parametrize("layout", ["k", "n"])
def test_gate_gradient(name, layout, config):
    check_gate_grad(SIZES[name], 512, 224, layout, config=config)  # F = 224: a partial last column tile


@pytest.mark.parametrize("f", [32, 96, 768])
def test_gate_gradient_widths_and_tokens_past_the_groups(f):
    check_gate_grad([3, 130, 0, 77], 1000, f, tokens=260)
    check_gate_grad([300, 0, 129], 2048, f, "n")


@pytest.mark.parametrize("f", [768, 224])  # 224: subtiles past F in every tile width's last column tile
def test_the_offered_configs_all_compute_it(f):
    sizes = [198, 300, 0, 256, 231]
    problem = GroupedProblem(b_major="n", gate_grad="silu")
    for config in candidates(problem, sum(sizes), f, 2048, len(sizes), exhaustive=True):
        check_gate_grad(sizes, 2048, f, "n", config=config)


def test_strongly_negative_gates():
    """silu'(g) for g in [-9, -3] is small and made by cancellation: the sigmoid must be precise."""
    sizes, k, f = [64, 100], 256, 64
    a = torch.randn(sum(sizes), k, device=DEV).bfloat16()
    b = weights(len(sizes), k, f, "k")
    gate = torch.rand(sum(sizes), f, device=DEV).mul(-6).sub(3).bfloat16()
    up = torch.randn(sum(sizes), f, device=DEV).bfloat16()
    got = grouped_mm_gate_grad(a, b, offsets(sizes), gate, up, "silu")
    want = reference_gate_grad(reference(a, b, sizes), torch.cat([gate, up], dim=1))
    torch.testing.assert_close(got[:, :f].float(), want[:, :f], atol=1e-3, rtol=2e-2)


def test_it_matches_the_unfused_backward_of_a_moe_down_projection():
    """As autograd computes it through torch._grouped_mm in bf16: the down projection's input
    gradient, then SiLU-and-mul's backward."""
    sizes, f, hidden = [300, 0, 17, 1200, 64], 768, 2048
    tokens = sum(sizes)
    offs = offsets(sizes)
    h = torch.randn(tokens, 2 * f, device=DEV).bfloat16().requires_grad_()
    w_down = torch.randn(len(sizes), hidden, f, device=DEV).div(f ** 0.5).bfloat16()  # (E, hidden, F)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    ours = grouped_mm_gate_grad(grad_y, w_down, offs, gate.detach(), up.detach(), "silu")
    torch.testing.assert_close(ours.float(), h.grad.float(), atol=6e-2, rtol=4e-2)


def test_widths_the_epilogue_cannot_split_are_refused():
    a = torch.randn(64, 128, device=DEV).bfloat16()
    with pytest.raises(UnsupportedError, match="multiple of 32"):
        grouped_mm_gate_grad(a, weights(2, 128, 40, "k"), offsets([32, 32]),
                             *torch.randn(64, 80, device=DEV).bfloat16().chunk(2, dim=-1))


def test_separate_gate_and_up_tensors():
    """The halves as a training graph may save them: two tensors, not views of one buffer."""
    sizes, k, f = [100, 0, 157], 512, 224
    a = torch.randn(sum(sizes), k, device=DEV).bfloat16()
    b = weights(len(sizes), k, f, "n")
    gate, up = (torch.randn(sum(sizes), f, device=DEV).bfloat16() for _ in range(2))
    got = grouped_mm_gate_grad(a, b, offsets(sizes), gate, up, "silu")
    want = reference_gate_grad(reference(a, b, sizes), torch.cat([gate, up], dim=1))
    torch.testing.assert_close(got.float(), want, atol=4e-2, rtol=3e-2)
