"""torch.compile(flex_attention) with inductor-cute enabled on the H200: decode calls with no mask
and no score_mod, or a translatable one (softcap, ALiBi), run our split-KV kernel (the output code
calls the custom op) and match an fp64 reference and eager flex_attention, lse included; an
untranslatable score_mod or a block mask we cannot walk goes to the stock lowering and still matches;
BlockMasks with translatable mask_mods (sliding window, causal with an offset, document, prefix-LM)
run our kernel; a graph from the FX cache works in a process that never lowered it. What
transformers and PyTorch's flex decoding tests hand the lowering: tests/gpu/test_flex_coverage_gpu.py."""

import json
import math
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute

pytestmark = pytest.mark.gpu
OUR_CALL = "inductor_cute.inductor.flex.runtime.FlexDecodeLauncher("  # one definition per call site
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-3


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        yield
    torch._dynamo.reset()


def compiled_run(*args, dynamic=None, **kwargs):
    with inductor_cute.enable(flex_decode=True):
        out, codes = run_and_get_code(torch.compile(flex_attention, dynamic=dynamic), *args, **kwargs)
    return out, "\n".join(codes)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def reference(q, k, v, scale=None):
    """fp64 softmax(scale q k^T) v with GQA, and its natural-log lse."""
    g = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v.double().repeat_interleave(g, 1), lse


def assert_out_close(out, ref, dtype):
    assert not out.isnan().any()
    assert (out.double() - ref.double()).abs().max().item() < TOL[dtype]


def assert_lse_close(lse, ref_lse):
    assert lse.dtype == torch.float32
    assert (lse.double() - ref_lse.double()).abs().max().item() < LSE_TOL * ref_lse.abs().max().item()


