"""What real callers hand the flex lowering, on the CPU stand-in (flex_support.py): the mask_mods
transformers builds (masking_utils: 0-d offsets, bool padding masks, int64 per-batch tensors,
bool constants, `&`/`|`, casts) and the score_mod/mask_mod patterns of PyTorch's flex decoding
tests (exp2 ALiBi, casts, 0-d, bool and N-D captured tensors, paged-attention tables). Each
taken call must record no decline reason, run our op, and match fp32 eager flex_attention; what
the kernel cannot do is declined with its reason. GPU twins: tests/gpu/test_flex_compile_gpu.py."""

import dataclasses
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor import config as inductor_config
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

import inductor_cute
from inductor_cute.inductor.flex import translate
from inductor_cute.inductor.flex.lowering import decline_reason
from inductor_cute.inductor.flex.translate import Captured
from inductor_cute.kernels.common.programs import score as sp

from flex_support import (OUR_CALL, OUR_PREFILL_CALL, compiled, cpu_accepted, decisions, hopper,  # noqa: F401
                          qkv, taken_and_matching, traced_problem)

KV = 300  # the static cache's length: two blocks of 128 and a partial one


# ----------------------------------------------------------------------------- transformers

@pytest.fixture
def mu(monkeypatch):
    """transformers.masking_utils, its create_block_mask not compiled (the masks are the same;
    compiling them costs ~15 s a mask on the CPU)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")

    def create_block_mask_eagerly(*args, _compile=False, **kwargs):
        return create_block_mask(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "create_block_mask", create_block_mask_eagerly)
    return masking_utils


def padded_attention_mask(batch=2, seen=251):
    """transformers' 2-D attention mask of the tokens seen so far: batch 1 left-padded by 7."""
    mask = torch.ones(batch, seen, dtype=torch.bool)
    mask[1, :7] = False
    return mask


def transformers_masks(mu):
    """name -> (mask_function, attention_mask, q_len): what create_causal_mask & co. hand to
    flex_attention_mask for a decode step after 251 tokens in a static cache of KV (q_len 1: the
    query at cache position 250; q_len 3: 248..250), or a 48-token packed prefill."""
    left_padding = torch.tensor([0, 7])  # int64, as create_chunked_causal_mask counts it
    packed = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])  # int64 sequence ids per (batch, position)
    return {
        "causal": (mu.causal_mask_function, None, 1),
        "causal-padding": (mu.causal_mask_function, padded_attention_mask(), 1),
        "causal-padding-3-queries": (mu.causal_mask_function, padded_attention_mask(seen=251), 3),
        "sliding-window-padding": (mu.sliding_window_causal_mask_function(100), padded_attention_mask(), 1),
        "chunked": (mu.chunked_causal_mask_function(64, left_padding), padded_attention_mask(), 1),
        "bidirectional-window": (mu.sliding_window_bidirectional_mask_function(40), None, 1),
        "or-masks": (mu.or_masks(mu.sliding_window_overlay(30), lambda b, h, q, kv: kv < 4), None, 1),
        "packed-sequences": (mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed)),
                             None, 48),
    }


TRANSFORMERS = ["causal", "causal-padding", "causal-padding-3-queries", "sliding-window-padding", "chunked",
                "bidirectional-window", "or-masks", "packed-sequences"]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformers_masks_run_our_op_and_match(cpu_accepted, decisions, mu, name):
    mask_function, attention_mask, q_len = transformers_masks(mu)[name]
    kv_len = 48 if name == "packed-sequences" else KV  # packed sequences: a prefill without cache
    cache_position = torch.arange(251 - q_len, 251) if kv_len == KV else torch.arange(q_len)
    q_offset = cache_position[0]  # a 0-d int64 tensor, captured by the mask_mod
    block_mask = mu.flex_attention_mask(2, q_len, kv_len, q_offset=q_offset, kv_offset=0,
                                        mask_function=mask_function, attention_mask=attention_mask, device="cpu")
    q, k, v = qkv(q_len=q_len, kv_len=kv_len, dtype=torch.bfloat16)
    out, lse = taken_and_matching(decisions, q, k, v, block_mask=block_mask, scale=0.125)
    problem, _ = decisions[0]
    dtypes = [b.dtype for b in problem.mask_buffers]
    assert torch.int64 in dtypes  # the q_offset (0-d) at least
    if attention_mask is not None:
        assert any(b.dtype is torch.bool and len(b.shape) == 2 for b in problem.mask_buffers)


