"""The prefill forward kernel on a Hopper GPU against an fp32 math reference: head dims, query and
key lengths that are not multiples of the blocks, GQA ratios, causal attention through a BlockMask
(torch's create_block_mask) with a mask program, score programs, logsumexp in natural-log units.
The allocator is poisoned with NaN first, so an output element the kernel never writes shows.

Written before the kernel ever ran on a GPU: a failure here is the kernel's first bug report."""

import dataclasses
import math

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.flex_prefill import flex_prefill
from inductor_cute.kernels.attention import flex_prefill_config as fpc
from inductor_cute.kernels.common.programs import score as sp

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-3
CAUSAL = sp.dumps([["o", "ge", "q", "kv"]])
SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
DOCUMENT = sp.dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["o", "eq", "qd", "kd"]])
NOTHING_IN_BATCH_1 = sp.dumps([["z", "eq", "b", 0], ["k", "lt", "kv", 1000], ["o", "and", "z", "k"]])


def poison_allocator(nbytes: int) -> None:
    """Fill a freed block of the caching allocator with NaN so that the next torch.empty calls
    (our output and lse) are likely to start from NaN, not zeros."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def reference(q, k, v, scale=None, score_mod=None, score_tensors=(), keep=None):
    """fp32 softmax(scale q k^T) v with GQA expansion, the score program applied to the scaled
    scores, over the keys `keep` (B, Hq, Lq, Lkv) holds; rows with no key give out 0, lse -inf."""
    b, hq, lq, dqk = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    vv = v.float().repeat_interleave(hq // hkv, dim=1)
    s = (q.float() @ kk.transpose(-1, -2)) * scale
    if score_mod is not None:
        idx = [torch.arange(n, device=q.device, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(s.shape)]
        s = sp.reference(score_mod, s, *idx, score_tensors)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vv, lse


def check(q, k, v, scale=None, score_mod=None, score_tensors=(), keep=None, **kwargs):
    ref_out, ref_lse = reference(q, k, v, scale, score_mod, score_tensors, keep)
    poison_allocator(8 * ref_out.numel() + (1 << 20))
    out, lse = flex_prefill(q, k, v, scale=scale, score_mod=score_mod, score_tensors=score_tensors, return_lse=True,
                            **kwargs)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    assert not lse.isnan().any(), "unwritten (poisoned) or NaN elements in the lse"
    err = (out.float() - ref_out).abs().max().item()
    assert err < TOL[q.dtype] * max(1.0, ref_out.abs().max().item()), f"out max error {err:.2e}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all(), "-inf lse rows differ"
    assert (out[empty] == 0).all(), "rows with nothing to attend must be 0"
    if (~empty).any():
        lse_err = (lse - ref_lse)[~empty].abs().max().item()
        assert lse_err < LSE_TOL * max(1.0, ref_lse[~empty].abs().max().item()), f"lse max error {lse_err:.2e}"


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(fpc, "GPU_UNCHECKED_HEAD_DIMS", set())  # these tests are their check


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256), (96, 96), (64, 32)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (100, 77), (128, 128), (129, 300), (1000, 1000), (255, 2049)])
def test_head_dims_and_lengths_off_the_blocks(dqk, dv, q_len, kv_len):
    check(rand(2, 4, q_len, dqk), rand(2, 4, kv_len, dqk), rand(2, 4, kv_len, dv))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(group):
    hkv = 2
    check(rand(2, hkv * group, 700, 128), rand(2, hkv, 900, 128), rand(2, hkv, 900, 128))


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128)])
def test_one_kv_cache_shared_by_the_batch(dqk, dv):
    """K/V of batch 1 for 3 query batches (kv_batch_broadcast): every batch reads the one cache,
    plain and causal through a block mask."""
    q, k, v = rand(3, 8, 300, dqk), rand(1, 2, 500, dqk), rand(1, 2, 500, dv)
    check(q, k, v)
    q = rand(3, 8, 500, dqk)
    check_block_mask(q, k, v, lambda b, h, m, n: m >= n, CAUSAL)


def test_many_tiles_and_a_long_sequence():
    check(rand(1, 16, 4096, 128), rand(1, 2, 4096, 128), rand(1, 2, 4096, 128))


def test_fp16_and_custom_scales():
    check(rand(2, 8, 300, 128, dtype=torch.float16), rand(2, 8, 500, 128, dtype=torch.float16),
          rand(2, 8, 500, 128, dtype=torch.float16), scale=0.3)
    check(rand(2, 8, 300, 64), rand(2, 2, 300, 64), rand(2, 2, 300, 64), scale=-0.1)


@pytest.mark.parametrize("scale", [0.2, -0.2, 0.0])
def test_scale_signs_with_masked_keys(scale):
    # a positive scale is folded into the softmax's exponent after masking (raw scores at -inf);
    # zero and negative scales scale first: masked keys must stay out whatever the sign
    check_block_mask(rand(1, 4, 700, 128), rand(1, 2, 700, 128), rand(1, 2, 700, 128), lambda b, h, m, n: m >= n,
                     CAUSAL, scale=scale)


def test_strided_views_as_models_hold_them():
    # (B, L, H, D) projections viewed as (B, H, L, D)
    q = rand(2, 333, 8, 128).transpose(1, 2)
    k, v = rand(2, 333, 2, 128).transpose(1, 2), rand(2, 333, 2, 128).transpose(1, 2)
    check(q, k, v)


def block_mask_of(mask_mod, batch, heads, q_len, kv_len, block):
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cuda", BLOCK_SIZE=block)
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)


def check_block_mask(q, k, v, mask_mod, program, tensors=(), block=128, mask_heads=None, **kwargs):
    batch, heads, q_len = q.shape[:3]
    kv_len = k.shape[2]
    blocks = block_mask_of(mask_mod, batch, mask_heads, q_len, kv_len, block)
    shape = (batch, heads, q_len, kv_len)
    keep = sp.reference_keep(shape, program, tensors, blocks, block, block, device="cuda")
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]
    assert torch.equal(keep, mask_mod(*idx).expand(shape)), "program and mask_mod differ"
    check(q, k, v, keep=keep, mask_mod=program, mask_tensors=tensors, kv_num_blocks=blocks[0], kv_indices=blocks[1],
          full_kv_num_blocks=blocks[2], full_kv_indices=blocks[3], kv_block_size=block, q_block_size=block, **kwargs)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("length", [128, 1000, 2048])
def test_causal_through_a_block_mask(group, length):
    hkv = 2
    check_block_mask(rand(2, hkv * group, length, 128), rand(2, hkv, length, 128), rand(2, hkv, length, 128),
                     lambda b, h, m, n: m >= n, CAUSAL)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_causal_with_256_blocks_and_a_per_head_mask(dqk, dv):
    # 256/256 runs 64-key blocks: four kernel blocks per mask block
    check_block_mask(rand(2, 4, 777, dqk), rand(2, 4, 777, dqk), rand(2, 4, 777, dv), lambda b, h, m, n: m >= n,
                     CAUSAL, block=256, mask_heads=4)


def test_document_mask_with_a_captured_tensor():
    doc = (torch.arange(1500, device="cuda") // 300).to(torch.int32)
    check_block_mask(rand(1, 8, 1500, 128), rand(1, 2, 1500, 128), rand(1, 2, 1500, 128),
                     lambda b, h, m, n: doc[m] == doc[n], DOCUMENT, (doc,))


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("q_block,kv_block", [(64, 64), (64, 128), (128, 64), (32, 32)])
def test_finer_block_masks_walked_at_the_kernels_blocks(dqk, dv, q_block, kv_block):
    """create_block_mask(BLOCK_SIZE=(q, kv)) of blocks finer than the kernel's: coarsened by the host,
    the fine blocks' states read by the mask program (host/flex_blocks.py). A document-causal mask
    with a captured tensor, lengths off every block."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = (torch.arange(1100, device="cuda") // 250).to(torch.int32)

    def doc_causal(b, h, m, n):
        return (doc[m] == doc[n]) & (m >= n)

    program = sp.dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["same", "eq", "qd", "kd"],
                        ["c", "ge", "q", "kv"], ["o", "and", "same", "c"]])
    q, k, v = rand(2, 4, 1000, dqk), rand(2, 2, 1100, dqk), rand(2, 2, 1100, dv)
    bm = create_block_mask(doc_causal, 2, None, 1000, 1100, device="cuda", BLOCK_SIZE=(q_block, kv_block))
    blocks = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    keep = sp.reference_keep((2, 4, 1000, 1100), program, (doc,), blocks, kv_block, q_block, device="cuda")
    check(q, k, v, keep=keep, mask_mod=program, mask_tensors=(doc,), kv_num_blocks=blocks[0], kv_indices=blocks[1],
          full_kv_num_blocks=blocks[2], full_kv_indices=blocks[3], kv_block_size=kv_block, q_block_size=q_block)


