"""What the flex_attention lowering tests share: compiling with inductor-cute enabled, recording
the lowering's decisions, and CPU stand-ins for the decode and prefill custom ops (the kernels'
contract in fp32 torch math: programs and block masks by the reference evaluators), so the whole
compiled path runs on the CPU. Fixtures: `decisions`, `cpu_accepted`, `hopper` (import them into a
test module)."""

import dataclasses
import functools

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import flex_attention

import inductor_cute
from inductor_cute.host import flex as host_flex
from inductor_cute.host import flex_prefill as host_prefill
from inductor_cute.inductor.flex import lowering as flex
from inductor_cute.inductor.flex import prefill
from inductor_cute.inductor.flex.lowering import decline_reason  # the real one: `decisions` patches the module's
from inductor_cute.inductor.flex.runtime import FlexDecodeLauncher, FlexPrefillLauncher
from inductor_cute.kernels.attention.flex_prefill_config import HEAD_DIMS
from inductor_cute.kernels.common.programs import score as sp

HOP = torch.ops.higher_order.flex_attention
OUR_CALL = "inductor_cute.inductor.flex.runtime.FlexDecodeLauncher("  # a call site's definition
OUR_PREFILL_CALL = "inductor_cute.inductor.flex.runtime.FlexPrefillLauncher("


def compiled(fn, *args, dynamic=None, flex_prefill=False, trace_block_masks=True, **kwargs):
    """fn compiled with inductor-cute enabled (and our prefill kernel offered with `flex_prefill`,
    BlockMasks traced into the graph unless `trace_block_masks` is False), run once: (result, output code)."""
    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=True, flex_prefill=flex_prefill, trace_block_masks=trace_block_masks), \
            inductor_config.patch(fx_graph_cache=False), torch.no_grad():
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
              full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size, operands=host_flex._score_mod_operands):
    """A custom op's contract on the CPU (fp32 math): out in q's dtype, natural-log lse; the
    programs and the block mask by the reference evaluators; rows with no key out 0, lse -inf.
    `operands`: the host's program checks (decode's or prefill's)."""
    # the host's checks and canonical texts: what the lowering hands over must pass them
    score_mod, score_dtypes, score_slots = operands(score_mod or None, score_tensors, q.device, "score")
    mask_mod, mask_dtypes, mask_slots = operands(mask_mod or None, mask_tensors, q.device, "mask")
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


def _prefill_stand_in(*args):
    """The prefill op's contract: the decode op's (`_stand_in`), its programs checked by the prefill
    host, a block mask walked as the prefill host walks it (finer blocks than the kernel's coarsened)."""
    q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, *block_mask, kv_block_size, q_block_size = args
    if block_mask[0] is not None:
        kv_block = HEAD_DIMS[(q.shape[-1], v.shape[-1])]
        block_mask, mask_mod, mask_tensors, kv_block_size, q_block_size = host_prefill._walked_block_mask(
            tuple(block_mask), mask_mod or None, mask_tensors, kv_block_size, q_block_size, kv_block,
            (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)
    return _stand_in(q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, *block_mask, kv_block_size,
                     q_block_size, operands=host_prefill._program_operands)


@functools.cache
def register_stand_in():  # once per session; only CPU calls of our ops reach them
    flex.register_kernel("cpu", _stand_in)
    prefill.register_kernel("cpu", _prefill_stand_in)


def _through_the_op(self, *args):
    return torch.ops.inductor_cute.flex_decode.default(*args)


def _through_the_prefill_op(self, *args):
    return torch.ops.inductor_cute.flex_prefill.default(*args)


@pytest.fixture
def cpu_accepted(monkeypatch):
    """The lowering treats the CPU as a Hopper GPU, and output code's launchers call the ops, which
    run the stand-ins there."""
    accept_cpu(monkeypatch)


def accept_cpu(monkeypatch):
    """What `cpu_accepted` does, with this monkeypatch (a module fixture's own, say)."""
    register_stand_in()
    monkeypatch.setattr(flex, "_device_reason", lambda device: None)
    monkeypatch.setattr(FlexDecodeLauncher, "call", _through_the_op)
    monkeypatch.setattr(FlexDecodeLauncher, "call_static", _through_the_op)
    monkeypatch.setattr(FlexPrefillLauncher, "call", _through_the_prefill_op)
    monkeypatch.setattr(FlexPrefillLauncher, "call_static", _through_the_prefill_op)


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


def taken_and_matching(decisions, q, k, v, prefill=False, **mods):
    """Compile flex_attention with `mods` (our prefill kernel offered with `prefill`); assert our
    decode op (our prefill op with `prefill`) took the call and that (out, lse) match eager
    flex_attention in fp32. Returns (out, lse)."""
    (out, lse), code = compiled(flex_attention, q, k, v, enable_gqa=True, return_lse=True, flex_prefill=prefill,
                                **mods)
    ours, other = (OUR_PREFILL_CALL, OUR_CALL) if prefill else (OUR_CALL, OUR_PREFILL_CALL)
    assert [reason for _, reason in decisions] == [None] and ours in code and other not in code
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True, return_lse=True, **mods)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    return out, lse