def test_transformers_score_mod_with_a_4d_additive_mask(cpu_accepted, decisions):
    """flex_attention_forward's score_mod for a tensor mask: score + mask[b][0][q][kv] (chained
    indexing of a 4-D float buffer) and the softcap, as Gemma-2 configures it."""
    score_mask = torch.zeros(2, 1, 2, KV)
    score_mask[1, :, :, :9] = float("-inf")
    score_mask[0, :, 1, 100:] = -2.5

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        score = 50.0 * torch.tanh(score / 50.0)
        return score + score_mask[batch_idx][0][q_idx][kv_idx]

    q, k, v = qkv(q_len=2, kv_len=KV, dtype=torch.bfloat16)
    taken_and_matching(decisions, q * 4, k, v, score_mod=score_mod)
    assert decisions[0][0].score_buffers == (Captured(torch.float32, (2, 1, 2, KV)),)


@pytest.mark.parametrize("padded, trace_block_masks", [(True, False), (False, False), (False, True), (True, True)])
def test_a_transformers_llama_decode_step_runs_our_op(cpu_accepted, decisions, padded, trace_block_masks):
    """A 2-layer Llama (GQA 2, head dim 64) with attn_implementation="flex_attention" and a
    StaticCache: prefill 20 tokens (`padded`: batch 1 left-padded, the step given the attention
    mask) eagerly, then one compiled decode step. Its mask_mod (causal, padding, the cache-position
    offset) takes our op in both layers, and the logits match the same model on SDPA.
    transformers' create_block_mask(_compile=True) and its check for an all-ones attention mask
    break the step's graph; with `trace_block_masks` the step is one graph, padded or not."""
    import copy

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)

    def model(attn_implementation):
        torch.manual_seed(0)  # the same weights for both
        return transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                          attn_implementation=attn_implementation).eval()

    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 21, dtype=torch.long)
    attention_mask[1, :3] = 0 if padded else 1
    logits = []
    for attn_implementation in ("flex_attention", "sdpa"):
        llama, cache = model(attn_implementation), transformers.StaticCache(config=config, max_cache_len=64)
        with torch.no_grad():
            llama(input_ids=ids, attention_mask=attention_mask[:, :20], past_key_values=cache)
        step = dict(input_ids=ids[:, -1:], past_key_values=cache, cache_position=torch.tensor([20]))
        if padded:
            step["attention_mask"] = attention_mask
        if attn_implementation == "flex_attention":
            out, code = compiled(llama, trace_block_masks=trace_block_masks, **step)
            assert [reason for _, reason in decisions] == [None, None] and code.count(OUR_CALL) == 2
            graphs = code.count("# AOT ID:")
            assert graphs > 1 if not trace_block_masks else graphs == 1
        else:
            with torch.no_grad():
                out = llama(**step)
        logits.append(out.logits.float())
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=2e-2)