def test_block_lists_alone_of_finer_blocks():
    """Random 64 x 64 block lists and no mask_mod (BlockMask.from_kv_blocks's pure block sparsity):
    a coarse block mixes kept and skipped fine blocks, and only the kept ones may count."""
    from inductor_cute.host.flex_blocks import _as_lists

    g = torch.Generator(device="cuda").manual_seed(3)
    states = torch.randint(0, 3, (1, 4, 8, 9), device="cuda", generator=g)
    num, idx = _as_lists(states == 1)
    full_num, full_idx = _as_lists(states == 2)
    q, k, v = rand(1, 4, 500, 128), rand(1, 4, 560, 128), rand(1, 4, 560, 128)
    blocks = (num, idx, full_num, full_idx)
    keep = sp.reference_keep((1, 4, 500, 560), "", (), blocks, 64, 64, device="cuda")
    check(q, k, v, keep=keep, kv_num_blocks=num, kv_indices=idx, full_kv_num_blocks=full_num,
          full_kv_indices=full_idx, kv_block_size=64, q_block_size=64)


def test_rows_with_nothing_to_attend():
    # batch 1 keeps no key at all: its rows are out 0, lse -inf
    check_block_mask(rand(2, 4, 300, 128), rand(2, 4, 1200, 128), rand(2, 4, 1200, 128),
                     lambda b, h, m, n: (b == 0) & (n < 1000), NOTHING_IN_BATCH_1)


