"""The MoE routing rewrites (inductor/grouped/routing.py) compiled on the GPU with enable(): the
router's top-k becomes Inductor's Triton sort and the permute sorts uint8 keys (the output code
shows both), and the compiled router agrees with eager on fresh logits, with ties at the k-th
place (bf16 logits of few distinct values):  the same top-k values, the same expert
set per token, a permute order that sorts the compiled ids stably; a top-k with NaN among its
inputs takes them first, as aten's does."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import inductor_cute

from .test_inductor_gpu import fresh_compile  # noqa: F401 (an autouse fixture: no_grad, fresh dynamo)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def router(logits, top_k: int):
    weights, experts = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return weights / weights.sum(-1, keepdim=True), experts, order


def tied_logits(tokens, experts, seed):
    """bf16 logits of 9 distinct values: most tokens tie at their k-th place."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(-4, 5, (tokens, experts), generator=g, device=DEV).to(torch.bfloat16)


# (64 tokens x top-8: 512 keys, which Inductor sorts in a Triton kernel too: uint8 keys there)
@pytest.mark.parametrize("tokens,experts,top_k", [(4096, 128, 8), (999, 64, 6), (300, 384, 8), (64, 128, 8)])
def test_the_compiled_router_sorts_as_eager_does(tokens, experts, top_k):
    with inductor_cute.enable():
        compiled = torch.compile(lambda x: router(x, top_k))
        logits = tied_logits(tokens, experts, seed=tokens)
        (weights, ids, order), codes = run_and_get_code(compiled, logits)
    code = "\n".join(codes)
    assert "aten.topk" not in code and "sort_with_index" in code  # the router's top-k: Inductor's Triton sort
    assert ("torch.uint8" if experts <= 256 else "torch.int16") in code  # the permute's keys
    want_weights, want_ids, _ = router(logits, top_k)
    torch.testing.assert_close(weights, want_weights, equal_nan=True)
    # the same experts per token (equal values may come in another order among themselves)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    flat = ids.flatten()
    assert torch.equal(order, torch.argsort(flat, stable=True))
    fresh = tied_logits(tokens, experts, seed=tokens + 1)
    got, want = compiled(fresh), router(fresh, top_k)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1].sort(-1).values, want[1].sort(-1).values)
    assert torch.equal(got[2], torch.argsort(got[1].flatten(), stable=True))


def test_a_top_k_with_nans_takes_them_first():
    x = torch.randn(513, 200, device=DEV)
    x[5, 17] = x[300, 0] = x[300, 199] = float("nan")
    with inductor_cute.enable():
        compiled = torch.compile(lambda t: torch.topk(t, 5, dim=-1))
        (values, indices), codes = run_and_get_code(compiled, x)
    assert "aten.topk" not in "\n".join(codes) and "sort_with_index" in "\n".join(codes)
    want = torch.topk(x, 5, dim=-1)
    torch.testing.assert_close(values, want.values, equal_nan=True)
    assert torch.equal(indices.sort(-1).values, want.indices.sort(-1).values)