def test_one_traced_decode_step_serves_any_padding(cpu_accepted, decisions):
    """generate() hands every step the 2-D attention mask, and transformers adds a padding term to
    the flex mask only where it has a zero (a branch on its values: a graph break). With
    trace_block_masks the step is traced once, padding term included: compiled with no padding,
    the same graph then serves a left-padded batch (no recompile) and its logits match SDPA's."""
    import copy

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    unpadded = torch.ones(2, 21, dtype=torch.long)
    padded = unpadded.clone()
    padded[1, :5] = 0

    def step(attn_implementation, masks):
        """The logits of a decode step after a left-padded 20-token prefill, with each attention mask
        in turn; and the frames Dynamo had compiled after each call."""
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                           attn_implementation=attn_implementation).eval()
        counter = CompileCounterWithBackend("inductor")
        forward = torch.compile(model, backend=counter) if attn_implementation == "flex_attention" else model
        cache = transformers.StaticCache(config=config, max_cache_len=64)
        with torch.no_grad():
            model(input_ids=ids[:, :20], attention_mask=padded[:, :20], past_key_values=cache)
            logits, frames = [], []
            for mask in masks:
                logits.append(forward(input_ids=ids[:, 20:], attention_mask=mask, past_key_values=cache,
                                      cache_position=torch.tensor([20])).logits.float())
                frames.append(counter.frame_count)
        return logits, frames

    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False):
        # the second call may recompile for reasons of transformers' own (the kernels hub's context
        # variable); the third, with other mask values, must not
        (*_, ours_padded), frames = step("flex_attention", (unpadded, unpadded, padded))
    torch._dynamo.reset()
    (*_, sdpa_padded), _ = step("sdpa", (unpadded, unpadded, padded))  # each step rewrites the cache: the same sequence
    assert frames[1] == frames[2] and all(reason is None for _, reason in decisions)
    torch.testing.assert_close(ours_padded, sdpa_padded, atol=2e-2, rtol=2e-2)


def test_a_transformers_llama_prefill_runs_our_prefill_op(cpu_accepted, decisions):
    """A 2-layer Llama prefill of 128 tokens (no cache; above the decode kernel's 64 queries)
    compiled with our prefill kernel offered: our prefill op in both layers, logits as the same
    model on SDPA. (Its BlockMask is built as stock builds it: trace_block_masks traces only
    decode-sized masks, so the step breaks where transformers makes the mask.)"""
    import copy

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    logits = []
    for attn_implementation in ("flex_attention", "sdpa"):
        torch.manual_seed(0)
        llama = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                           attn_implementation=attn_implementation).eval()
        if attn_implementation == "flex_attention":
            out, code = compiled(llama, input_ids=ids, use_cache=False, flex_prefill=True)
            assert [reason for _, reason in decisions] == [None, None]
            assert code.count(OUR_PREFILL_CALL) == 2 and code.count("# AOT ID:") > 1
        else:
            with torch.no_grad():
                out = llama(input_ids=ids, use_cache=False)
        logits.append(out.logits.float())
    torch.testing.assert_close(logits[0], logits[1], atol=3e-2, rtol=3e-2)


# --------------------------------------------------------- PyTorch's flex decoding test patterns

def alibi_exp2(num_heads):
    def score_mod(score, b, h, q, kv):
        scale = torch.exp2(-((h + 1) * 8.0 / num_heads))
        return score + (kv - q) * scale

    return score_mod


