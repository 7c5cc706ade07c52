"""What real callers hand the flex lowering, on the H200 (CPU twin: tests/test_flex_coverage.py):
transformers' mask_mods built by its own flex_attention_mask (0-d offsets, bool padding masks,
int64 per-batch tensors, bool constants), a transformers Llama decode step with a StaticCache, and
the score_mod/mask_mod patterns of PyTorch's flex decoding tests (exp2 ALiBi, casts, 0-d, bool and
N-D captured tensors, a paged-attention table). Taken calls run our kernel (the output code calls
the custom op), write every output element (the allocator is poisoned with NaN first) and match
fp32 eager flex_attention; calls the kernel cannot take go to the stock lowering and match too."""

import copy

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

import inductor_cute

from .test_flex_compile_gpu import (OUR_CALL, assert_lse_close, assert_out_close, compiled_run,  # noqa: F401
                                    fresh_compile)

pytestmark = pytest.mark.gpu
KV = 2048  # the static cache's length
SEEN = 1500  # tokens in the cache so far


def poison_allocator():
    """Free blocks of the caching allocator (small and large pools) filled with NaN: an output
    element the kernel leaves unwritten shows as NaN."""
    torch.cuda.synchronize()
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (1 << 8, 1 << 12, 1 << 16, 1 << 18) * 8]
    blocks += [torch.full((n,), float("nan"), device="cuda") for n in (1 << 22, 1 << 24)]
    del blocks


def check_ours(q, k, v, **mods):
    """Our kernel takes the compiled call (once), writes every element and matches fp32 eager."""
    poison_allocator()
    (out, lse), code = compiled_run(q, k, v, enable_gqa=q.shape[1] != k.shape[1], return_lse=True, **mods)
    assert code.count(OUR_CALL) == 1
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), enable_gqa=q.shape[1] != k.shape[1],
                                  return_lse=True, **mods)
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (poisoned) elements"
    empty = torch.isinf(ref_lse)
    assert_out_close(out, ref, q.dtype)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    assert_lse_close(lse[~empty], ref_lse[~empty])


def check_stock(q, k, v, **mods):
    out, code = compiled_run(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **mods)
    assert OUR_CALL not in code
    ref = flex_attention(q.float(), k.float(), v.float(), enable_gqa=q.shape[1] != k.shape[1], **mods)
    assert (out.float() - ref).abs().max().item() < 2e-2


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


# ----------------------------------------------------------------------------- transformers

def transformers_masks(mu):
    """name -> (mask_function, attention_mask or None, q_len, kv_len) for batch 4."""
    attention_mask = torch.ones(4, SEEN, dtype=torch.bool, device="cuda")
    for b, pad in enumerate((0, 7, 300, 1)):
        attention_mask[b, :pad] = False
    left_padding = torch.tensor([0, 7, 300, 1], device="cuda")  # int64
    packed = torch.tensor([[0] * 20 + [1] * 28, [0] * 48, [0] * 10 + [1] * 10 + [2] * 28, [0] * 47 + [1]],
                          device="cuda")
    return {
        "causal": (mu.causal_mask_function, None, 1, KV),
        "causal-padding": (mu.causal_mask_function, attention_mask, 1, KV),
        "causal-padding-4-queries": (mu.causal_mask_function, attention_mask, 4, KV),
        "sliding-window-padding": (mu.sliding_window_causal_mask_function(512), attention_mask, 1, KV),
        "chunked": (mu.chunked_causal_mask_function(256, left_padding), attention_mask, 1, KV),
        "bidirectional-window": (mu.sliding_window_bidirectional_mask_function(300), None, 1, KV),
        "packed-sequences": (mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed)),
                             None, 48, 48),
    }


@pytest.mark.parametrize("name", ["causal", "causal-padding", "causal-padding-4-queries", "sliding-window-padding",
                                  "chunked", "bidirectional-window", "packed-sequences"])