def test_mask_program_without_a_block_mask():
    q, k, v = rand(1, 4, 500, 128), rand(1, 4, 600, 128), rand(1, 4, 600, 128)
    keep = sp.reference_keep((1, 4, 500, 600), CAUSAL, device="cuda")
    check(q, k, v, keep=keep, mask_mod=CAUSAL)


def test_softcap_score_mod_with_causal_blocks():
    check_block_mask(rand(2, 8, 640, 128) * 4, rand(2, 2, 640, 128), rand(2, 2, 640, 128),
                     lambda b, h, m, n: m >= n, CAUSAL, score_mod=SOFTCAP)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_flex_attention_including_lse_units(causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = rand(2, 16, 1024, 128), rand(2, 4, 1024, 128), rand(2, 4, 1024, 128)
    kwargs, bm = {}, None
    if causal:
        bm = create_block_mask(lambda b, h, m, n: m >= n, None, None, 1024, 1024, device="cuda")
        kwargs = dict(mask_mod=CAUSAL, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices)
    ref_out, ref_lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    out, lse = flex_prefill(q, k, v, return_lse=True, **kwargs)
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-2
    assert (lse - ref_lse.float()).abs().max().item() < LSE_TOL * ref_lse.abs().max().item()


def test_empty_inputs():
    out, lse = flex_prefill(rand(1, 2, 5, 128), rand(1, 2, 0, 128), rand(1, 2, 0, 128), return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()
    assert flex_prefill(rand(1, 2, 0, 128), rand(1, 2, 7, 128), rand(1, 2, 7, 128)).shape == (1, 2, 0, 128)


def test_unsupported_inputs_are_refused_in_one_line():
    q = rand(1, 4, 256, 128)
    cases = [
        (lambda: flex_prefill(rand(1, 4, 256, 80), rand(1, 4, 256, 80), rand(1, 4, 256, 80)), "not supported"),
        (lambda: flex_prefill(q.float(), q.float(), q.float()), "bfloat16 or float16"),
        (lambda: flex_prefill(q, rand(1, 3, 256, 128), rand(1, 3, 256, 128)), "not a multiple"),
        (lambda: flex_prefill(q, q, q, mask_tensors=(q,)), "without a mask_mod"),
        (lambda: flex_prefill(q, q, q, kv_num_blocks=torch.ones(1, 1, 2, device="cuda", dtype=torch.int32)),
         "needs kv_num_blocks and kv_indices"),
    ]
    for call, message in cases:
        with pytest.raises(UnsupportedError, match=message) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("flex_prefill: ")


# ------------------------------------------------------------------------- persistent CTAs
def persistent(ctas=3, q_stages=1):
    """A config whose few CTAs each walk many tiles: the Q buffer(s) handed back and forth, the
    K/V ring's phases and the consumers' turns carried from tile to tile. Two Q buffers need a
    shallower K/V ring at 128/128."""
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    def config(dqk, dv):
        base = fpc.default_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"))
        stages = base.stages if q_stages == 1 or dqk == 64 else 2
        return dataclasses.replace(base, persistent_ctas=ctas, q_stages=q_stages, stages=stages)

    return config


@pytest.mark.parametrize("dqk,dv,q_stages", [(64, 64, 1), (128, 128, 1), (192, 128, 1), (64, 64, 2), (128, 128, 2)])
def test_persistent_ctas_walk_many_tiles(dqk, dv, q_stages):
    q, k, v = rand(2, 4, 1000, dqk), rand(2, 2, 1000, dqk), rand(2, 2, 1000, dv)
    check(q, k, v, config=persistent(q_stages=q_stages)(dqk, dv))  # 64 tiles on 3 CTAs


def test_persistent_ctas_with_causal_blocks_and_empty_tiles():
    # causal tiles of different lengths, and batch 1's tiles with no key at all (zero blocks)
    check_block_mask(rand(2, 4, 1500, 128), rand(2, 2, 1500, 128), rand(2, 2, 1500, 128),
                     lambda b, h, m, n: (m >= n) & (b == 0), sp.dumps([["c", "ge", "q", "kv"], ["z", "eq", "b", 0],
                                                                        ["o", "and", "c", "z"]]),
                     config=persistent(5)(128, 128))


def test_two_q_buffers_with_causal_blocks_and_empty_tiles():
    # the next tile's Q loads while this tile runs; O leaves through its own buffer
    check_block_mask(rand(2, 4, 1500, 64), rand(2, 2, 1500, 64), rand(2, 2, 1500, 64),
                     lambda b, h, m, n: (m >= n) & (b == 0), sp.dumps([["c", "ge", "q", "kv"], ["z", "eq", "b", 0],
                                                                        ["o", "and", "c", "z"]]),
                     config=persistent(5, q_stages=2)(64, 64))


def test_persistent_ctas_more_than_tiles():
    q, k, v = rand(1, 2, 200, 128), rand(1, 2, 700, 128), rand(1, 2, 700, 128)
    check(q, k, v, config=persistent(132)(128, 128))  # 4 tiles: the grid is cut to them


# ------------------------------------------------------------------------- split K/V rings
def split_kv(dqk, dv, **changes):
    """The default config with K and V in rings of their own (config.split_kv)."""
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    base = fpc.default_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"))
    return dataclasses.replace(base, split_kv=True, **changes)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (100, 77), (129, 300), (255, 2049)])