HEAD_OFFSET = torch.rand(8, dtype=torch.float16)
SCALE_0D = torch.ones((), dtype=torch.int32)
SEQ_IDX = torch.zeros(KV, dtype=torch.bool)
SEQ_IDX[KV // 2:] = True
BIAS_2D = torch.randn(1, KV, dtype=torch.bfloat16)
BIAS_3D = torch.randn(2, 1, KV, dtype=torch.float16)
BIAS_4D = torch.randn(2, 8, 1, KV)
SEQ_LEN = torch.arange(2, dtype=torch.int32) + 1
NJT_OFFSETS = torch.tensor([0, 100, 150, KV], dtype=torch.int32)
NJT_SEQ = torch.bucketize(torch.arange(KV), NJT_OFFSETS[1:], right=True).to(torch.int32)

SCORE_MODS = {
    "alibi-exp2": alibi_exp2(8),
    "causal-where-inf": lambda s, b, h, q, kv: torch.where(q + 250 >= kv, s, float("-inf")),
    "head-offset-fp16": lambda s, b, h, q, kv: s * HEAD_OFFSET[h],
    "captured-0d-int": lambda s, b, h, q, kv: s + SCALE_0D,
    "bool-seq-mask": lambda s, b, h, q, kv: torch.where(SEQ_IDX[q + 200] == SEQ_IDX[kv], s, float("-inf")),
    "bias-2d": lambda s, b, h, q, kv: s + BIAS_2D[q, kv],
    "bias-3d": lambda s, b, h, q, kv: s + BIAS_3D[b, q, kv],
    "bias-4d": lambda s, b, h, q, kv: s + BIAS_4D[b, h, q, kv],
    "padded-dense": lambda s, b, h, q, kv: torch.where(s <= SEQ_LEN[b], s, -float("inf")),
    "njt-causal": lambda s, b, h, q, kv: torch.where(
        q + 250 - NJT_OFFSETS[NJT_SEQ[q + 250]] >= kv - NJT_OFFSETS[NJT_SEQ[kv]], s, float("-inf")),
    "silu-cast-to-query-dtype": lambda s, b, h, q, kv: torch.nn.functional.silu(s),
    "int-casts": lambda s, b, h, q, kv: s + (kv % 3 == 0).to(torch.int64) * 2 - (q > 0).float(),
    "subgraph-floordiv": lambda s, b, h, q, kv: s - q // (1 + kv),
    "negative-index-wrap": lambda s, b, h, q, kv: s + BIAS_4D[b - 2, h - 8, q - 1, kv - KV],
}


@pytest.mark.parametrize("name", SCORE_MODS)
def test_flex_decoding_score_mods_run_our_op_and_match(cpu_accepted, decisions, name):
    q, k, v = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)
    taken_and_matching(decisions, q * 3, k, v, score_mod=SCORE_MODS[name])