@pytest.mark.parametrize("group", [1, 4])
def test_transformers_masks_run_our_kernel(name, group):
    mu = pytest.importorskip("transformers.masking_utils")
    mask_function, attention_mask, q_len, kv_len = transformers_masks(mu)[name]
    cache_position = torch.arange(SEEN - q_len, SEEN, device="cuda") if kv_len == KV else \
        torch.arange(q_len, device="cuda")
    block_mask = mu.flex_attention_mask(4, q_len, kv_len, q_offset=cache_position[0], kv_offset=0,
                                        mask_function=mask_function, attention_mask=attention_mask, device="cuda")
    q = rand(4, 2 * group, q_len, 128) * 3
    k, v = rand(4, 2, kv_len, 128), rand(4, 2, kv_len, 128)
    check_ours(q, k, v, block_mask=block_mask)


def run_keeping_code(fn, *args):
    """(fn(*args), output code of the graphs it compiled): run_and_get_code without its
    torch._dynamo.reset(), so that later calls reuse (or recompile) what earlier ones compiled."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        return fn(*args), codes


def attend_padded(q, k, v, pad):
    """flex_attention with a (batch, kv_len) padding mask as transformers captures it, and the lse."""
    return flex_attention(q, k, v, enable_gqa=True, return_lse=True,
                          score_mod=lambda s, b, h, m, n: torch.where(pad[b, n], s, float("-inf")))


def check_padded_steps(compiled, steps):
    """For each (batch, kv_len, graphs): `compiled` (attend_padded) compiles `graphs` new graphs,
    each running our kernel, writes every element (the allocator poisoned) and matches fp32."""
    import inductor_cute

    for batch, kv_len, graphs in steps:
        q, k, v = rand(batch, 8, 1, 128), rand(batch, 2, kv_len, 128), rand(batch, 2, kv_len, 128)
        pad = torch.rand(batch, kv_len, device="cuda") > 0.2
        poison_allocator()
        with inductor_cute.enable(flex_decode=True), inductor_config.patch(fx_graph_cache=False):
            (out, lse), codes = run_keeping_code(compiled, q, k, v, pad)
        assert sum(c.count(OUR_CALL) for c in codes) == graphs
        ref, ref_lse = attend_padded(q.float(), k.float(), v.float(), pad)
        assert not out.isnan().any() and not lse.isnan().any(), "unwritten (poisoned) elements"
        assert_out_close(out, ref, q.dtype)
        assert_lse_close(lse, ref_lse)


def test_a_padding_mask_of_symbolic_length_runs_our_kernel():
    """An eager generate() recompiles transformers' compiled flex_attention once the KV length
    changes (automatic dynamic: that size alone turns symbolic), its (batch, kv_len) padding mask
    with it: our kernel runs in both graphs, reading the mask's rows at the stride its length gives,
    the second graph serving every later length; every element written and matching fp32."""
    torch._dynamo.reset()
    # static, then symbolic, then reused
    check_padded_steps(torch.compile(attend_padded), [(4, 1500, 1), (4, 1777, 1), (4, 1901, 0)])
    torch._dynamo.reset()


def test_a_padding_mask_symbolic_in_batch_and_length_runs_our_kernel():
    """dynamic=True: the mask's batch and length both symbolic; its row stride is the kv_len operand
    Dynamo captures beside it (translate.SizeOperand). One graph serves two batches and lengths,
    every element written and matching fp32."""
    torch._dynamo.reset()
    # batches 4 and 3: no other size equals them (duck sizing would share a symbol)
    check_padded_steps(torch.compile(attend_padded, dynamic=True), [(4, 1500, 1), (3, 1777, 0)])
    torch._dynamo.reset()


@pytest.mark.parametrize("padded, trace_block_masks, mode", [(False, False, None), (True, False, None),
                                                             (False, True, None), (True, True, None),
                                                             (False, True, "reduce-overhead")])
def test_transformers_llama_decode_step_runs_our_kernel(padded, trace_block_masks, mode):
    """A 2-layer Llama (head dim 128, 8 query heads on 2 KV heads), attn_implementation=
    "flex_attention", StaticCache: prefill eagerly, then a compiled decode step; every layer
    runs our kernel and the logits match the same weights on SDPA. With trace_block_masks the
    step is one graph (the BlockMask built in it, padded or not), also under CUDA graphs (none skipped; three
    replays, the position advancing, each matching SDPA)."""
    from torch._dynamo.utils import counters

    import inductor_cute

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    ids = torch.randint(0, 1024, (4, 303), device="cuda")
    attention_mask = torch.ones(4, 304, dtype=torch.long, device="cuda")
    if padded:
        attention_mask[1, :30] = 0
        attention_mask[3, :5] = 0
    steps = 3 if mode else 1
    logits = {}
    counters.clear()
    for attn_implementation in ("flex_attention", "sdpa"):
        torch.manual_seed(0)  # the same weights for both
        llama = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                           attn_implementation=attn_implementation).cuda().eval()
        cache = transformers.StaticCache(config=config, max_cache_len=512)
        llama(input_ids=ids[:, :300], attention_mask=attention_mask[:, :300], past_key_values=cache)
        forward = llama
        if attn_implementation == "flex_attention":
            with inductor_cute.enable(flex_decode=True, trace_block_masks=trace_block_masks):
                forward = torch.compile(llama, mode=mode)
                step = dict(input_ids=ids[:, 300:301], past_key_values=cache,
                            cache_position=torch.tensor([300], device="cuda"))
                if padded:
                    step["attention_mask"] = attention_mask[:, :301]
                out, codes = run_and_get_code(forward, **step)
            code = "\n".join(codes)
            assert code.count(OUR_CALL) == 2  # one per layer
            if trace_block_masks:
                assert code.count("# AOT ID:") == 1
            outs = [out.logits.float().clone()]
        else:
            outs = [llama(input_ids=ids[:, 300:301], past_key_values=cache,
                          cache_position=torch.tensor([300], device="cuda"),
                          **({"attention_mask": attention_mask[:, :301]} if padded else {})).logits.float()]
        for t in range(301, 300 + steps):  # later steps: replays under CUDA graphs
            step = dict(input_ids=ids[:, t:t + 1], past_key_values=cache, cache_position=torch.tensor([t], device="cuda"))
            if padded:
                step["attention_mask"] = attention_mask[:, :t + 1]
            outs.append(forward(**step).logits.float().clone())
        logits[attn_implementation] = outs
    if mode:
        assert counters["inductor"]["cudagraph_skips"] == 0
    for ours, ref in zip(logits["flex_attention"], logits["sdpa"]):
        assert (ours - ref).abs().max().item() < 5e-2


# --------------------------------------------------------- PyTorch's flex decoding test patterns

B, HQ, HKV, D = 4, 16, 8, 64  # PyTorch's test_flex_decoding shapes


def alibi_exp2(num_heads):
    def score_mod(score, b, h, q, kv):
        return score + (kv - q) * torch.exp2(-((h + 1) * 8.0 / num_heads))

    return score_mod


def score_mods():
    head_offset = torch.rand(HQ, device="cuda", dtype=torch.float16)
    scale = torch.ones((), device="cuda", dtype=torch.int32)
    seq_idx = torch.zeros(KV, device="cuda", dtype=torch.bool)
    seq_idx[KV // 2:] = True
    bias2, bias3, bias4 = (torch.randn(*shape, device="cuda") for shape in ((1, KV), (B, 1, KV), (B, HQ, 1, KV)))
    seq_len = torch.arange(B, device="cuda", dtype=torch.int32) + 1
    return {
        "alibi-exp2": alibi_exp2(HQ),
        "causal-where-inf": lambda s, b, h, q, kv: torch.where(q + 1000 >= kv, s, float("-inf")),
        "head-offset-fp16": lambda s, b, h, q, kv: s * head_offset[h],
        "captured-0d-int": lambda s, b, h, q, kv: s + scale,
        "bool-seq-mask": lambda s, b, h, q, kv: torch.where(seq_idx[q + KV - 1] == seq_idx[kv], s, float("-inf")),
        "bias-2d": lambda s, b, h, q, kv: s + bias2[q, kv],
        "bias-3d": lambda s, b, h, q, kv: s + bias3[b, q, kv],
        "bias-4d": lambda s, b, h, q, kv: s + bias4[b, h, q, kv],
        "padded-dense": lambda s, b, h, q, kv: torch.where(s <= seq_len[b], s, -float("inf")),
        "silu": lambda s, b, h, q, kv: torch.nn.functional.silu(s),
        "int-casts": lambda s, b, h, q, kv: s + (kv % 3 == 0).to(torch.int64) * 2 - (q > 0).float(),
        "negative-index-wrap": lambda s, b, h, q, kv: s + bias4[b - B, h - HQ, q - 1, kv - KV],
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["alibi-exp2", "causal-where-inf", "head-offset-fp16", "captured-0d-int",
                                  "bool-seq-mask", "bias-2d", "bias-3d", "bias-4d", "padded-dense", "silu",
                                  "int-casts", "negative-index-wrap"])
def test_flex_decoding_score_mods_run_our_kernel(name, dtype):
    q, k, v = rand(B, HQ, 1, D, dtype=dtype) * 3, rand(B, HKV, KV, D, dtype=dtype), rand(B, HKV, KV, D, dtype=dtype)
    check_ours(q, k, v, score_mod=score_mods()[name])


def paged_mask_mod(table, page, inner):
    def mask_mod(b, h, q_idx, physical_kv_idx):
        logical_block = table[b, physical_kv_idx // page]
        logical_kv_idx = logical_block * page + physical_kv_idx % page
        is_valid = (logical_block >= 0) & True & (logical_kv_idx >= 0)
        return torch.where(is_valid, inner(b, h, q_idx, logical_kv_idx), False)

    return mask_mod


def test_flex_decoding_mask_mods_run_our_kernel():
    offset = torch.tensor(KV // 2 - 3, device="cuda", dtype=torch.int32)
    head_type = torch.tensor([i % 3 != 0 for i in range(HQ)], device="cuda", dtype=torch.bool)
    table = torch.stack([torch.randperm(KV // 128, device="cuda") for _ in range(B)])  # int64 pages
    table[1, 3] = -1
    cases = [  # (mask_mod, mask heads, KV heads)
        (lambda b, h, q, kv: kv >= q + offset, 1, HKV),
        (lambda b, h, q, kv: head_type[h] & (q + KV - 1 >= kv), HQ, HQ),  # per-head mask without GQA
        (paged_mask_mod(table, 128, lambda b, h, q, kv: q + 1500 >= kv), 1, HKV),
    ]
    for mask_mod, heads, kv_heads in cases:
        torch._dynamo.reset()
        q, k, v = rand(B, HQ, 1, D) * 3, rand(B, kv_heads, KV, D), rand(B, kv_heads, KV, D)
        block_mask = create_block_mask(mask_mod, B, heads, 1, KV)
        check_ours(q, k, v, block_mask=block_mask, score_mod=alibi_exp2(HQ))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block", [64, (1, 64), 32])
def test_kv_blocks_smaller_than_the_kernels_run_our_kernel(dim, block):
    """PyTorch's decoding tests build BlockMasks of 64-key blocks: stages of 64 (or 32) rows."""
    torch._dynamo.reset()
    q, k, v = rand(B, HQ, 1, dim) * 3, rand(B, HKV, KV, dim), rand(B, HKV, KV, dim)
    block_mask = create_block_mask(lambda b, h, q, kv: q + KV // 2 + 17 >= kv, B, 1, 1, KV, BLOCK_SIZE=block)
    check_ours(q, k, v, block_mask=block_mask)


@pytest.mark.parametrize("dqk, dv", [(64, 32), (32, 64)])
def test_mixed_head_dims_run_our_kernel(dqk, dv):
    torch._dynamo.reset()
    q, k, v = rand(B, HQ, 1, dqk) * 3, rand(B, HKV, KV, dqk), rand(B, HKV, KV, dv)
    check_ours(q, k, v, score_mod=alibi_exp2(HQ))


@pytest.mark.parametrize("dim", [64, 128])
def test_kv_shared_by_the_batch_runs_our_kernel(dim):
    """K/V of batch 1 (one cache for every query batch, as paged attention holds it)."""
    torch._dynamo.reset()
    q, k, v = rand(B, HQ, 1, dim) * 3, rand(1, HKV, KV, dim), rand(1, HKV, KV, dim)
    check_ours(q, k, v, block_mask=create_block_mask(lambda b, h, q, kv: q + 1500 - 100 * b >= kv, B, 1, 1, KV))
    torch._dynamo.reset()
    check_ours(q, k, v, score_mod=alibi_exp2(HQ), block_mask=create_block_mask(noop_mask, B, 1, 1, KV))


def test_a_block_mask_per_query_head_under_gqa_runs_our_kernel():
    """PyTorch's decoding tests build masks per query head with GQA 2: one CTA per query head."""
    torch._dynamo.reset()
    q, k, v = rand(B, HQ, 1, D) * 3, rand(B, HKV, KV, D), rand(B, HKV, KV, D)
    head_type = torch.tensor([i % 3 != 0 for i in range(HQ)], device="cuda", dtype=torch.bool)
    check_ours(q, k, v, block_mask=create_block_mask(lambda b, h, q, kv: head_type[h] | (kv < 700), 1, HQ, 1, KV))


def test_what_the_kernel_cannot_take_goes_to_the_stock_lowering():
    q, k, v = rand(B, HQ, 1, D), rand(B, HKV, KV, D), rand(B, HKV, KV, D)
    torch._dynamo.reset()
    check_stock(q, k, v, block_mask=create_block_mask(noop_mask, B, 1, 1, KV, BLOCK_SIZE=16))  # < 32-row stages
    torch._dynamo.reset()  # head dims 80/80: no kernel variant
    q80, k80 = rand(B, HQ, 1, 80), rand(B, HKV, KV, 80)
    check_stock(q80, k80, rand(B, HKV, KV, 80), score_mod=alibi_exp2(HQ))


@pytest.mark.parametrize("flex_decode", [False, True], ids=["our flex off", "head dim 80 declined"])
def test_a_mask_padded_in_the_graph_reaches_the_stock_triton_kernel(flex_decode):
    # transformers pads its 2-D attention mask to the cache length; with the BlockMask traced the
    # pad sits in flex_attention's graph, and the stock lowering inlined it into its Triton
    # template, which crashed ('function' object has no attribute 'graph': Phi-3's padded decode,
    # H100). Our lowering realizes captured tensors before it hands a call to the stock one
    # (CPU twin: tests/test_block_masks.py)
    q, k, v = rand(2, 8, 1, 80), rand(2, 2, KV, 80), rand(2, 2, KV, 80)
    attention_mask = torch.ones(2, SEEN + 1, dtype=torch.bool, device="cuda")
    attention_mask[0, :37] = False  # left padding

    def attend(q, k, v, attention_mask):
        keep = torch.nn.functional.pad(attention_mask, (0, KV - attention_mask.shape[1]))

        def mask_mod(b, h, m, n):
            return (n <= SEEN) & keep[b, n]

        block_mask = create_block_mask(mask_mod, 2, None, 1, KV, device="cuda", _compile=True)
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    torch._dynamo.reset()
    with inductor_cute.enable(flex_decode=flex_decode), inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        out, codes = run_and_get_code(torch.compile(attend), q, k, v, attention_mask)
    assert OUR_CALL not in "\n".join(codes)
    ref = attend(q.float(), k.float(), v.float(), attention_mask)
    assert (out.float() - ref).abs().max().item() < 2e-2