def test_split_kv_rings(dqk, dv, q_len, kv_len):
    q, k, v = rand(2, 4, q_len, dqk), rand(2, 2, kv_len, dqk), rand(2, 2, kv_len, dv)
    check(q, k, v, config=split_kv(dqk, dv))


@pytest.mark.parametrize("dqk,dv", [(128, 128), (192, 128)])
def test_split_kv_rings_with_causal_blocks_and_empty_tiles(dqk, dv):
    mask = sp.dumps([["c", "ge", "q", "kv"], ["z", "eq", "b", 0], ["o", "and", "c", "z"]])
    for config in (split_kv(dqk, dv), split_kv(dqk, dv, persistent_ctas=5)):  # one CTA per tile, then few CTAs
        check_block_mask(rand(2, 4, 1500, dqk), rand(2, 2, 1500, dqk), rand(2, 2, 1500, dv),
                         lambda b, h, m, n: (m >= n) & (b == 0), mask, config=config)


def test_split_kv_rings_on_persistent_ctas_with_two_q_buffers():
    check(rand(2, 4, 1000, 64), rand(2, 2, 1000, 64), rand(2, 2, 1000, 64),
          config=split_kv(64, 64, persistent_ctas=3, q_stages=2))



# ------------------------------------------------------- tiles claimed from a counter (dynamic_tiles)
def dynamic(dqk, dv, ctas=3, **changes):
    """The default config on `ctas` persistent CTAs that claim their tiles from a global counter."""
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    base = fpc.default_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"))
    return dataclasses.replace(base, persistent_ctas=ctas, dynamic_tiles=True, **changes)


