"""torch.compile(flex_attention) with inductor_cute.enable(flex_prefill=True) on the H200: inference
calls with queries longer than the decode kernel takes run our prefill kernel (output code calls a
FlexPrefillLauncher) and match an fp32 reference, lse included (natural log, as the public API
returns it): causal, sliding window, a document mask over a captured tensor, softcap, GQA, query
lengths that are not multiples of 128, a dynamic query length. The allocator is poisoned with NaN
first, so an output element never written shows. Training graphs, the setting off and head dims
the kernel lacks go to the stock lowering. CPU twin: tests/test_flex_prefill_lowering.py."""

import math
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute

pytestmark = pytest.mark.gpu
OUR_PREFILL_CALL = "inductor_cute.inductor.flex.runtime.FlexPrefillLauncher("  # one definition per call site
OUR_CALL = "inductor_cute.inductor.flex.runtime.FlexDecodeLauncher("
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-3


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        yield
    torch._dynamo.reset()


def compiled_run(*args, flex_prefill=True, **kwargs):
    with inductor_cute.enable(flex_decode=True, flex_prefill=flex_prefill):
        out, codes = run_and_get_code(torch.compile(flex_attention), *args, **kwargs)
    return out, "\n".join(codes)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def poison_allocator(nbytes: int) -> None:
    """Fill a freed block of the caching allocator with NaN: our outputs likely start from it."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def reference(q, k, v, scale=None, score_mod=None, mask_mod=None):
    """fp32 softmax(score_mod(scale q k^T)) v with GQA over the keys mask_mod keeps, evaluated
    densely; rows with no key give out 0 and lse -inf (natural log)."""
    b, hq, lq, dqk = q.shape
    g = hq // k.shape[1]
    scale = 1 / math.sqrt(dqk) if scale is None else scale
    s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(s.shape)]
    if score_mod is not None:
        s = score_mod(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*idx).expand(s.shape), float("-inf"))
    lse = s.logsumexp(-1)
    p = (s - lse[..., None]).exp().nan_to_num(0.0)
    return p @ v.float().repeat_interleave(g, 1), lse


def check(out, lse, ref_out, ref_lse, dtype):
    assert out.shape == ref_out.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (poisoned) or NaN elements"
    err = (out.float() - ref_out).abs().max().item()
    assert err < TOL[dtype] * max(1.0, ref_out.abs().max().item()), f"out max error {err:.2e}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    lse_err = (lse - ref_lse)[~empty].abs().max().item()
    assert lse_err < LSE_TOL * max(1.0, ref_lse[~empty].abs().max().item()), f"lse max error {lse_err:.2e}"


def causal(b, h, m, n):
    return m >= n


def sliding_window(b, h, m, n):
    return (m >= n) & (m - n < 256)


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def run_and_check(batch, heads, kv_heads, q_len, kv_len, dqk, dv, dtype=torch.bfloat16, score_mod=None,
                  mask_mod=None, block_size=128, scale=None):
    q, k, v = rand(batch, heads, q_len, dqk, dtype=dtype), rand(batch, kv_heads, kv_len, dqk, dtype=dtype), \
        rand(batch, kv_heads, kv_len, dv, dtype=dtype)
    kwargs = {"score_mod": score_mod, "scale": scale}
    if mask_mod is not None:
        kwargs["block_mask"] = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cuda",
                                                 BLOCK_SIZE=block_size)
    poison_allocator(8 * batch * heads * q_len * dv + (1 << 20))
    (out, lse), code = compiled_run(q, k, v, enable_gqa=True, return_lse=True, **kwargs)
    assert code.count(OUR_PREFILL_CALL) == 1 and OUR_CALL not in code
    check(out, lse, *reference(q, k, v, scale, score_mod, mask_mod), dtype)
    return q, k, v, code


CASES = {  # batch, heads, kv heads, q length, kv length, head dims, dtype, score_mod, mask_mod
    "plain": (2, 8, 8, 256, 256, 128, 128, torch.bfloat16, None, None),
    "causal": (2, 16, 16, 1024, 1024, 128, 128, torch.bfloat16, None, causal),
    "causal Lq 1000 GQA 4": (2, 16, 4, 1000, 1000, 128, 128, torch.bfloat16, None, causal),
    "sliding window fp16": (1, 8, 2, 2048, 2048, 64, 64, torch.float16, None, sliding_window),
    "softcap GQA 4": (2, 8, 2, 700, 900, 128, 128, torch.bfloat16, softcap, None),
    "softcap causal d256": (1, 8, 8, 513, 513, 256, 256, torch.bfloat16, softcap, causal),
    "MLA 192/128 causal": (1, 16, 16, 333, 333, 192, 128, torch.bfloat16, None, causal),
    "Lq 65": (2, 8, 2, 65, 300, 64, 64, torch.bfloat16, None, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_runs_our_kernel_and_matches(case):
    batch, heads, kv_heads, q_len, kv_len, dqk, dv, dtype, score_mod, mask_mod = case
    run_and_check(batch, heads, kv_heads, q_len, kv_len, dqk, dv, dtype, score_mod, mask_mod)


@pytest.mark.parametrize("block_size", [64, (64, 128), (128, 32)])
def test_finer_block_masks_run_our_kernel_and_match(block_size):
    """BlockMasks of (query, key) blocks finer than the kernel's 128 x 128: walked coarsened."""
    run_and_check(2, 8, 2, 700, 900, 128, 128, mask_mod=sliding_window, block_size=block_size)


