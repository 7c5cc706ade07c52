"""The flex_attention lowering on the CPU: installing and restoring it, which calls it takes (on
the problems real score_mod/mask_mod/block-mask graphs produce, and on variations of them), the
custom op's fake impl, and the whole compiled path with a CPU stand-in for the GPU kernel.
GPU runs are in tests/gpu/test_flex_compile_gpu.py."""

import dataclasses

import pytest
import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import lowering
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

import inductor_cute
from inductor_cute.inductor.flex import lowering as flex
from inductor_cute.inductor.flex import translate
from inductor_cute.inductor.flex.lowering import decline_reason  # the real one: `decisions` patches the module's
from inductor_cute.inductor.flex.translate import Captured
from inductor_cute.kernels.common.programs import registry
from inductor_cute.kernels.common.programs import score as sp

from flex_support import (HOP, OUR_CALL, compiled, cpu_accepted, decisions, hopper, qkv,  # noqa: F401 (fixtures)
                          record_decisions, taken_and_matching, traced_problem)


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


SLOPES = torch.exp2(-torch.arange(1, 9, dtype=torch.float32))  # ALiBi's slopes for 8 heads


def alibi(score, b, h, m, n):
    return score + SLOPES[h] * (n - m)


def relative_parity(score, b, h, m, n):
    """Query and key indices, integer ops, a comparison, a cast and a where."""
    d = n - m
    return torch.where(d % 2 == 0, score * 2.0, score - (b + 1).to(torch.float32) * 0.5) + (h > 3).to(torch.float32)


def sine(score, b, h, m, n):
    return torch.sin(score)  # no "sin" op in score programs


def causal(b, h, m, n):
    return m >= n


def sliding_window(b, h, m, n):
    return (m >= n) & (m - n < 64)


def test_enable_wraps_the_lowering_and_disable_restores_it():
    from inductor_cute.inductor.install import hook

    stock = lowering.lowerings[HOP]
    with inductor_cute.enable(flex_decode=False, trace_block_masks=False):
        assert lowering.lowerings[HOP] is stock
    with inductor_cute.enable():  # on by default
        assert lowering.lowerings[HOP] is flex._flex_attention
        inductor_cute.enable(flex_decode=True)  # nested
        inductor_cute.disable()
        assert lowering.lowerings[HOP] is flex._flex_attention
    assert lowering.lowerings[HOP] is stock
    hook("flex_attention_lowering").uninstall()  # not installed: nothing to undo
    assert lowering.lowerings[HOP] is stock


def test_cpu_inputs_get_the_stock_result(decisions):
    q, k, v = qkv()
    out, code = compiled(flex_attention, q, k, v, enable_gqa=True)
    assert [reason for _, reason in decisions] == ["device cpu"]
    assert "inductor_cute" not in code
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        stock = torch.compile(flex_attention)(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, stock)


# ------------------------------------------------------- decisions on problems from real graphs