def claim_counter():
    from inductor_cute.host.common import stream_scratch

    return stream_scratch(torch.device("cuda", torch.cuda.current_device()), (((2,), torch.int32, True),))[0]


@pytest.mark.parametrize("dqk,dv,changes", [(64, 64, dict(q_stages=2)), (128, 128, {}), (192, 128, {}),
                                            (128, 128, dict(split_kv=True, early_exps=20))])
def test_dynamic_tiles_walk_every_tile_once_and_leave_the_counter_zero(dqk, dv, changes):
    # 64 tiles on 3 CTAs, twice: a counter left non-zero would skip tiles of the second call
    # (their rows stay poisoned)
    for _ in range(2):
        q, k, v = rand(2, 4, 1000, dqk), rand(2, 2, 1000, dqk), rand(2, 2, 1000, dv)
        check(q, k, v, config=dynamic(dqk, dv, **changes))
        assert torch.equal(claim_counter(), torch.zeros(2, dtype=torch.int32, device="cuda"))


def test_dynamic_tiles_with_causal_blocks_empty_tiles_and_more_ctas_than_tiles():
    mask = sp.dumps([["c", "ge", "q", "kv"], ["z", "eq", "b", 0], ["o", "and", "c", "z"]])
    for ctas in (5, 132):  # 96 tiles of different lengths (batch 1's empty) on 5 CTAs; 132 cut to 96
        check_block_mask(rand(2, 4, 1500, 128), rand(2, 2, 1500, 128), rand(2, 2, 1500, 128),
                         lambda b, h, m, n: (m >= n) & (b == 0), mask, config=dynamic(128, 128, ctas))
    q, k, v = rand(1, 2, 200, 128), rand(1, 2, 700, 128), rand(1, 2, 700, 128)
    check(q, k, v, config=dynamic(128, 128, 132))  # 4 tiles: every CTA's first tile is its last


def test_dynamic_tiles_replay_in_a_cuda_graph():
    # capture gets a fresh zeroed counter (its memset is recorded too, so each replay starts from
    # zero; the eager test above checks the kernel's own reset): every replay computes every tile
    config = dynamic(128, 128, 7)
    q, k, v = rand(1, 8, 900, 128), rand(1, 2, 900, 128), rand(1, 2, 900, 128)
    flex_prefill(q, k, v, config=config)  # compiled and loaded outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = flex_prefill(q, k, v, config=config)
    for _ in range(3):
        q.copy_(rand(*q.shape))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(q, k, v, None, None, (), None)
        assert not out.isnan().any(), "a tile left unwritten"
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------- early exponentials (early_exps)
def early_exps(dqk, dv, **changes):
    """The default config with 5/8 of each row's exponentials made before the wait for P V."""
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    base = fpc.default_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"))
    return dataclasses.replace(base, early_exps=base.kv_block // 4 * 5 // 8, **changes)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (100, 77), (129, 300), (255, 2049)])
def test_early_exps(dqk, dv, q_len, kv_len):
    q, k, v = rand(2, 4, q_len, dqk), rand(2, 2, kv_len, dqk), rand(2, 2, kv_len, dv)
    check(q, k, v, config=early_exps(dqk, dv))


def test_early_exps_with_a_score_program_causal_blocks_split_kv_and_persistent_ctas():
    q, k, v = rand(2, 4, 700, 128), rand(2, 2, 700, 128), rand(2, 2, 700, 128)
    check(q, k, v, score_mod=SOFTCAP, config=early_exps(128, 128, split_kv=True, persistent_ctas=5))
    mask = sp.dumps([["o", "ge", "q", "kv"]])
    check_block_mask(rand(2, 4, 1500, 64), rand(2, 2, 1500, 64), rand(2, 2, 1500, 64), lambda b, h, m, n: m >= n,
                     mask, config=early_exps(64, 64, persistent_ctas=3, q_stages=2))


# ------------------------------------------------- exponentials on the FMA pipes (poly_exps)
def poly(dqk, dv, n, **changes):
    """The device default config with `n` of each row's values per block made by softmax.exp2_fma."""
    from inductor_cute.host.common import sm_count
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    base = fpc.default_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"), sm_count(0))
    return dataclasses.replace(base, poly_exps=n, **changes)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (129, 300), (1000, 1000), (255, 2049)])