OFFSET_0D = torch.tensor(KV // 2 - 3, dtype=torch.int32)
HEAD_TYPE = torch.tensor([i % 3 != 0 for i in range(8)], dtype=torch.bool)
PAGE = 128
PHYSICAL_TO_LOGICAL = torch.tensor([[1, 0, -1], [2, 1, 0]])  # int64 (batch, physical page) -> logical page


def paged_mask_mod(inner):
    """PagedAttention.get_mask_mod's shape: a 2-D int64 page table, bools and where(..., False)."""
    def mask_mod(b, h, q_idx, physical_kv_idx):
        logical_block = PHYSICAL_TO_LOGICAL[b, physical_kv_idx // PAGE]
        logical_kv_idx = logical_block * PAGE + physical_kv_idx % PAGE
        is_valid = (logical_block >= 0) & True & (logical_kv_idx >= 0)
        return torch.where(is_valid, inner(b, h, q_idx, logical_kv_idx), False)

    return mask_mod


MASK_MODS = {  # name -> (mask_mod, block mask heads, query heads = KV heads)
    "offset-0d": (lambda b, h, q, kv: kv >= q + OFFSET_0D, None, False),
    "head-dependent-mha": (lambda b, h, q, kv: HEAD_TYPE[h] & (q + 250 >= kv), 8, True),
    "paged-causal": (paged_mask_mod(lambda b, h, q, kv: q + 250 >= kv), None, False),
}


@pytest.mark.parametrize("name", MASK_MODS)
def test_flex_decoding_mask_mods_run_our_op_and_match(cpu_accepted, decisions, name):
    mask_mod, heads, mha = MASK_MODS[name]
    q, k, v = qkv(q_len=1, kv_len=KV, kv_heads=8 if mha else 2, dtype=torch.bfloat16)
    block_mask = create_block_mask(mask_mod, 2, heads, 1, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, block_mask=block_mask, score_mod=alibi_exp2(8))


@pytest.mark.parametrize("block", [64, (1, 64), 32])
def test_kv_blocks_smaller_than_the_kernels_run_our_op_and_match(cpu_accepted, decisions, block):
    """PyTorch's decoding tests use BLOCK_SIZE 64 (and (1, 64)): the kernel takes stages of 64 rows."""
    q, k, v = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(lambda b, h, m, n: m + 250 >= n, 2, 1, 1, KV, BLOCK_SIZE=block, device="cpu")
    taken_and_matching(decisions, q, k, v, block_mask=block_mask)


def test_what_the_kernel_cannot_do_is_declined_with_the_reason(decisions, hopper):
    mask_48 = create_block_mask(noop_mask, 2, 1, 1, KV, BLOCK_SIZE=48, device="cpu")
    assert decline_reason(traced_problem(decisions, block_mask=mask_48)) == \
        "block mask: block mask KV block size 48 is not a multiple of the kernel's KV block 128"
    per_head = create_block_mask(MASK_MODS["head-dependent-mha"][0], 1, 8, 1, KV, device="cpu")
    assert decline_reason(traced_problem(decisions, block_mask=per_head)) is None  # a CTA per query head
    plain = traced_problem(decisions)
    assert decline_reason(dataclasses.replace(plain, head_dim_qk=80, head_dim_v=80)).startswith(
        "head dims 80/80 (qk/v) are not supported")
    assert decline_reason(dataclasses.replace(plain, head_dim_qk=64, head_dim_v=32)) is None  # PyTorch's tests
    assert decline_reason(dataclasses.replace(plain, operands_match=False)).startswith("k and v do not match q")


def test_a_padding_mask_of_symbolic_length_runs_our_op_and_matches(cpu_accepted, decisions):
    """An eager generate() recompiles transformers' compiled flex_attention once the KV length
    changes (automatic dynamic: that size alone turns symbolic), its (batch, kv_len) padding mask
    with it: our op takes both graphs (the mask's row stride from its length) and the second serves
    every later length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    attend = torch.compile(lambda q, k, v, pad: flex_attention(
        q, k, v, enable_gqa=True, score_mod=lambda s, b, h, m, n: torch.where(pad[b, n], s, float("-inf"))),
        backend=counter)
    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        for kv_len in (KV, KV + 77, KV + 150):
            q, k, v = qkv(kv_len=kv_len, dtype=torch.bfloat16)
            pad = torch.rand(2, kv_len, generator=torch.Generator().manual_seed(kv_len)) > 0.2
            out = attend(q, k, v, pad)
            ref = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                 score_mod=lambda s, b, h, m, n: torch.where(pad[b, n], s, float("-inf")))
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    assert counter.frame_count == 2 and [reason for _, reason in decisions] == [None, None]
    assert Captured(torch.bool, (2, None)) in decisions[1][0].score_buffers


def test_a_padding_mask_symbolic_in_batch_and_length_runs_our_op_and_matches(cpu_accepted, decisions):
    """dynamic=True (or generate() at a new batch size and length) makes the mask's batch symbolic
    too: its row stride is the kv_len operand Dynamo captures beside it, and one graph serves other
    batches and lengths."""
    counter = CompileCounterWithBackend("inductor")
    attend = torch.compile(lambda q, k, v, pad: flex_attention(
        q, k, v, enable_gqa=True, score_mod=lambda s, b, h, m, n: torch.where(pad[b, n], s, float("-inf"))),
        dynamic=True, backend=counter)
    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        for batch, kv_len in ((4, KV), (3, KV + 77)):  # batch 4, 3: no other size equals it (duck sizing)
            q, k, v = qkv(batch=batch, kv_len=kv_len, dtype=torch.bfloat16)
            pad = torch.rand(batch, kv_len, generator=torch.Generator().manual_seed(kv_len)) > 0.2
            out = attend(q, k, v, pad)
            ref = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                 score_mod=lambda s, b, h, m, n: torch.where(pad[b, n], s, float("-inf")))
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    assert counter.frame_count == 1 and [reason for _, reason in decisions] == [None]
    buffers = decisions[0][0].score_buffers  # the batch from the mask's length, kv_len from its operand
    (mask,) = [c for c in buffers if c.dtype is torch.bool]
    assert mask.shape[0] is None and buffers[mask.shape[1].slot] == Captured(torch.int64, ())


def test_batch_broadcast_kv_runs_our_op_and_matches(cpu_accepted, decisions):
    """K/V of batch 1 for 2 queries (one cache shared by the batch, as paged attention holds it;
    flex_attention takes it only with a block mask): every query batch reads the one cache."""
    q, _, _ = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)
    _, k, v = qkv(batch=1, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(lambda b, h, m, n: m + 250 + 40 * b >= n, 2, 1, 1, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, block_mask=block_mask)


def test_batch_broadcast_kv_runs_our_prefill_op_and_matches(cpu_accepted, decisions):
    """The same for 130 queries (the prefill kernel; PyTorch's test_flex_attention.py makes such
    calls): each query batch its own causal-with-offset mask over the one shared cache."""
    q, _, _ = qkv(q_len=130, kv_len=KV, dtype=torch.bfloat16)
    _, k, v = qkv(batch=1, kv_len=KV, dtype=torch.bfloat16)
    block_mask = create_block_mask(lambda b, h, m, n: m + 100 + 40 * b >= n, 2, 1, 130, KV, device="cpu")
    taken_and_matching(decisions, q, k, v, prefill=True, block_mask=block_mask)


# ------------------------------------------------------------------- the translation, directly

def graph(fn, *buffers, mask=False):
    """fn's FX graph over 0-d arguments (score, b, h, q, kv; without score for a mask_mod) and the
    captured buffers as placeholders, as flex_attention's tracing makes it."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    args = ([] if mask else [torch.zeros((), dtype=torch.bfloat16)]) + [torch.zeros((), dtype=torch.int32)
                                                                         for _ in range(4)]
    with TransformGetItemToIndex():
        return make_fx(fn)(*args, *buffers)


def test_n_d_loads_flatten_row_major_and_wrap_negative_indices():
    table = torch.arange(24, dtype=torch.int64).view(2, 3, 4)
    gm = graph(lambda b, h, q, kv, t: t[b, q - 1, kv] > 5, table, mask=True)
    program = translate.mask_program(gm, (translate.describe(torch.int64, (2, 3, 4)),))
    steps = sp.loads(program, ("int32",), mask=True)
    assert ["load", "lt", "mul", "where"] == sorted({s[1] for s in steps} & {"load", "lt", "where", "mul"})
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate((2, 1, 3, 4))]
    want = table[idx[0].long(), (idx[2] - 1).long(), idx[3].long()] > 5
    got = sp.reference_mask(program, *idx, (table.flatten().int(),))
    assert torch.equal(got, want.expand(2, 1, 3, 4))


