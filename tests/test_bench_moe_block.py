"""The MoE block of the models suite, on the CPU in fp32: its output and gradients against a per-expert
loop, its offsets, its cost, its cases' names."""

import pytest
import torch

from inductor_cute.bench.suites import models as M
from inductor_cute.bench.suites import moe_block as B
from inductor_cute.bench.suites.grouped_gemm import MoeModel

TINY = MoeModel("tiny", experts=8, topk=2, hidden=64, ffn=32)
TOKENS = 50


def _block_and_tokens(empty_experts: int = 0):
    block, x = B.make_inputs(TOKENS, train=True, device="cpu", model=TINY)
    block.float()
    x = x.detach().float().requires_grad_()
    if empty_experts:  # positive tokens against negative router rows: those experts are never chosen
        x = x.detach().abs().requires_grad_()
        with torch.no_grad():
            block.router[:empty_experts] = -block.router[:empty_experts].abs() - 1
    return block, x


def _grouped_mm_runs_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 8), offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("grouped", ["torch", "looped"])
@pytest.mark.parametrize("empty_experts", [0, 3])
def test_block_matches_the_per_expert_loop_in_fp32(grouped, empty_experts):
    if grouped == "torch" and not _grouped_mm_runs_on_cpu():
        pytest.skip("torch._grouped_mm does not run on the CPU in this torch")
    block, x = _block_and_tokens(empty_experts)
    if grouped == "looped":
        block.grouped_mm = B.looped_grouped_mm
    ref_out, ref_grads = B.reference(block, x, train=True)
    if empty_experts:
        assert B.rows_per_expert(block, x)[:empty_experts] == [0] * empty_experts
    out, loss = B.forward_and_loss(block, x)
    loss.backward()
    assert out.shape == (TOKENS, TINY.hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    grads = {name: p.grad for name, p in block.named_parameters()} | {"x": x.grad}
    assert set(grads) == set(ref_grads) == {"router", "w_gate_up", "w_down", "x"}
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_reference_is_not_the_identity_of_routing_mistakes():
    """A block that sends every row to the wrong expert must not match the reference."""
    block, x = _block_and_tokens()
    ref_out, _ = B.reference(block, x, train=False)

    def shifted(a, b, offs):
        return B.looped_grouped_mm(a, b.roll(1, dims=0), offs)

    block.grouped_mm = shifted
    with torch.no_grad():
        assert (block(x) - ref_out).norm() > 0.1 * ref_out.norm()


def test_looped_grouped_mm_matches_per_group_matmuls():
    a, b = torch.randn(10, 6), torch.randn(3, 6, 5)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # the middle group is empty
    out = B.looped_grouped_mm(a, b, offs)
    torch.testing.assert_close(out, torch.cat([a[:4] @ b[0], a[4:] @ b[2]]))


def test_routing_weights_are_the_renormalised_top_k_of_the_softmax():
    logits = torch.randn(7, 8)
    weights, experts = B.route(logits, 3)
    probs = logits.softmax(-1)
    assert experts.shape == (7, 3) and experts.dtype == torch.int64
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
    torch.testing.assert_close(weights, probs.gather(1, experts) / probs.topk(3).values.sum(-1, keepdim=True))
    assert (probs.gather(1, experts).min(-1).values >= probs.topk(3).values[:, -1]).all()


def test_offsets_are_non_decreasing_int32_ends_summing_to_the_routed_rows():
    block, x = _block_and_tokens(empty_experts=2)
    _, experts = block.route(x)
    offs = B.expert_offsets(experts.flatten(), TINY.experts)
    assert offs.dtype == torch.int32 and offs.shape == (TINY.experts,)
    assert (offs[1:] >= offs[:-1]).all() and offs[0] >= 0
    assert int(offs[-1]) == TOKENS * TINY.topk
    expected = torch.bincount(experts.flatten(), minlength=TINY.experts).cumsum(0)
    assert offs.tolist() == expected.tolist()
    assert offs[:2].tolist() == [0, 0]  # the two experts no token chooses: empty groups


def test_block_has_the_model_shapes_and_bf16_parameters():
    m = B.QWEN3_30B_A3B
    assert (m.hidden, m.experts, m.topk, m.ffn) == (2048, 128, 8, 768)
    block = B.MoeBlock(TINY)
    assert block.router.shape == (8, 64) and block.top_k == 2
    assert block.w_gate_up.shape == (8, 2 * 32, 64) and block.w_down.shape == (8, 64, 32)
    assert all(p.dtype == torch.bfloat16 for p in block.parameters())
    again = B.MoeBlock(TINY)  # seeded
    assert all(torch.equal(p, q) for p, q in zip(block.parameters(), again.parameters()))


def test_cost_counts_the_experts_matmuls_and_touched_weights():
    m = B.QWEN3_30B_A3B
    flops, n_bytes = B.cost(m, 4096, touched=128, train=False)
    assert flops == 2 * 4096 * 8 * 3 * 2048 * 768
    weights = 128 * 2048 + 128 * 3 * 2048 * 768
    assert n_bytes == 2 * (weights + 2 * 4096 * 2048)
    train_flops, train_bytes = B.cost(m, 4096, touched=128, train=True)
    assert train_flops == 3 * flops
    assert train_bytes == 2 * (2 * weights + 3 * 4096 * 2048)
    assert B.cost(m, 4096, touched=100, train=False)[1] < n_bytes  # untouched experts' weights are not read


def test_moe_cases_are_registered_in_the_models_suite_by_name_not_in_quick():
    names = [B.case_name(*c) for c in B.CASES]
    assert names == ["qwen3-30b-a3b moe-block fwd T4096 nocg", "qwen3-30b-a3b moe-block fwd T16384 nocg",
                     "qwen3-30b-a3b moe-block train T4096 nocg"]
    full = [getattr(f, "case_name", None) for f in M.cases(quick=False)]
    assert all(full) and full[-len(names):] == names  # every case named: --match skips the rest unbuilt
    assert not [n for n in (getattr(f, "case_name", "") for f in M.cases(quick=True)) if "moe-block" in n]


def test_our_kernel_calls_counts_grouped_launchers():
    code = ("icute_grouped_mm_0 = inductor_cute.inductor.grouped.runtime.GroupedLauncher(config=(1,)).launch\n"
            "icute_grouped_mm_1 = inductor_cute.inductor.grouped.runtime.GroupedLauncher(config=(2,)).launch\n"
            "import inductor_cute.inductor.grouped.runtime\n")
    assert M.our_kernel_calls(code) == 2