@pytest.fixture(scope="module")
def plain() -> flex.FlexProblem:
    """The problem of a decode call with no score_mod and no mask (traced once for the module)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return traced_problem(record_decisions(monkeypatch))


def test_plain_decode_is_taken(plain, hopper):
    problem = plain
    assert flex.is_identity_score_mod(problem.score_graph) and flex.is_noop_mask_mod(problem.mask_graph)
    assert problem.keys_all_in_blocks and problem.inference
    assert (problem.heads, problem.kv_heads, problem.q_len, problem.head_dim_qk) == (8, 2, 1, 64)
    assert decline_reason(problem) is None


SOFTCAP_PROGRAM = sp.dumps([["div", "truediv", "score", 30], ["tanh", "tanh", "div"], ["mul", "mul", "tanh", 30]])
ALIBI_PROGRAM = sp.dumps([["index", "load", "t0", "h"], ["sub", "sub", "kv", "q"], ["mul", "mul", "index", "sub"],
                          ["add", "add", "score", "mul"]])


def test_softcap_and_alibi_are_translated_and_taken(decisions, hopper):
    softcapped = traced_problem(decisions, score_mod=softcap)
    assert flex.score_program(softcapped.score_graph, softcapped.score_buffers) == SOFTCAP_PROGRAM
    assert decline_reason(softcapped) is None
    biased = traced_problem(decisions, score_mod=alibi)
    assert biased.score_buffers == (Captured(torch.float32, (8,)),)
    assert flex.score_program(biased.score_graph, biased.score_buffers) == ALIBI_PROGRAM
    assert decline_reason(biased) is None
    assert flex.score_program(traced_problem(decisions).score_graph) == ""  # no score_mod: no program


def test_translated_programs_compute_what_the_score_mod_does(decisions):
    """Each translation, run by the reference evaluator, against the Python score_mod itself."""
    score = torch.randn(2, 8, 3, 50) * 5
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate(score.shape)]
    for mod, buffers in ((softcap, ()), (alibi, (SLOPES,)), (relative_parity, ())):
        problem = traced_problem(decisions, score_mod=mod)
        program = flex.score_program(problem.score_graph, problem.score_buffers)
        torch.testing.assert_close(sp.reference(program, score, *idx, buffers), mod(score, *idx))


def test_untranslatable_score_mods_are_declined_with_the_reason(decisions, hopper):
    assert decline_reason(traced_problem(decisions, score_mod=sine)) == \
        "a score_mod we cannot translate: aten.sin.default is not supported"
    slopes64 = SLOPES.double()
    problem = traced_problem(decisions, score_mod=lambda score, b, h, m, n: score + slopes64[h])
    assert decline_reason(problem) == "a score_mod we cannot translate: captured buffer 0 has dtype float64 " \
                                      "(supported: float32, bfloat16, float16, int32, int64, bool)"
    problem = traced_problem(decisions, score_mod=lambda score, b, h, m, n: score + b.to(torch.float64))
    assert decline_reason(problem) == "a score_mod we cannot translate: a cast to torch.float64"


def test_block_masks_are_translated_and_taken(decisions, hopper):
    masked = traced_problem(decisions, block_mask=create_block_mask(sliding_window, None, None, 1, 300, device="cpu"))
    assert not masked.keys_all_in_blocks and masked.block_sizes == (128, 128) and masked.mask_heads == 1
    program = flex.mask_program(masked.mask_graph, masked.mask_buffers)
    assert [step[1] for step in sp.loads(program, mask=True)] == ["ge", "sub", "lt", "and"]
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate((2, 3, 200, 300))]
    assert torch.equal(sp.reference_mask(program, *idx), sliding_window(*idx).expand(2, 3, 200, 300))
    assert decline_reason(masked) is None
    # a BlockMask of the noop mask_mod: its blocks are data, walked by the kernel; no mask program
    noop = traced_problem(decisions, block_mask=create_block_mask(noop_mask, None, None, 1, 300, device="cpu"))
    assert flex.mask_program(noop.mask_graph) == "" and decline_reason(noop) is None
    assert flex.mask_program(traced_problem(decisions).mask_graph) == ""  # no block mask at all


def test_block_masks_we_cannot_walk_are_declined(decisions, hopper):
    small = traced_problem(decisions, block_mask=create_block_mask(causal, None, None, 1, 300, device="cpu",
                                                                    BLOCK_SIZE=48))
    assert decline_reason(small) == "block mask: block mask KV block size 48 is not a multiple of the kernel's " \
                                    "KV block 128"
    sixty_four = traced_problem(decisions, block_mask=create_block_mask(causal, None, None, 1, 300, device="cpu",
                                                                         BLOCK_SIZE=64))
    assert decline_reason(sixty_four) is None  # the kernel takes 64-row stages for it
    per_head = traced_problem(decisions, block_mask=create_block_mask(causal, None, 8, 1, 300, device="cpu"))
    assert per_head.mask_heads == 8
    assert decline_reason(per_head) is None  # 8 query heads on 2 KV heads: a CTA per query head
    assert decline_reason(dataclasses.replace(per_head, kv_heads=8)) is None  # no GQA: one list per CTA
    assert "query block" in decline_reason(dataclasses.replace(small, block_sizes=(128, 16), q_len=32))
    sine_mask = traced_problem(decisions, block_mask=create_block_mask(
        lambda b, h, m, n: torch.sin(n.float()) > 0, None, None, 1, 300, device="cpu"))
    assert decline_reason(sine_mask) == "a mask_mod we cannot translate: aten.sin.default is not supported"


DECLINED = {
    "float32": dict(dtypes=(torch.float32,) * 3),
    "mixed dtypes": dict(dtypes=(torch.bfloat16, torch.float16, torch.float16)),
    "head dim 80": dict(head_dim_qk=80, head_dim_v=80),
    "query length 65": dict(q_len=65),
    "6 heads on 4 KV heads": dict(heads=6, kv_heads=4),
    "symbolic heads": dict(heads=None),
    "k/v mismatch": dict(operands_match=False),
    "training": dict(inference=False),
    "symbolic scale": dict(scale=sympy.Symbol("s0")),
    "BACKEND TRITON": dict(kernel_options={"BACKEND": "TRITON"}),
    "max_scores": dict(kernel_options={"OUTPUT_MAX": True}),
    "FORCE_USE_FLEX_ATTENTION": dict(kernel_options={"FORCE_USE_FLEX_ATTENTION": True}),
    "num_warps": dict(kernel_options={"num_warps": 4}),
    "GPU": dict(device=torch.device("cpu")),
}


@pytest.mark.parametrize("change", DECLINED.values(), ids=DECLINED.keys())
def test_unsupported_metadata_is_declined(plain, hopper, change):
    problem = dataclasses.replace(plain, **change)
    assert decline_reason(problem)


TAKEN = {
    "fp16": dict(dtypes=(torch.float16,) * 3),
    "d128": dict(head_dim_qk=128, head_dim_v=128),
    "MLA 192/128": dict(head_dim_qk=192, head_dim_v=128),
    "absorbed MLA 576/512 MQA": dict(head_dim_qk=576, head_dim_v=512, heads=128, kv_heads=1),
    "Lq 64": dict(q_len=64),
    "no GQA": dict(kv_heads=8),
    "scale given": dict(scale=0.3),
    "neutral options": dict(kernel_options={"BACKEND": "AUTO", "PRESCALE_QK": True, "OUTPUT_MAX": False,
                                            "FORCE_USE_FLEX_ATTENTION": False, "OUTPUT_LOGSUMEXP": True}),
}


@pytest.mark.parametrize("change", TAKEN.values(), ids=TAKEN.keys())
def test_supported_metadata_is_taken(plain, hopper, change):
    problem = dataclasses.replace(plain, **change)
    assert decline_reason(problem) is None


# ------------------------------------------------------------------------------- the custom op

def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 16, 4, 192, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 2, 1000, 192, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 2, 1000, 128, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.inductor_cute.flex_decode(q, k, v, 0.1, "", [], "", [], None, None, None, None, 0, 0)
    assert (out.shape, out.dtype, out.device.type) == ((2, 16, 4, 128), torch.bfloat16, "cuda")
    assert (lse.shape, lse.dtype) == ((2, 16, 4), torch.float32)
    assert out.is_contiguous() and lse.is_contiguous()


def test_kv_views_are_streamed_in_place_unless_misaligned():
    cache = torch.zeros(2, 512, 4, 64, dtype=torch.bfloat16)  # (batch, length, heads, dim)
    k = cache.transpose(1, 2)[:, :, :300]
    assert flex._streamable(k) is k
    shifted = k[..., 1:57]  # 2-byte aligned start
    copy = flex._streamable(shifted)
    assert copy is not shifted and copy.is_contiguous() and torch.equal(copy, shifted)


# ------------------------------------------------------------- the compiled path, end to end

@pytest.mark.parametrize("q_len", [1, 4])
def test_taken_call_matches_eager_flex_attention(cpu_accepted, q_len):
    q, k, v = qkv(q_len=q_len, dtype=torch.bfloat16)
    (out, lse), code = compiled(flex_attention, q, k, v, enable_gqa=True, return_lse=True)
    assert OUR_CALL in code and "import inductor_cute.inductor.flex.runtime" in code
    ref, ref_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert out.shape == ref.shape and out.dtype == ref.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)  # natural log, as the public API returns


def test_taken_call_with_dynamic_kv_length(cpu_accepted):
    for kv_len in (300, 517):
        q, k, v = qkv(kv_len=kv_len, dtype=torch.bfloat16)
        out, code = compiled(flex_attention, q, k, v, enable_gqa=True, scale=0.2, dynamic=True)
        assert OUR_CALL in code
        torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True, scale=0.2), atol=2e-2, rtol=2e-2)


def test_a_kv_cache_view_of_a_new_length_reuses_the_compiled_graph(cpu_accepted):
    # The GPU test's case: k, v = cache[:, :kv_len].transpose(1, 2), dynamic=True, called twice.
    # Our lowering must add no guard on the length (its batch x KV heads check guards only that
    # product). Output code is captured without run_and_get_code, whose torch._dynamo.reset()
    # makes every call compile afresh.
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    g = torch.Generator().manual_seed(0)
    cache_k, cache_v = (torch.randn(4, 4096, 8, 128, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(4, 32, 1, 128, generator=g).bfloat16()
    codes = []
    torch._dynamo.reset()
    try:
        with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False), torch.no_grad(), \
                mock.patch.object(GraphLowering, "save_output_code", codes.append):
            compiled_fn = torch.compile(flex_attention, dynamic=True)
            for kv_len in (1000, 1537):
                k, v = cache_k[:, :kv_len].transpose(1, 2), cache_v[:, :kv_len].transpose(1, 2)
                out = compiled_fn(q, k, v, enable_gqa=True)
                torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True), atol=2e-2, rtol=2e-2)
    finally:
        torch._dynamo.reset()
    assert len(codes) == 1 and OUR_CALL in codes[0], "the second length recompiled"


@pytest.mark.parametrize("score_mod", [softcap, alibi, relative_parity])
def test_translated_score_mod_runs_our_op_and_matches(cpu_accepted, decisions, score_mod):
    q, k, v = qkv(q_len=2, dtype=torch.bfloat16)
    taken_and_matching(decisions, q, k, v, score_mod=score_mod)


def test_untranslatable_score_mod_delegates_when_the_device_is_accepted(cpu_accepted, decisions):
    q, k, v = qkv(dtype=torch.bfloat16)
    out, code = compiled(flex_attention, q, k, v, score_mod=sine, enable_gqa=True)
    assert [reason for _, reason in decisions] == ["a score_mod we cannot translate: aten.sin.default is not supported"]
    assert OUR_CALL not in code
    torch.testing.assert_close(out, flex_attention(q, k, v, score_mod=sine, enable_gqa=True), atol=2e-2, rtol=2e-2)


def test_a_failing_decision_delegates_to_the_stock_lowering(cpu_accepted, monkeypatch):
    def broken(problem):
        raise RuntimeError("decision bug")

    monkeypatch.setattr(flex, "decline_reason", broken)
    q, k, v = qkv(dtype=torch.bfloat16)
    out, code = compiled(flex_attention, q, k, v, enable_gqa=True)
    assert OUR_CALL not in code
    torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True), atol=2e-2, rtol=2e-2)


# ------------------------------------------------- mask_mod and block masks, compiled end to end

KV = 700  # keys: 5 full and one partial block of 128 at the end


def decode_sliding(offset, window=200):
    """The query at position q_idx + offset (a closure constant) sees the window keys up to itself."""
    def mask_mod(b, h, m, n):
        return (m + offset >= n) & (m + offset - n < window)

    return mask_mod


OFFSETS = torch.tensor([KV - 2, 300], dtype=torch.int32)  # per batch: where the queries sit


def causal_captured_offset(b, h, m, n):
    return m + OFFSETS[b] >= n


DOC_IDS = (torch.arange(KV, dtype=torch.int32) // 250).to(torch.int32)  # three documents


def document(b, h, m, n):
    return DOC_IDS[n] == DOC_IDS[m + KV - 2]


def prefix_lm(b, h, m, n):
    return (n < 100) | (m + KV - 2 >= n)


def empty_rows(b, h, m, n):
    return (b == 0) & (n < 300)  # batch 1 attends nothing: out 0, lse -inf


MASKS = {"sliding": (decode_sliding(KV - 2), ()), "causal-captured-offset": (causal_captured_offset, (OFFSETS,)),
         "document": (document, (DOC_IDS,)), "prefix-lm": (prefix_lm, ()), "empty-rows": (empty_rows, ())}


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("name", MASKS)
def test_block_mask_runs_our_op_and_matches(cpu_accepted, decisions, name, block):
    mask_mod, _ = MASKS[name]
    q, k, v = qkv(q_len=2, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(mask_mod, 2, None, 2, KV, device="cpu", BLOCK_SIZE=block)
    out, lse = taken_and_matching(decisions, q, k, v, block_mask=block_mask)
    if name == "empty-rows":
        assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()


def test_block_mask_with_a_score_mod(cpu_accepted, decisions):
    q, k, v = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(prefix_lm, None, None, 1, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, score_mod=alibi, block_mask=block_mask)


def test_a_block_mask_per_query_head_under_gqa_runs_our_op_and_matches(cpu_accepted, decisions):
    q, k, v = qkv(kv_len=KV, dtype=torch.bfloat16)
    heads = torch.arange(8)
    per_head = create_block_mask(lambda b, h, m, n: n < 40 + 37 * heads[h], None, 8, 1, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, block_mask=per_head)  # GQA 4: a CTA per query head


def test_a_block_mask_we_cannot_walk_delegates(cpu_accepted, decisions):
    q, k, v = qkv(kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(prefix_lm, None, None, 1, KV, device="cpu", BLOCK_SIZE=16)  # < 32-row stages
    out, code = compiled(flex_attention, q, k, v, block_mask=block_mask, enable_gqa=True)
    assert "not a multiple" in decisions[0][1] and OUR_CALL not in code
    torch.testing.assert_close(out, flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True), atol=2e-2,
                               rtol=2e-2)


def test_block_mask_under_dynamic_shapes_is_taken(cpu_accepted, decisions):
    # dynamic=True turns the BlockMask's block sizes into symbols; the lowering specialises them
    # (guard_int, as the stock lowerings do) instead of declining every dynamic block-masked call.
    # The decode offset is taken both as a captured tensor and as a closure int, which becomes a
    # SymInt operand of the mask_mod: the lowering hands it to the kernel as a 1-element tensor.
    g = torch.Generator().manual_seed(0)
    cache_k, cache_v = (torch.randn(2, 2048, 2, 64, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(2, 8, 1, 64, generator=g).bfloat16()
    for kv_len in (1000, 1537):
        k, v = cache_k[:, :kv_len].transpose(1, 2), cache_v[:, :kv_len].transpose(1, 2)
        offset = kv_len - 1
        offsets = torch.tensor([offset], dtype=torch.int32)
        for mask_mod, captured in ((lambda b, h, m, n: (m + offsets[0] >= n) & (m + offsets[0] - n < 300),
                                    Captured(torch.int32, (1,))),
                                   (lambda b, h, m, n: (m + offset >= n) & (m + offset - n < 300),
                                    Captured(torch.int64, ()))):
            block_mask = create_block_mask(mask_mod, None, None, 1, kv_len, device="cpu")
            out, code = compiled(flex_attention, q, k, v, block_mask=block_mask, enable_gqa=True, dynamic=True)
            assert decisions[-1][1] is None and OUR_CALL in code
            assert decisions[-1][0].mask_buffers == (captured,)
            ref = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_block_mask_built_in_the_graph_is_taken(cpu_accepted, decisions, dynamic):
    """enable() (trace_block_masks on by default): the BlockMask is made by the compiled graph itself (as
    transformers makes it, create_block_mask(_compile=True) with a captured 0-d offset), not passed
    in; our op takes the call, static or dynamic shapes, and matches eager."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 64, generator=g).bfloat16()
    cache_k, cache_v = (torch.randn(2, 2, 2048, 64, generator=g).bfloat16() for _ in range(2))

    def step(q, k, v, offset):
        def mask_mod(b, h, m, n):
            return (m + offset >= n) & (m + offset - n < 300)

        block_mask = create_block_mask(mask_mod=mask_mod, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2],
                                       device="cpu", _compile=True)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    for kv_len in (1000, 1537):
        k, v, offset = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len], torch.tensor(kv_len - 1)
        out, code = compiled(step, q, k, v, offset, dynamic=dynamic)
        assert decisions[-1][1] is None and OUR_CALL in code and code.count("# AOT ID:") == 1
        block_mask = create_block_mask(lambda b, h, m, n: (m + kv_len - 1 >= n) & (m + kv_len - 1 - n < 300),
                                       None, None, 1, kv_len, device="cpu")
        ref = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_each_mod_is_translated_once_per_call(cpu_accepted, decisions, monkeypatch):
    """The decision's translations are the ones the lowering hands the kernel."""
    translated = []
    program = translate._Translation.program
    monkeypatch.setattr(translate._Translation, "program", lambda self: translated.append(self.gm) or program(self))
    q, k, v = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(prefix_lm, None, None, 1, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, score_mod=softcap, block_mask=block_mask)
    problem, _ = decisions[0]
    assert translated == [problem.score_graph, problem.mask_graph]