@pytest.mark.parametrize("shape", [(2, None), (2, None, 3), (None, 5, 3)])
def test_one_symbolic_size_is_read_from_the_buffers_length(shape):
    # transformers' padding mask (B, kv_len) under dynamic shapes (an eager generate() recompiles its
    # flex_attention with a symbolic KV length): one program serves every length, its row stride
    # len(buffer) // B, negative indices wrapped by the symbolic size
    traced = [7 if s is None else s for s in shape]
    gm = graph(lambda b, h, q, kv, t: (t[b, kv - 1] if len(shape) == 2 else t[b, kv % 5 - 1, -1]) > 0,
               torch.zeros(traced, dtype=torch.bool), mask=True)
    program = translate.mask_program(gm, (translate.describe(torch.bool, shape),))
    # a symbolic first size needs no length (no stride holds it)
    assert ("len" in {step[1] for step in sp.loads(program, ("int32",), mask=True)}) == (shape[0] is not None)
    for size in (5, 9):  # lengths other than the traced one
        real = [size if s is None else s for s in shape]
        table = torch.rand(real) > 0.5
        idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate((2, 1, 3, 5))]
        b, kv = idx[0].long(), idx[3].long()
        want = table[b, kv - 1] if len(shape) == 2 else table[b, kv % 5 - 1, -1]
        got = sp.reference_mask(program, *idx, (table.flatten().int(),))
        assert torch.equal(got, want.expand(2, 1, 3, 5))