@pytest.mark.parametrize("n", [8, "all"])
def test_poly_exps(dqk, dv, q_len, kv_len, n):
    q, k, v = rand(2, 4, q_len, dqk), rand(2, 2, kv_len, dqk), rand(2, 2, kv_len, dv)
    config = poly(dqk, dv, 0)
    check(q, k, v, config=poly(dqk, dv, config.kv_block // 4 if n == "all" else n))


def test_poly_exps_with_masked_rows_early_exps_a_score_program_and_fp16():
    # every exponential by the polynomial: -inf scores (masked keys, rows with no key) must give 0
    check_block_mask(rand(2, 4, 300, 64), rand(2, 4, 1200, 64), rand(2, 4, 1200, 64),
                     lambda b, h, m, n: (b == 0) & (n < 1000), NOTHING_IN_BATCH_1, config=poly(64, 64, 32))
    check_block_mask(rand(2, 4, 1500, 64), rand(2, 2, 1500, 64), rand(2, 2, 1500, 64), lambda b, h, m, n: m >= n,
                     CAUSAL, config=poly(64, 64, 12, early_exps=20))
    q, k, v = rand(2, 4, 700, 128), rand(2, 2, 700, 128), rand(2, 2, 700, 128)
    check(q, k, v, score_mod=SOFTCAP, config=poly(128, 128, 8))
    q, k, v = (rand(1, 8, 515, 64, dtype=torch.float16) for _ in range(3))
    check(q, k, v, scale=0.3, config=poly(64, 64, 16))


# ------------------------------- the next tile's S_0 under this tile's last P V (overlap_tiles)
def overlap(dqk, dv, ctas=3, **changes):
    """Persistent CTAs (a few: many tiles each) with two Q buffers and overlap_tiles."""
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    base = fpc.plain_config(fpc.FlexPrefillProblem(dqk, dv, "bfloat16"))
    config = dataclasses.replace(base, persistent_ctas=ctas, q_stages=2, overlap_tiles=True, **changes)
    if fpc.config_error(config, fpc.FlexPrefillProblem(dqk, dv, "bfloat16")):  # 128/128: a 2-stage ring fits
        config = dataclasses.replace(config, stages=2)
    return config


@pytest.mark.parametrize("dqk,dv", [(64, 64), (128, 128)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (100, 77), (129, 300), (1000, 1000), (255, 2049)])
@pytest.mark.parametrize("ctas", [1, 3, 132])
def test_overlap_tiles(dqk, dv, q_len, kv_len, ctas):
    q, k, v = rand(3, 4, q_len, dqk), rand(3, 2, kv_len, dqk), rand(3, 2, kv_len, dv)
    check(q, k, v, config=overlap(dqk, dv, ctas))


def test_overlap_tiles_with_programs_split_rings_early_and_poly_exps_and_fp16():
    q, k, v = rand(2, 4, 700, 128), rand(2, 2, 700, 128), rand(2, 2, 700, 128)
    check(q, k, v, score_mod=SOFTCAP, config=overlap(128, 128, 5, split_kv=True))
    # a mask program without a block mask: batch 1's rows have nothing to attend (out 0, lse -inf)
    q, k, v = rand(2, 4, 300, 64), rand(2, 4, 1200, 64), rand(2, 4, 1200, 64)
    keep = (torch.arange(2, device="cuda")[:, None, None, None] == 0) & (torch.arange(1200, device="cuda") < 1000)
    check(q, k, v, keep=keep.expand(2, 4, 300, 1200), mask_mod=NOTHING_IN_BATCH_1, config=overlap(64, 64, 2))
    q, k, v = rand(4, 8, 640, 64), rand(4, 2, 640, 64), rand(4, 2, 640, 64)
    check(q, k, v, config=overlap(64, 64, 7, early_exps=20, poly_exps=8))
    q, k, v = (rand(1, 8, 515, 64, dtype=torch.float16) for _ in range(3))
    check(q, k, v, scale=0.3, config=overlap(64, 64, 4))