def test_casts_type_each_step_once(monkeypatch):
    """A cast needs its argument's type: the steps before it are typed once, not again per cast."""
    g = torch.fx.Graph()
    x, *_ = (g.placeholder(name) for name in ("score", "b", "h", "m", "n"))
    for _ in range(40):
        x = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        x = g.call_function(torch.ops.prims.convert_element_type.default, (x, torch.int32))
        x = g.call_function(torch.ops.prims.convert_element_type.default, (x, torch.float32))
    g.output(x)
    typed = []
    add = registry.Typer.add
    monkeypatch.setattr(registry.Typer, "add", lambda self, step: typed.append(step) or add(self, step))
    program = flex.score_program(torch.fx.GraphModule({}, g))
    assert len(typed) <= 2 * 120  # translation, then the canonical text's check (once per cast: ~80 * 60)
    assert len(sp.loads(program)) == 120


def test_an_untyped_scalar_tensor_is_a_float_constant():
    g = torch.fx.Graph()
    score, *_ = (g.placeholder(name) for name in ("score", "b", "h", "m", "n"))
    two = g.call_function(torch.ops.aten.scalar_tensor.default, (2,))  # no dtype: float32 in torch
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (score, two)))
    program = flex.score_program(torch.fx.GraphModule({}, g))
    assert "2.0" in program and '2]' not in program


def test_separate_dynamic_batches_are_taken_under_a_guard(cpu_accepted, decisions):
    """Without duck shaping q's batch and the KV cache view's are separate symbols, equal only at
    their hints: taken, with the equality guarded (another batch of k alone recompiles)."""
    from torch.fx.experimental import _config as fx_config

    q, k, v = qkv(batch=3, dtype=torch.bfloat16)
    with fx_config.patch(use_duck_shape=False):
        out, code = compiled(flex_attention, q, k, v, enable_gqa=True, dynamic=True)
    assert [reason for _, reason in decisions] == [None] and OUR_CALL in code
    assert "s" in str(decisions[0][0].size_guards)  # the batches were separate symbols
    torch.testing.assert_close(out, flex_attention(q, k, v, enable_gqa=True), atol=2e-2, rtol=2e-2)