INDEX_EXPRESSIONS = {  # what a mask_mod indexes a captured buffer with, each in range for sizes >= 4
    "b": lambda b, h, q, kv: b, "q": lambda b, h, q, kv: q, "kv % 4": lambda b, h, q, kv: kv % 4,
    "kv - 4 (negative)": lambda b, h, q, kv: kv - 4, "0": lambda b, h, q, kv: 0, "-1": lambda b, h, q, kv: -1,
}


@pytest.mark.parametrize("seed", range(16))
def test_random_reads_of_a_buffer_with_symbolic_sizes_match_torch(seed):
    # shapes of rank 1-3 with symbolic sizes anywhere, one of them read from the buffer's length,
    # the others from integer operands captured beside it (as Dynamo lifts them), each dim indexed
    # by one of the expressions above; the program (translated once, at the traced sizes) against
    # torch's indexing at other sizes
    rng = torch.Generator().manual_seed(seed)
    rank = 1 + seed % 3
    symbolic = torch.rand(rank, generator=rng) < 0.5
    symbolic[int(torch.randint(rank, (), generator=rng))] = True
    by_length = int(symbolic.nonzero()[int(torch.randint(int(symbolic.sum()), (), generator=rng))])
    operand_dims = [d for d in range(rank) if symbolic[d] and d != by_length]
    shape = tuple(None if d == by_length else translate.SizeOperand(1 + operand_dims.index(d)) if symbolic[d]
                  else 4 + int(torch.randint(3, (), generator=rng)) for d in range(rank))
    names = [list(INDEX_EXPRESSIONS)[int(i)] for i in torch.randint(len(INDEX_EXPRESSIONS), (rank,), generator=rng)]
    exprs = [INDEX_EXPRESSIONS[n] for n in names]

    def mask_mod(b, h, q, kv, t, *sizes):
        return t[tuple(e(b, h, q, kv) for e in exprs)] > 0

    traced = [s if isinstance(s, int) else 7 for s in shape]
    captured = (translate.describe(torch.int32, shape), *[translate.describe(torch.int64, ())] * len(operand_dims))
    gm = graph(mask_mod, torch.zeros(traced, dtype=torch.int32), *[torch.tensor(7)] * len(operand_dims), mask=True)
    program = translate.mask_program(gm, captured)
    for sizes in ((5, 9, 6), (9, 5, 8)):  # each symbolic dim its own size
        real = [s if isinstance(s, int) else sizes[d] for d, s in enumerate(shape)]
        table = torch.randint(-3, 4, real, generator=rng, dtype=torch.int32)
        operands = [torch.tensor([real[d]], dtype=torch.int32) for d in operand_dims]
        idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate((2, 1, 3, 5))]
        want = table[tuple(e(*(i.long() for i in idx)) for e in exprs)] > 0
        got = sp.reference_mask(program, *idx, (table.flatten(), *operands))
        assert torch.equal(got, want.expand(2, 1, 3, 5)), (shape, names, real)


def test_bool_constants_fold_away():
    gm = graph(lambda b, h, q, kv: torch.ones((), dtype=torch.bool) & (q >= kv) & True, mask=True)
    assert sp.loads(translate.mask_program(gm), mask=True) == [["ge", "ge", "q", "kv"]]
    assert translate.mask_program(graph(lambda b, h, q, kv: (q >= 0) | True, mask=True)) == ""
    never = translate.mask_program(graph(lambda b, h, q, kv: (q >= kv) & False, mask=True))
    assert sp.loads(never, mask=True)[-1] == ["out", "ne", 0, 0]


