"""The flex_attention lowering for queries longer than the decode kernel takes, on the CPU: with
enable(flex_prefill=True) inference calls go to our prefill op (a CPU stand-in here, flex_support.py)
and match eager flex_attention; with the setting off (the default) they go stock; what the prefill
kernel cannot take is declined with its reason. GPU runs: tests/gpu/test_flex_prefill_lowering_gpu.py."""

import dataclasses
import logging
from unittest import mock

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute
from inductor_cute.inductor.flex import lowering as flex
from inductor_cute.inductor.flex.lowering import decline_reason

from flex_support import (OUR_CALL, OUR_PREFILL_CALL, accept_cpu, compiled, cpu_accepted, decisions,  # noqa: F401
                          hopper, qkv, record_decisions, taken_and_matching)


def causal(b, h, m, n):
    return m >= n


def sliding_window(b, h, m, n):
    return (m >= n) & (m - n < 100)


DOC_IDS = (torch.arange(1000) // 300).to(torch.int32)  # four documents over positions 0..999


def document(b, h, m, n):
    return (DOC_IDS[m] == DOC_IDS[n]) & (m >= n)


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def prefill_problem(decisions, **kwargs) -> flex.FlexProblem:
    """The problem the lowering saw for a CPU compile of 200 queries on 200 keys with our prefill
    kernel offered (taken on the CPU stand-in: a cheap compile), moved to a CUDA device."""
    q, k, v = qkv(q_len=200, kv_len=200, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as monkeypatch:
        accept_cpu(monkeypatch)
        compiled(flex_attention, q, k, v, enable_gqa=True, flex_prefill=True, **kwargs)
    (problem, _), = decisions
    decisions.clear()
    return dataclasses.replace(problem, device=torch.device("cuda", 0))


@pytest.fixture(scope="module")
def plain() -> flex.FlexProblem:
    """The problem of a prefill call with no score_mod and no mask (traced once for the module)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return prefill_problem(record_decisions(monkeypatch))


# --------------------------------------------------------------------------------- decisions

def test_long_queries_go_to_the_prefill_kernel_only_when_offered(plain, hopper):
    problem = plain
    assert (problem.q_len, problem.kernel, problem.flex_prefill) == (200, "prefill", True)
    assert decline_reason(problem) is None
    assert decline_reason(dataclasses.replace(problem, flex_prefill=False)) == \
        "query length 200 is outside the decode kernel's range 1..64 (our prefill kernel is opt-in: " \
        "enable(flex_prefill=True))"
    assert dataclasses.replace(problem, q_len=64).kernel == "decode"
    assert decline_reason(dataclasses.replace(problem, q_len=64)) is None
    assert decline_reason(dataclasses.replace(problem, q_len=64, flex_decode=False)) == \
        "flex_decode is off (enable(flex_decode=True) offers our decode kernel)"
    assert decline_reason(dataclasses.replace(problem, flex_decode=False)) is None  # prefill alone


def test_a_symbolic_query_length_picks_its_kernel_at_the_hint(plain, hopper):
    problem = dataclasses.replace(plain, q_len=None, q_len_hint=300)
    assert problem.kernel == "prefill" and decline_reason(problem) is None
    short = dataclasses.replace(problem, q_len_hint=16)
    assert short.kernel == "decode" and decline_reason(short) == "heads, query length or head dims are symbolic"


DECLINED = {
    "head dim 80": (dict(head_dim_qk=80, head_dim_v=80),
                    "head dims 80/80 (qk/v) are not supported (supported: 64/64, 128/128, 192/128, 256/256, "
                    "96/96, 64/32)"),
    "absorbed MLA 576/512 (decode only)": (dict(head_dim_qk=576, head_dim_v=512), "head dims 576/512 (qk/v) are not"),
    "float32": (dict(dtypes=(torch.float32,) * 3), "dtype float32 is not supported (use bfloat16 or float16)"),
    # a real one on the GPU only: flex_attention has no backward on the CPU
    "training": (dict(inference=False), "a training graph (our backward is opt-in: enable(flex_backward=True))"),
    "6 heads on 4 KV heads": (dict(heads=6, kv_heads=4), "6 query heads are not a multiple of 4 KV heads"),
    "symbolic heads": (dict(heads=None), "heads, query length or head dims are symbolic"),
    "symbolic scale": (dict(scale=sympy.Symbol("s0")), "scale is not a constant"),
    "num_warps": (dict(kernel_options={"num_warps": 4}), "kernel_options ['num_warps'] tune the stock kernels"),
    "GPU": (dict(device=torch.device("cpu")), "device cpu"),
}


@pytest.mark.parametrize("change,reason", DECLINED.values(), ids=DECLINED.keys())
def test_what_the_prefill_kernel_cannot_take_is_declined(plain, hopper, change, reason):
    problem = dataclasses.replace(plain, **change)
    assert decline_reason(problem).startswith(reason)


TAKEN = {"fp16": dict(dtypes=(torch.float16,) * 3), "d128": dict(head_dim_qk=128, head_dim_v=128),
         "MLA 192/128": dict(head_dim_qk=192, head_dim_v=128), "d256": dict(head_dim_qk=256, head_dim_v=256),
         "MQA": dict(heads=32, kv_heads=1), "no GQA": dict(kv_heads=8), "Lq 65": dict(q_len=65),
         "K/V shared by the batch": dict(kv_batch_broadcast=True)}


@pytest.mark.parametrize("change", TAKEN.values(), ids=TAKEN.keys())
def test_what_the_prefill_kernel_takes(plain, hopper, change):
    assert decline_reason(dataclasses.replace(plain, **change)) is None


def test_block_masks_by_the_prefill_kernels_limits(decisions, hopper):
    causal_mask = create_block_mask(causal, None, None, 200, 200, device="cpu")
    problem = prefill_problem(decisions, block_mask=causal_mask)
    assert not problem.keys_all_in_blocks and problem.block_sizes == (128, 128) and decline_reason(problem) is None
    # per query head under GQA 4: the decode kernel's CTA serves a KV head's queries, the prefill one a query head's
    per_head = prefill_problem(decisions, block_mask=create_block_mask(causal, None, 8, 200, 200, device="cpu"))
    assert per_head.mask_heads == 8 and decline_reason(per_head) is None
    assert decline_reason(dataclasses.replace(per_head, q_len=2)) is None  # the decode kernel runs it unpacked
    # finer blocks than the kernel's are walked coarsened, with one more mask tensor, in inference graphs
    for sizes in ((64, 128), (128, 64), (64, 64), (32, 16)):
        assert decline_reason(dataclasses.replace(problem, block_sizes=sizes)) is None
    assert decline_reason(dataclasses.replace(problem, block_sizes=(96, 128))) == \
        "block mask: block mask KV block size 96 is not a multiple of the kernel's KV block 128"
    assert decline_reason(dataclasses.replace(problem, block_sizes=(128, 96))) == \
        "block mask: block mask query block size 96 is not a multiple of the kernel's 128 query rows"
    assert decline_reason(dataclasses.replace(problem, block_sizes=(64, 128), mask_buffers=(None,) * 4)) == \
        "block mask: 128 x 64 blocks (queries x keys) take a mask tensor, and the mask_mod has all 4"
    assert decline_reason(dataclasses.replace(problem, block_sizes=(128, 256))) is None
    # a training graph with finer blocks: the backward walks them coarsened too (unless no mask tensor is left)
    training = dataclasses.replace(problem, block_sizes=(64, 128), inference=False, flex_backward=True)
    assert decline_reason(training) is None
    assert decline_reason(dataclasses.replace(training, mask_buffers=(None,) * 4)) == \
        "backward block mask: 128 x 64 blocks (queries x keys) take a mask tensor, and the mask_mod has all 4"
    assert decline_reason(dataclasses.replace(problem, mask_heads=2)) == "a block mask of 2 heads for 8 query heads"


def test_untranslatable_mods_are_declined_for_the_prefill_kernel_too(decisions, hopper):
    problem = prefill_problem(decisions, score_mod=lambda score, b, h, m, n: torch.sin(score))
    assert decline_reason(problem) == "a score_mod we cannot translate: aten.sin.default is not supported"


# ------------------------------------------------------------- the compiled path, end to end

@pytest.mark.parametrize("q_len", [200, 1000])
def test_long_queries_run_our_prefill_op_and_match(cpu_accepted, decisions, q_len):
    q, k, v = qkv(batch=1, q_len=q_len, kv_len=q_len, dtype=torch.bfloat16)
    taken_and_matching(decisions, q, k, v, prefill=True)
    assert decisions[0][0].kernel == "prefill"


@pytest.mark.parametrize("q_len", [200, 1000])
def test_causal_block_mask_with_softcap_and_gqa(cpu_accepted, decisions, q_len):
    q, k, v = qkv(batch=1, heads=8, kv_heads=2, q_len=q_len, kv_len=q_len, dtype=torch.bfloat16)
    block_mask = create_block_mask(causal, None, None, q_len, q_len, device="cpu")
    taken_and_matching(decisions, q * 4, k, v, prefill=True, block_mask=block_mask, score_mod=softcap)


@pytest.mark.parametrize("mask_mod", [sliding_window, document])
def test_masks_with_captured_tensors_and_per_head_blocks(cpu_accepted, decisions, mask_mod):
    q, k, v = qkv(batch=2, heads=8, kv_heads=2, q_len=1000, kv_len=1000, dtype=torch.float16)
    block_mask = create_block_mask(mask_mod, 2, 8, 1000, 1000, device="cpu", BLOCK_SIZE=256)
    taken_and_matching(decisions, q, k, v, prefill=True, block_mask=block_mask, scale=0.2)


@pytest.mark.parametrize("block_size", [64, (64, 128), (128, 32)])
def test_finer_block_masks_than_the_kernels(cpu_accepted, decisions, block_size):
    """BLOCK_SIZE 64 (and mixed): walked at the kernel's blocks by the host (the stand-in runs its walk)."""
    q, k, v = qkv(batch=2, heads=4, kv_heads=2, q_len=300, kv_len=300, dtype=torch.bfloat16)
    block_mask = create_block_mask(sliding_window, 2, None, 300, 300, device="cpu", BLOCK_SIZE=block_size)
    taken_and_matching(decisions, q, k, v, prefill=True, block_mask=block_mask)


def test_queries_shorter_than_the_keys(cpu_accepted, decisions):
    """A chunked prefill: 130 new queries after 400 cached keys, causal with the offset captured."""
    offset = torch.tensor([400], dtype=torch.int32)

    def chunk_causal(b, h, m, n):
        return m + offset[0] >= n

    q, k, v = qkv(batch=2, heads=4, kv_heads=4, q_len=130, kv_len=530, dtype=torch.bfloat16)
    block_mask = create_block_mask(chunk_causal, None, None, 130, 530, device="cpu")
    taken_and_matching(decisions, q, k, v, prefill=True, block_mask=block_mask)


def test_with_the_setting_off_long_queries_go_stock(cpu_accepted, decisions):
    q, k, v = qkv(batch=1, q_len=200, kv_len=200, dtype=torch.bfloat16)
    out, code = compiled(flex_attention, q, k, v, enable_gqa=True)  # enable()'s default: flex_prefill off
    assert [reason for _, reason in decisions] == [
        "query length 200 is outside the decode kernel's range 1..64 (our prefill kernel is opt-in: "
        "enable(flex_prefill=True))"]
    assert OUR_PREFILL_CALL not in code and OUR_CALL not in code
    torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True), atol=2e-2, rtol=2e-2)


