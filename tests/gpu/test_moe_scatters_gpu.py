"""Accumulating scatters by a sort's permutation made gathers (inductor/grouped/scatters.py) in a
compiled training step on the GPU: an MoE permute and combine (as the models suite's block writes
them, and as torchtitan does) in bf16; with enable() the output code has no atomic adds and no
aten scatter left, and the output and gradients are as close to an fp64 reference as stock
torch.compile's (the fixed-order fp32 sums against atomics)."""

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute

pytestmark = pytest.mark.gpu
DEV = "cuda"


def gather_form(x, logits, top_k):
    """The models suite's block without experts: permute by x[order // k], combine by rows[inverse]."""
    weights, experts = logits.float().softmax(-1).topk(top_k)
    order = torch.argsort(experts.flatten(), stable=True)
    rows = torch.nn.functional.silu(x[order // top_k])
    inverse = torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=x.device))
    pairs = rows[inverse].view(x.shape[0], top_k, -1)
    return (pairs.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def titan_form(x, logits, top_k):
    """torchtitan's: gather by an expanded index, scatter-add combine of router-scaled rows."""
    weights, experts = logits.float().softmax(-1).topk(top_k)
    order = torch.argsort(experts.view(-1), stable=True)
    index = (order // top_k).reshape(-1, 1).expand(-1, x.shape[1])
    rows = torch.nn.functional.silu(torch.gather(x, 0, index))
    rows = (rows.float() * weights.view(-1)[order].reshape(-1, 1)).to(x.dtype)
    return torch.zeros_like(x).scatter_add(0, index, rows)


def step(fn, x, logits, top_k):
    x, logits = x.detach().requires_grad_(), logits.detach().requires_grad_()
    out = fn(x, logits, top_k)
    return out, *torch.autograd.grad(out.float().square().sum(), (x, logits))


@pytest.mark.parametrize("fn", [gather_form, titan_form])
@pytest.mark.parametrize("tokens,hidden,experts,top_k", [(1024, 512, 64, 8), (999, 136, 16, 2)])
def test_a_compiled_training_step_gathers_and_keeps_its_gradients(fn, tokens, hidden, experts, top_k):
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).to(torch.bfloat16)
    # logits without ties (distinct multiples of 1/8 in each row, exact in bf16): the same routing in
    # every runner and in the fp64 reference
    logits = torch.rand(tokens, experts, device=DEV, generator=g).argsort(-1).to(torch.bfloat16) / 8
    want = step(fn, x.double(), logits.double(), top_k)
    results = {}
    for name in ("stock", "enabled"):
        torch._dynamo.reset()
        with inductor_config.patch(force_disable_caches=True):
            if name == "enabled":
                with inductor_cute.enable():
                    results[name], codes = run_and_get_code(step, torch.compile(fn), x, logits, top_k)
            else:
                results[name], _ = run_and_get_code(step, torch.compile(fn), x, logits, top_k)
    code = "\n".join(codes)
    # (Triton kernels' metadata spells 'atomic_add_found': False)
    assert "tl.atomic_add" not in code and "aten.index_put" not in code and "aten.scatter_add" not in code
    errors = {name: [(got.double() - w).abs().max().item() / w.abs().max().item() for got, w in zip(result, want)]
              for name, result in results.items()}
    # output, x's gradient, the logits' gradient: bf16 rounding, no worse than stock's beyond a margin
    for ours, stock in zip(errors["enabled"], errors["stock"]):
        assert ours <= 1.25 * stock + 1e-3, errors