@pytest.mark.parametrize("fn, message", [
    (lambda b, h, q, kv, t: t[b] > 0, "used as a tensor of 1 dims"),
    (lambda b, h, q, kv, t: t[b, q > 0] > 0, "indexed by a bool"),
    (lambda b, h, q, kv, t: t[b, 5] > 0, "index 5 is out of range for dim 1"),  # traced on 2 x 8
    (lambda b, h, q, kv, t: (q.to(torch.float16) > 0), "a cast to torch.float16"),
    (lambda b, h, q, kv, t: (q + 2 ** 40) > kv, "does not fit int32"),
])
def test_untranslatable_reads_raise_with_the_reason(fn, message):
    with pytest.raises(ValueError, match=message):
        translate.mask_program(graph(fn, torch.zeros(2, 8), mask=True), (translate.describe(torch.float32, (2, 3)),))


def test_buffers_the_kernel_cannot_read_are_described():
    assert "float64" in translate.describe(torch.float64, (3,)).problem
    assert "no integer operand holds" in translate.describe(torch.int32, (None, 3, None)).problem
    assert translate.describe(torch.int32, (None, 3, translate.SizeOperand(1))).problem is None
    assert translate.describe(torch.int32, (None, 4)).problem is None  # dim 0: the kernel knows the length
    assert translate.describe(torch.int32, (3, None)).problem is None  # len(buffer) // 3
    assert "0 elements" in translate.describe(torch.bool, (2, 0)).problem
    assert "device" in translate.describe(torch.int32, (3,), on_device=False).problem
    assert translate.describe(torch.bool, ()).kernel_dtype is torch.int32


def test_arithmetic_on_two_bools_stays_logical_as_in_torch():
    gm = graph(lambda s, b, h, q, kv: s + ((q >= kv) + (kv < 3)) * 1.5 + (q > 0) * (kv > 1))
    program = translate.score_program(gm)
    score = torch.randn(2, 2, 3, 5)
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate(score.shape)]
    b, h, q, kv = idx
    torch.testing.assert_close(sp.reference(program, score, *idx),
                               score + ((q >= kv) | (kv < 3)) * 1.5 + ((q > 0) & (kv > 1)))
    with pytest.raises(ValueError, match="bitwise_xor.Tensor is not supported"):
        translate.score_program(graph(lambda s, b, h, q, kv: s + ((q >= kv) ^ (kv < 3))))


def test_layers_sharing_a_mask_share_its_converted_buffers(cpu_accepted, decisions, mu):
    """Every layer of a model passes the same 0-d offset and bool padding mask: they are converted
    (int32, flattened) once per graph, not once per layer."""
    block_mask = mu.flex_attention_mask(2, 1, KV, q_offset=torch.tensor(250), mask_function=mu.causal_mask_function,
                                        attention_mask=padded_attention_mask(), device="cpu")
    q, k, v = qkv(q_len=1, kv_len=KV, dtype=torch.bfloat16)

    def two_layers(q, k, v):
        x = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        return flex_attention(x, k, v, block_mask=block_mask, enable_gqa=True)

    out, code = compiled(two_layers, q, k, v)
    calls = [line for line in code.splitlines() if re.search(r"= icute_flex_\d+\(", line)]
    assert len(calls) == 2 and [reason for _, reason in decisions] == [None, None]
    mask_tensors = [re.findall(r"\[reinterpret_tensor[^\]]*\]", line) for line in calls]
    assert len(mask_tensors[0]) == 1 and mask_tensors[0] == mask_tensors[1]
    torch.testing.assert_close(out.float(), two_layers(q.float(), k.float(), v.float()), atol=3e-2, rtol=3e-2)