DECODE = [  # batch, q heads, kv heads, head dim, kv length, query length
    (2, 8, 2, 64, 1000, 1),
    (4, 32, 8, 128, 8192, 1),
    (8, 16, 8, 128, 4096, 1),
    (2, 32, 4, 64, 2048, 4),
    (8, 24, 8, 128, 1000, 4),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,kv_heads,dim,kv_len,q_len", DECODE)
def test_decode_runs_our_kernel_and_matches(batch, heads, kv_heads, dim, kv_len, q_len, dtype):
    q = rand(batch, heads, q_len, dim, dtype=dtype)
    k, v = rand(batch, kv_heads, kv_len, dim, dtype=dtype), rand(batch, kv_heads, kv_len, dim, dtype=dtype)
    (out, lse), code = compiled_run(q, k, v, enable_gqa=True, return_lse=True)
    assert code.count(OUR_CALL) == 1
    ref_out, ref_lse = reference(q, k, v)
    assert_out_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    eager_out, eager_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    assert_lse_close(lse, eager_lse)  # the public API's units (natural log)
    assert (out.float() - eager_out.float()).abs().max().item() < 2 * TOL[dtype]


def test_cuda_graph_trees_with_split_partials_and_a_gemv():
    """CUDA graphs on (max-autotune, our GEMMs only): CUDA-graph trees warm the graph up on their own stream with every
    allocation going to the graphs' pool, then record and replay it. Our split-KV partials and
    the GEMV's split-K workspace must not be kept from the warm-up (trees refuse an untracked pool
    allocation), and replays with new inputs must match."""
    proj = torch.nn.Linear(4096, 2048, bias=False).cuda().bfloat16()

    def step(x, k, v):
        q = proj(x).view(x.shape[0], 16, 1, 128)
        return flex_attention(q, k, v, enable_gqa=True)

    x, k, v = rand(8, 4096), rand(8, 4, 8192, 128), rand(8, 4, 8192, 128)
    with inductor_cute.enable(flex_decode=True), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(step, mode="max-autotune")
        _, codes = run_and_get_code(fn, x, k, v)  # the warm-up
        for _ in range(2):  # record, replay
            fn(x, k, v)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            k.copy_(torch.randn_like(k))
            got = fn(x, k, v).clone()
            torch.cuda.synchronize()
            q = proj(x).view(8, 16, 1, 128)
            assert_out_close(got, reference(q, k, v)[0], torch.bfloat16)
    code = "\n".join(codes)
    assert OUR_CALL in code and "inductor_cute.inductor.gemm.runtime.GemmLauncher(" in code


def test_scale_and_out_only():
    q, k, v = rand(2, 16, 1, 128), rand(2, 4, 3000, 128), rand(2, 4, 3000, 128)
    out, code = compiled_run(q, k, v, enable_gqa=True, scale=0.3)
    assert OUR_CALL in code
    assert_out_close(out, reference(q, k, v, scale=0.3)[0], torch.bfloat16)


def test_kv_cache_view_with_heads_inner_and_dynamic_length():
    """A (batch, max_len, heads, dim) cache sliced to the current length: a strided view, streamed
    in place; the length changes between calls (dynamic=True)."""
    cache_k, cache_v = rand(4, 4096, 8, 128), rand(4, 4096, 8, 128)
    q = rand(4, 32, 1, 128)
    compiled = torch.compile(flex_attention, dynamic=True)
    codes = []
    # not run_and_get_code: it calls torch._dynamo.reset() first, so its second call always recompiled
    with inductor_cute.enable(flex_decode=True), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        for kv_len in (1000, 1537):
            k, v = cache_k[:, :kv_len].transpose(1, 2), cache_v[:, :kv_len].transpose(1, 2)
            out = compiled(q, k, v, enable_gqa=True)
            assert_out_close(out, reference(q, k, v)[0], torch.bfloat16)
            if kv_len == 1000:
                assert len(codes) == 1 and OUR_CALL in codes[0]
    assert len(codes) == 1, "the second length recompiled"


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def sine(score, b, h, m, n):
    return score + torch.sin(score)  # no sin in score programs


def test_untranslatable_score_mod_goes_to_the_stock_lowering():
    q, k, v = rand(4, 32, 1, 128), rand(4, 8, 2048, 128), rand(4, 8, 2048, 128)
    out, code = compiled_run(q, k, v, score_mod=sine, enable_gqa=True)
    assert OUR_CALL not in code
    ref = flex_attention(q, k, v, score_mod=sine, enable_gqa=True)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def check_score_mod_runs_our_kernel(score_mod, q, k, v):
    (out, lse), code = compiled_run(q, k, v, score_mod=score_mod, enable_gqa=True, return_lse=True)
    assert code.count(OUR_CALL) == 1
    ref_out, ref_lse = flex_attention(q.float(), k.float(), v.float(), score_mod=score_mod, enable_gqa=True,
                                      return_lse=True)
    assert_out_close(out, ref_out, q.dtype)
    assert_lse_close(lse, ref_lse)
    plain = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert (plain - ref_out).abs().max().item() > 0.1, "inputs too flat to see the score_mod"


@pytest.mark.parametrize("q_len", [1, 4])
def test_softcap_runs_our_kernel_and_matches(q_len):
    q = rand(4, 32, q_len, 128) * 3  # scores of several units: the cap matters
    check_score_mod_runs_our_kernel(softcap, q, rand(4, 8, 2048, 128), rand(4, 8, 2048, 128))


def test_alibi_runs_our_kernel_and_matches():
    heads = 32
    slopes = torch.exp2(-8 * torch.arange(1, heads + 1, device="cuda", dtype=torch.float32) / heads)

    def alibi(score, b, h, m, n):
        return score + slopes[h] * (n - m)

    check_score_mod_runs_our_kernel(alibi, rand(2, heads, 2, 128) * 3, rand(2, 8, 3000, 128),
                                    rand(2, 8, 3000, 128))


KV = 3000
OFFSETS = torch.tensor([KV - 1, 1000, 17, 2500], dtype=torch.int32)
DOC_IDS = (torch.arange(KV) // 700).to(torch.int32)


def mask_mods():
    offsets, doc = OFFSETS.cuda(), DOC_IDS.cuda()
    return {
        "sliding": lambda b, h, m, n: (m + KV - 4 >= n) & (m + KV - 4 - n < 512),
        "causal-captured-offset": lambda b, h, m, n: m + offsets[b] >= n,
        "document": lambda b, h, m, n: (doc[n] == doc[m + KV - 4]) & (m + KV - 4 >= n),
        "prefix-lm": lambda b, h, m, n: (n < 300) | (m + KV - 4 >= n),
        "sink-and-window": lambda b, h, m, n: (n < 256) | (n >= KV - 512),
        "empty-batch-1": lambda b, h, m, n: (b == 0) & (n < 1000),
    }


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("name", ["sliding", "causal-captured-offset", "document", "prefix-lm", "sink-and-window",
                                  "empty-batch-1"])
@pytest.mark.parametrize("group", [1, 8])
def test_block_mask_runs_our_kernel_and_matches(name, block, group):
    mask_mod = mask_mods()[name]
    q = rand(4, 2 * group, 4, 128) * 3
    k, v = rand(4, 2, KV, 128), rand(4, 2, KV, 128)
    block_mask = create_block_mask(mask_mod, 4, None, 4, KV, BLOCK_SIZE=block)
    (out, lse), code = compiled_run(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    assert code.count(OUR_CALL) == 1
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True,
                                  return_lse=True)
    assert_out_close(out, ref, q.dtype)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    assert_lse_close(lse[~empty], ref_lse[~empty])
    if name == "empty-batch-1":
        assert empty[1].all()


def test_block_mask_with_a_dynamic_length():
    """Causal-window with the decode offset, the cache view's length changing between calls
    (dynamic=True) with a new BlockMask each time. dynamic=True makes the block sizes symbols
    (specialised by the lowering) and a closure int offset a SymInt operand of the mask_mod, which
    the lowering hands over as a 1-element tensor: both forms run our kernel (CPU twin:
    test_flex_lowering.test_block_mask_under_dynamic_shapes_is_taken)."""
    cache_k, cache_v = rand(2, 4096, 8, 128), rand(2, 4096, 8, 128)
    q = rand(2, 32, 1, 128) * 3
    for kv_len in (1000, 1537):
        k, v = cache_k[:, :kv_len].transpose(1, 2), cache_v[:, :kv_len].transpose(1, 2)
        offset = kv_len - 1
        offsets = torch.tensor([offset], device="cuda", dtype=torch.int32)
        for mask_mod, ours in ((lambda b, h, m, n: (m + offsets[0] >= n) & (m + offsets[0] - n < 300), True),
                               (lambda b, h, m, n: (m + offset >= n) & (m + offset - n < 300), True)):
            torch._dynamo.reset()
            block_mask = create_block_mask(mask_mod, None, None, 1, kv_len)
            out, code = compiled_run(q, k, v, block_mask=block_mask, enable_gqa=True, dynamic=True)
            assert (OUR_CALL in code) == ours
            ref = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True)
            assert_out_close(out, ref, q.dtype)


def test_block_mask_per_query_head_under_gqa_runs_unpacked_and_matches():
    q, k, v = rand(2, 16, 1, 128), rand(2, 4, 2048, 128), rand(2, 4, 2048, 128)
    per_head = create_block_mask(lambda b, h, m, n: (n < 256 * (h + 1)), None, 16, 1, 2048)  # GQA 4
    out, code = compiled_run(q, k, v, block_mask=per_head, enable_gqa=True)
    assert OUR_CALL in code
    ref = flex_attention(q.float(), k.float(), v.float(), block_mask=per_head, enable_gqa=True)
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_block_mask_we_cannot_walk_goes_to_the_stock_lowering():
    q, k, v = rand(2, 16, 1, 128), rand(2, 4, 2048, 128), rand(2, 4, 2048, 128)
    small = create_block_mask(mask_mods()["sink-and-window"], None, None, 1, 2048, BLOCK_SIZE=16)  # < our 32-row stages
    torch._dynamo.reset()
    out, code = compiled_run(q, k, v, block_mask=small, enable_gqa=True)
    assert OUR_CALL not in code
    ref = flex_attention(q, k, v, block_mask=small, enable_gqa=True)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_unsupported_head_dim_and_long_query_go_to_the_stock_lowering():
    # head dim 80: no kernel variant (96, once declined here, is Phi-3's and has one)
    for q, kv in ((rand(2, 8, 1, 80), rand(2, 2, 1024, 80)), (rand(1, 8, 128, 128), rand(1, 2, 1024, 128))):
        torch._dynamo.reset()
        out, code = compiled_run(q, kv, kv, enable_gqa=True)
        assert OUR_CALL not in code
        assert (out.float() - flex_attention(q, kv, kv, enable_gqa=True).float()).abs().max().item() < 2e-2


# The second process configures Inductor directly (no enable()): the FX cache key is the same,
# the wrapper is not installed, and the cached code must import what registers the op itself.
CACHED_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention
    import inductor_cute
    if sys.argv[1] == "enable":
        # what choices_factory(flex_decode=True) spells: no grouped GEMV, no MoE passes
        inductor_cute.enable(flex_decode=True, group_gemv=False, moe_routing=False, fuse_moe_gate=False,
                             fuse_moe_gather=False, moe_scatters=False)
    else:
        from inductor_cute.inductor import choices_factory
        torch._inductor.config.inductor_choices_class = choices_factory(flex_decode=True)
        torch._inductor.config.max_autotune_gemm_backends += ",ICUTE"
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    q = torch.randn(2, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    registered_before = "inductor_cute.inductor.flex.lowering" in sys.modules
    out = torch.compile(flex_attention)(q, k, v, enable_gqa=True)
    err = (out.float() - flex_attention(q, k, v, enable_gqa=True).float()).abs().max().item()
    print(json.dumps({"fx_hits": counters["inductor"]["fxgraph_cache_hit"], "err": err,
                      "registered_before": registered_before}))
""")


def test_fx_cached_graph_runs_in_a_fresh_process(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               INDUCTOR_CUTE_CACHE_DIR=str(tmp_path / "cute"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    runs = []
    for how in ("enable", "direct"):
        proc = subprocess.run([sys.executable, "-c", CACHED_SCRIPT, how], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["fx_hits"] == 0 and second["fx_hits"] >= 1 and not second["registered_before"]
    assert first["err"] < 2e-2 and second["err"] < 2e-2