def test_prefill_alone_leaves_decoding_calls_stock(cpu_accepted, decisions):
    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=False, flex_prefill=True), inductor_config.patch(fx_graph_cache=False), \
            torch.no_grad():
        fn = torch.compile(flex_attention)
        for q_len in (1, 200):
            q, k, v = qkv(batch=1, q_len=q_len, kv_len=200, dtype=torch.bfloat16)
            torch.testing.assert_close(fn(q, k, v, enable_gqa=True), flex_attention(q, k, v, enable_gqa=True),
                                       atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    assert [(p.kernel, reason) for p, reason in decisions] == [
        ("decode", "flex_decode is off (enable(flex_decode=True) offers our decode kernel)"), ("prefill", None)]


@pytest.mark.parametrize("case", ["head dim 80", "float32"])
def test_unsupported_calls_are_declined_and_logged(cpu_accepted, decisions, caplog, case):
    dim, dtype = (80, torch.bfloat16) if case == "head dim 80" else (64, torch.float32)
    q, k, v = qkv(batch=1, q_len=200, kv_len=200, dim=dim, dtype=dtype)
    with caplog.at_level(logging.DEBUG, logger=flex.__name__):
        out, code = compiled(flex_attention, q, k, v, enable_gqa=True, flex_prefill=True)
    (_, reason), = decisions
    assert reason == {"head dim 80": DECLINED["head dim 80"][1],
                      "float32": "dtype float32 is not supported (use bfloat16 or float16)"}[case]
    assert f"left to the stock lowering: {reason}" in caplog.text
    assert OUR_PREFILL_CALL not in code
    torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True), atol=2e-2, rtol=2e-2)


