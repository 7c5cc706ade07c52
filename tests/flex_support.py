"""What the flex_attention lowering tests share: compiling with inductor-cute enabled, recording
the lowering's decisions, and a CPU stand-in for the custom op (the kernel's contract in fp32 torch
math: programs and block masks by the reference evaluators), so the whole compiled path runs on
the CPU. Fixtures: `decisions`, `cpu_accepted`, `hopper` (import them into a test module)."""

import dataclasses
import functools

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import flex_attention

import inductor_cute
from inductor_cute.host import flex as host_flex
from inductor_cute.inductor.flex import lowering as flex
from inductor_cute.inductor.flex.lowering import decline_reason  # the real one: `decisions` patches the module's
from inductor_cute.inductor.flex.runtime import FlexDecodeLauncher
from inductor_cute.kernels.common.programs import score as sp

HOP = torch.ops.higher_order.flex_attention
OUR_CALL = "inductor_cute.inductor.flex.runtime.FlexDecodeLauncher("  # a call site's definition


def compiled(fn, *args, dynamic=None, **kwargs):
    """fn compiled with inductor-cute enabled, run once: (result, output code)."""
    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        result, codes = run_and_get_code(torch.compile(fn, dynamic=dynamic), *args, **kwargs)
    torch._dynamo.reset()
    return result, "\n".join(codes)


def qkv(batch=2, heads=8, kv_heads=2, q_len=1, kv_len=300, dim=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=g).to(dtype)
    return q, k, v


def record_decisions(monkeypatch) -> list:
    """Every (problem, reason) the lowering decides from now on, in order."""
    seen = []

    def record(problem):
        seen.append((problem, decline_reason(problem)))
        return seen[-1][1]

    monkeypatch.setattr(flex, "decline_reason", record)
    return seen


@pytest.fixture
def decisions(monkeypatch):
    return record_decisions(monkeypatch)


def _stand_in(q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks, kv_indices,
              full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size):
    """The custom op's contract on the CPU (fp32 math): out in q's dtype, natural-log lse; the
    programs and the block mask by the reference evaluators; rows with no key out 0, lse -inf."""
    # the host's checks and canonical texts: what the lowering hands over must pass them
    score_mod, score_dtypes, score_slots = host_flex._score_mod_operands(score_mod or None, score_tensors, q.device)
    mask_mod, mask_dtypes, mask_slots = host_flex._score_mod_operands(mask_mod or None, mask_tensors, q.device, "mask")
    score_tensors, mask_tensors = score_slots[:len(score_dtypes)], mask_slots[:len(mask_dtypes)]
    g = q.shape[1] // k.shape[1]
    s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if score_mod:
        idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(s.shape)]
        s = sp.reference(score_mod, s, *idx, score_tensors)
    keep = sp.reference_keep(s.shape, mask_mod, mask_tensors,
                             (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), kv_block_size,
                             q_block_size)
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp().nan_to_num(0.0)
    return (p @ v.float().repeat_interleave(g, 1)).to(q.dtype), lse


@functools.cache
def register_stand_in():  # once per session; only CPU calls of our op reach it
    flex.register_kernel("cpu", _stand_in)


def _through_the_op(self, *args):
    return torch.ops.inductor_cute.flex_decode.default(*args)


@pytest.fixture
def cpu_accepted(monkeypatch):
    """The lowering treats the CPU as a Hopper GPU, and output code's launchers call the op, which
    runs `_stand_in` there."""
    register_stand_in()
    monkeypatch.setattr(flex, "_device_reason", lambda device: None)
    monkeypatch.setattr(FlexDecodeLauncher, "call", _through_the_op)
    monkeypatch.setattr(FlexDecodeLauncher, "call_static", _through_the_op)


def traced_problem(decisions, **kwargs) -> flex.FlexProblem:
    """The problem the lowering saw for a CPU compile of flex_attention, moved to a CUDA device."""
    q, k, v = qkv(dtype=torch.bfloat16)
    compiled(flex_attention, q, k, v, enable_gqa=True, **kwargs)
    (problem, _), = decisions
    decisions.clear()
    return dataclasses.replace(problem, device=torch.device("cuda", 0))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(flex, "_device_reason", lambda device: None if device.type == "cuda" else f"device {device}")


def taken_and_matching(decisions, q, k, v, **mods):
    """Compile flex_attention with `mods`; assert our op took the call and that (out, lse) match
    eager flex_attention in fp32. Returns (out, lse)."""
    (out, lse), code = compiled(flex_attention, q, k, v, enable_gqa=True, return_lse=True, **mods)
    assert [reason for _, reason in decisions] == [None] and OUR_CALL in code
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True, return_lse=True, **mods)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    return out, lse