def test_document_mask_over_a_captured_tensor():
    doc_ids = (torch.arange(1500, device="cuda") // 400).to(torch.int32)  # four documents, one partial

    def document_causal(b, h, m, n):
        return (doc_ids[m] == doc_ids[n]) & (m >= n)

    run_and_check(2, 16, 4, 1500, 1500, 128, 128, mask_mod=document_causal, block_size=256, scale=0.1)


def test_chunked_prefill_with_a_captured_offset():
    offset = torch.tensor([1000], device="cuda", dtype=torch.int32)  # 300 new queries after 1000 cached keys

    def chunk_causal(b, h, m, n):
        return m + offset[0] >= n

    run_and_check(2, 8, 2, 300, 1300, 128, 128, mask_mod=chunk_causal)


def test_a_dynamic_query_length_reuses_the_graph():
    codes = []
    # return_lse's deprecation warning is shown once, behind a guard on the set of warnings shown:
    # show it before compiling, or the second call recompiles for it (stock alike)
    flex_attention(*(rand(1, 1, 16, 128) for _ in range(3)), return_lse=True)
    compiled = torch.compile(flex_attention, dynamic=True)
    # not run_and_get_code: it calls torch._dynamo.reset() first, so its second call always recompiled
    with inductor_cute.enable(flex_prefill=True), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        for q_len in (300, 1111):
            q, k, v = rand(2, 8, q_len, 128), rand(2, 2, q_len, 128), rand(2, 2, q_len, 128)
            block_mask = create_block_mask(causal, None, None, q_len, q_len, device="cuda")
            out, lse = compiled(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
            check(out, lse, *reference(q, k, v, mask_mod=causal), torch.bfloat16)
    assert len(codes) == 1 and OUR_PREFILL_CALL in codes[0], "the second length recompiled"


def test_the_setting_off_and_unsupported_head_dims_go_stock():
    q, k, v = rand(1, 8, 500, 128), rand(1, 8, 500, 128), rand(1, 8, 500, 128)
    out, code = compiled_run(q, k, v, flex_prefill=False)
    assert OUR_PREFILL_CALL not in code and OUR_CALL not in code
    assert (out.float() - reference(q, k, v)[0]).abs().max().item() < TOL[torch.bfloat16]
    q, k, v = rand(1, 8, 500, 32), rand(1, 8, 500, 32), rand(1, 8, 500, 32)  # a head dim we lack
    out, code = compiled_run(q, k, v)
    assert OUR_PREFILL_CALL not in code
    assert (out.float() - reference(q, k, v)[0]).abs().max().item() < TOL[torch.bfloat16]


def test_a_training_graph_goes_stock():
    q, k, v = (rand(1, 4, 300, 64).requires_grad_() for _ in range(3))
    with torch.enable_grad():
        out, code = compiled_run(q, k, v)
        out.float().sum().backward()
    assert OUR_PREFILL_CALL not in code
    assert (out.detach().float() - reference(q.detach(), k.detach(), v.detach())[0]).abs().max().item() < 2e-2
    assert q.grad is not None and not q.grad.isnan().any()