def test_a_dynamic_query_length_is_taken_under_a_guard(cpu_accepted, decisions):
    """dynamic=True: one graph serves prefills of 200 and 1000 queries (the prefill kernel takes
    any length above the decode kernel's, guarded); 50 queries fail that guard and recompile (the
    decode kernel takes no symbolic query length: stock)."""
    codes = []
    torch._dynamo.reset()
    try:
        with inductor_cute.enable(flex_prefill=True), inductor_config.patch(fx_graph_cache=False), \
                torch.no_grad(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
            fn = torch.compile(flex_attention, dynamic=True)
            for q_len in (200, 1000, 50):
                q, k, v = qkv(batch=1, q_len=q_len, kv_len=1000, dtype=torch.bfloat16)
                out = fn(q, k, v, enable_gqa=True, scale=0.2)
                ref = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True, scale=0.2)
                torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    finally:
        torch._dynamo.reset()
    assert len(codes) == 2, "the second prefill length recompiled, or the short one did not"
    assert OUR_PREFILL_CALL in codes[0] and OUR_PREFILL_CALL not in codes[1]
    assert [(p.q_len, p.kernel, reason) for p, reason in decisions] == [
        (None, "prefill", None), (None, "decode", "heads, query length or head dims are symbolic")]


# ------------------------------------------------------------------------------- the custom op

def test_prefill_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 16, 300, 192, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 4, 1000, 192, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 4, 1000, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.inductor_cute.flex_prefill(q, k, v, 0.1, "", [], "", [], None, None, None, None, 0, 0)
    assert (out.shape, out.dtype, out.device.type) == ((2, 16, 300, 128), torch.bfloat16, "cuda")
    assert (lse.shape, lse.dtype) == ((2, 16, 300), torch.float32)


def test_the_launcher_is_rebuilt_from_its_repr():
    from inductor_cute.inductor.flex.runtime import FlexPrefillLauncher

    launcher = FlexPrefillLauncher(0.125, "", '[["o", "ge", "q", "kv"]]', 128, 128)
    again = eval(repr(launcher), {"FlexPrefillLauncher": FlexPrefillLauncher})
    assert repr(again) == repr(launcher) and again.call_static == again.call
