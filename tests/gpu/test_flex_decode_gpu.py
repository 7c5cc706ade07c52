"""The split-KV decode kernel on a Hopper GPU against an fp64 math reference: head dims, GQA ratios,
KV lengths around the block size, batches, query lengths, per-batch lengths with an empty
sequence, forced split counts. The allocator is poisoned with NaN first, so an output or
workspace element the kernels never write shows."""

import math

import pytest
import torch

from inductor_cute import UnsupportedError, ops
from inductor_cute.kernels.attention import flex_decode_config as fdc
from inductor_cute.kernels.common.programs import score as sp

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = 2e-3


def poison_allocator(nbytes: int) -> None:
    """Fill a freed block of the caching allocator with NaN so that the next torch.empty calls
    (our output and workspace) are likely to start from NaN, not zeros."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), device="cuda", dtype=torch.float32)
    del junk


def reference(q, k, v, scale=None, kv_len=None, score_mod=None, score_tensors=(), keep=None):
    """fp64 softmax(scale q k^T) v with GQA expansion (the score program in fp32 on fp64-accurate
    scores), over the keys `keep` (B, Hq, Lq, Lkv) holds; rows with no key give out 0, lse -inf."""
    b, hq, lq, dqk = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if score_mod is not None:
        idx = [torch.arange(n, device=q.device, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(s.shape)]
        s = sp.reference(score_mod, s.float(), *idx, score_tensors).double()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if kv_len is not None:
        past_end = torch.arange(lkv, device=q.device)[None, :] >= kv_len.long()[:, None]  # (b, lkv)
        s = s.masked_fill(past_end[:, None, None, :], float("-inf"))
        vv = vv.masked_fill(past_end[:, None, :, None], 0.0)  # keys past the end are not attended at all
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ vv, lse


def check(q, k, v, scale=None, kv_len=None, num_splits=None, score_mod=None, score_tensors=(), keep=None,
          **mask_args):
    ref_out, ref_lse = reference(q, k, v, scale, kv_len, score_mod, score_tensors, keep)
    poison_allocator(64 * ref_out.numel() + (1 << 20))
    out, lse = ops.flex_decode(q, k, v, scale=scale, kv_len=kv_len, return_lse=True, num_splits=num_splits,
                               score_mod=score_mod, score_tensors=score_tensors, **mask_args)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    assert not lse.isnan().any(), "unwritten (poisoned) or NaN elements in the lse"
    tol = TOL[q.dtype]
    err = (out.double() - ref_out).abs().max().item()
    assert err < tol * max(1.0, ref_out.abs().max().item()), f"out max error {err:.2e}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all(), "-inf lse rows differ"
    assert (out[empty] == 0).all(), "rows with nothing to attend must be 0"
    lse_err = (lse.double() - ref_lse)[~empty].abs().max().item() if (~empty).any() else 0.0
    assert lse_err < LSE_TOL * max(1.0, ref_lse[~empty].abs().max().item()), f"lse max error {lse_err:.2e}"


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128), (576, 512), (64, 32), (32, 64), (96, 96)]
KV_LENS = [1, 7, 127, 128, 129, 1000, 8192]


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setattr(fdc, "GPU_UNCHECKED_HEAD_DIMS", set())  # these tests are their check


@pytest.mark.parametrize("dqk,dv", HEAD_DIMS)
@pytest.mark.parametrize("kv", KV_LENS)
def test_head_dims_and_kv_lengths(dqk, dv, kv):
    hq, hkv = (16, 1) if dqk == 576 else (8, 2)
    check(rand(2, hq, 1, dqk), rand(2, hkv, kv, dqk), rand(2, hkv, kv, dv))


@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("q_len", [1, 4, 64])
def test_gqa_ratios_and_query_lengths(group, q_len):
    hkv = 2
    check(rand(3, hkv * group, q_len, 128), rand(3, hkv, 1000, 128), rand(3, hkv, 1000, 128))


@pytest.mark.parametrize("batch", [1, 2, 5, 16, 64])
def test_batches(batch):
    check(rand(batch, 32, 1, 128), rand(batch, 8, 777, 128), rand(batch, 8, 777, 128))


def test_absorbed_mla_many_heads_one_kv_head():
    # 128 query heads x Lq 2 = 256 packed rows: four row tiles reading the same KV
    check(rand(2, 128, 2, 576), rand(2, 1, 3000, 576), rand(2, 1, 3000, 512))


def test_long_sequence():
    check(rand(1, 64, 1, 128), rand(1, 8, 131072, 128), rand(1, 8, 131072, 128))


@pytest.mark.parametrize("dqk,dv", [(128, 128), (576, 512)])
def test_per_batch_lengths_with_an_empty_sequence(dqk, dv):
    hq, hkv = (16, 1) if dqk == 576 else (16, 4)
    kv_len = torch.tensor([0, 1, 129, 1000, 2048, 2047], device="cuda", dtype=torch.int32)
    check(rand(6, hq, 4, dqk), rand(6, hkv, 2048, dqk), rand(6, hkv, 2048, dv), kv_len=kv_len)


def test_cache_rows_past_kv_len_are_never_read_into_the_result():
    # a KV cache's unused tail may hold anything; NaN or Inf there must not reach the output
    kv_len = torch.tensor([200, 1, 1000], device="cuda", dtype=torch.int32)
    k, v = rand(3, 2, 1024, 128), rand(3, 2, 1024, 128)
    for b, n in enumerate(kv_len.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("inf") if b % 2 else float("nan")
    check(rand(3, 8, 2, 128), k, v, kv_len=kv_len)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_forced_split_counts(num_splits):
    # more splits than blocks leaves empty splits: they must contribute nothing
    kv_len = torch.tensor([5000, 300], device="cuda", dtype=torch.int32)
    check(rand(2, 8, 1, 128), rand(2, 1, 5000, 128), rand(2, 1, 5000, 128), kv_len=kv_len, num_splits=num_splits)


def test_fp16_and_custom_scale():
    check(rand(4, 8, 2, 128, dtype=torch.float16), rand(4, 8, 500, 128, dtype=torch.float16),
          rand(4, 8, 500, 128, dtype=torch.float16), scale=0.3)
    check(rand(2, 8, 1, 64), rand(2, 2, 300, 64), rand(2, 2, 300, 64), scale=-0.1)


def test_strided_views_of_a_cache():
    # q from a (B, Lq, H, D) projection, k/v the first 1000 slots of a longer (B, Lmax, H, D) cache
    q = rand(2, 4, 32, 128).transpose(1, 2)
    cache_k, cache_v = rand(2, 4096, 8, 128), rand(2, 4096, 8, 128)
    check(q, cache_k[:, :1000].transpose(1, 2), cache_v[:, :1000].transpose(1, 2))


def test_matches_torch_flex_attention_including_lse_units():
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = rand(2, 16, 1, 128), rand(2, 4, 1024, 128), rand(2, 4, 1024, 128)
    ref_out, ref_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    out, lse = ops.flex_decode(q, k, v, return_lse=True)
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-2
    assert (lse - ref_lse.float()).abs().max().item() < LSE_TOL * ref_lse.abs().max().item()


SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = sp.dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
                  ["o", "add", "score", "bias"]])
# Query and key indices together: a penalty for keys past the query's position plus a per-batch
# offset read from an int32 tensor, and an integer parity term.
INDICES = sp.dumps([["off", "load", "t0", "b"], ["pos", "add", "q", "off"], ["ahead", "gt", "kv", "pos"],
                    ["pen", "where", "ahead", -4.0, 0.0], ["r", "remainder", "kv", 3], ["odd", "ne", "r", 0],
                    ["half", "where", "odd", 0.5, 0.0], ["x", "add", "score", "pen"], ["o", "add", "x", "half"]])


def sharp(*shape, dtype=torch.bfloat16):
    """q scaled so the scores spread over several units: a score_mod then moves the result by
    more than the tolerance (checked in test_score_mods_change_the_result)."""
    return rand(*shape, dtype=dtype) * 3


@pytest.mark.parametrize("dqk,dv", [(128, 128), (64, 64), (576, 512)])
@pytest.mark.parametrize("q_len", [1, 4])
def test_softcap(dqk, dv, q_len):
    hq, hkv = (16, 1) if dqk == 576 else (16, 4)
    kv_len = torch.tensor([1000, 129, 1], device="cuda", dtype=torch.int32)
    check(sharp(3, hq, q_len, dqk), rand(3, hkv, 1000, dqk), rand(3, hkv, 1000, dv), kv_len=kv_len, score_mod=SOFTCAP)


@pytest.mark.parametrize("slope_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 7])
def test_alibi(slope_dtype, num_splits):
    hq = 32
    slopes = torch.exp2(-8 * torch.arange(1, hq + 1, device="cuda") / hq).to(slope_dtype)
    kv_len = torch.tensor([2000, 777], device="cuda", dtype=torch.int32)
    check(sharp(2, hq, 2, 128), rand(2, 8, 2000, 128), rand(2, 8, 2000, 128), kv_len=kv_len, num_splits=num_splits,
          score_mod=ALIBI, score_tensors=(slopes,))


def test_score_mod_on_query_and_key_indices():
    offsets = torch.tensor([300, 5, 1000], device="cuda", dtype=torch.int32)
    kv_len = torch.tensor([1024, 600, 1024], device="cuda", dtype=torch.int32)
    check(sharp(3, 8, 4, 128, dtype=torch.float16), rand(3, 2, 1024, 128, dtype=torch.float16),
          rand(3, 2, 1024, 128, dtype=torch.float16), kv_len=kv_len, scale=0.1, score_mod=INDICES,
          score_tensors=(offsets,))


NEGATIVE_INTS = sp.dumps([["d", "sub", "q", "kv"], ["r", "remainder", "d", 3], ["f", "floordiv", "d", 400],
                         ["rf", "float", "r"], ["ff", "float", "f"], ["a", "mul", "rf", 1.5], ["x", "add", "score", "a"],
                         ["o", "add", "x", "ff"]])


def test_remainder_and_floordiv_of_negative_ints_follow_torch():
    # q - kv < 0 almost everywhere: torch.remainder takes the divisor's sign (the DSL's Int32 `%`
    # truncates like C), floor division floors; a wrong sign moves scores by up to 3 and 1
    kv_len = torch.tensor([1000, 333], device="cuda", dtype=torch.int32)
    check(sharp(2, 8, 2, 128), rand(2, 2, 1000, 128), rand(2, 2, 1000, 128), kv_len=kv_len, score_mod=NEGATIVE_INTS)


def test_negative_load_indices_count_from_the_end():
    # score + table[q - kv]: q - kv <= 1 here, mostly negative; torch indexing wraps those
    table = torch.randn(1000, device="cuda", dtype=torch.float32) * 2
    program = sp.dumps([["d", "sub", "q", "kv"], ["x", "load", "t0", "d"], ["o", "add", "score", "x"]])
    check(sharp(2, 8, 2, 128), rand(2, 2, 1000, 128), rand(2, 2, 1000, 128), score_mod=program,
          score_tensors=(table,))


def test_score_mods_change_the_result():
    # the tests above would not notice an ignored score_mod unless it moves the output
    q, k, v = sharp(2, 16, 1, 128), rand(2, 4, 1000, 128), rand(2, 4, 1000, 128)
    slopes = torch.exp2(-torch.arange(1, 17, device="cuda", dtype=torch.float32) / 2)
    plain = reference(q, k, v)[0]
    for program, tensors in ((SOFTCAP, ()), (ALIBI, (slopes,))):
        assert (reference(q, k, v, score_mod=program, score_tensors=tensors)[0] - plain).abs().max() > 0.1


def test_matches_torch_flex_attention_with_a_score_mod():
    from torch.nn.attention.flex_attention import flex_attention

    slopes = torch.exp2(-torch.arange(1, 17, device="cuda", dtype=torch.float32) / 2)
    q, k, v = sharp(2, 16, 1, 128), rand(2, 4, 1024, 128), rand(2, 4, 1024, 128)
    ref_out, ref_lse = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True, return_lse=True,
                                      score_mod=lambda s, b, h, m, n: s + slopes[h] * (n - m))
    out, lse = ops.flex_decode(q, k, v, return_lse=True, score_mod=ALIBI, score_tensors=(slopes,))
    assert (out.float() - ref_out).abs().max().item() < 2e-2
    assert (lse - ref_lse).abs().max().item() < LSE_TOL * ref_lse.abs().max().item()


def test_unsupported_inputs_are_refused_in_one_line():
    q, kv = rand(1, 8, 1, 128), rand(1, 3, 16, 128)
    with pytest.raises(UnsupportedError, match="^flex_decode: 8 query heads are not a multiple of 3 KV heads$"):
        ops.flex_decode(q, kv, kv)
    with pytest.raises(UnsupportedError, match="head dims 80/80"):
        ops.flex_decode(rand(1, 8, 1, 80), rand(1, 8, 16, 80), rand(1, 8, 16, 80))
    with pytest.raises(UnsupportedError, match="must all be bfloat16 or float16"):
        ops.flex_decode(q.float(), kv.float(), kv.float())
    with pytest.raises(UnsupportedError, match="strides"):
        k = rand(1, 8, 16, 129)[..., :128]  # rows 129 elements apart: not 16-byte aligned
        ops.flex_decode(q, k, k)
    with pytest.raises(UnsupportedError, match="^flex_decode: score_mod: score step slope: load of unknown tensor"):
        ops.flex_decode(q, rand(1, 8, 16, 128), rand(1, 8, 16, 128), score_mod=ALIBI)
    with pytest.raises(UnsupportedError, match="float64 is not supported"):
        ops.flex_decode(q, rand(1, 8, 16, 128), rand(1, 8, 16, 128), score_mod=ALIBI,
                        score_tensors=(torch.ones(8, device="cuda", dtype=torch.float64),))


# ------------------------------------------------------------------ mask_mod and block masks

KV = 3000  # cache length; the decoding queries sit at KV - Lq + i
DOC_IDS = (torch.arange(KV) // 700).to(torch.int32)  # five documents
# mask programs (q is the query's index 0..Lq-1; the offset puts it at its cache position)
SLIDING = sp.dumps([["pos", "add", "q", KV - 4], ["c", "ge", "pos", "kv"], ["d", "sub", "pos", "kv"],
                    ["w", "lt", "d", 512], ["o", "and", "c", "w"]])
CAUSAL_OFFSET = sp.dumps([["off", "load", "t0", "b"], ["pos", "add", "q", "off"], ["o", "ge", "pos", "kv"]])
DOCUMENT = sp.dumps([["pos", "add", "q", KV - 4], ["qd", "load", "t0", "pos"], ["kd", "load", "t0", "kv"],
                     ["same", "eq", "qd", "kd"], ["c", "ge", "pos", "kv"], ["o", "and", "same", "c"]])
PREFIX_LM = sp.dumps([["pre", "lt", "kv", 300], ["pos", "add", "q", KV - 4], ["c", "ge", "pos", "kv"],
                      ["o", "or", "pre", "c"]])
NOTHING_IN_BATCH_1 = sp.dumps([["z", "eq", "b", 0], ["c", "lt", "kv", 1000], ["o", "and", "z", "c"]])


def mask_mods(offsets, doc):
    """The Python mask_mods the programs above stand for (create_block_mask builds the blocks)."""
    return {
        "sliding": lambda b, h, m, n: (m + KV - 4 >= n) & (m + KV - 4 - n < 512),
        "causal-offset": lambda b, h, m, n: m + offsets[b] >= n,
        "document": lambda b, h, m, n: (doc[n] == doc[m + KV - 4]) & (m + KV - 4 >= n),
        "prefix-lm": lambda b, h, m, n: (n < 300) | (m + KV - 4 >= n),
        "empty-batch-1": lambda b, h, m, n: (b == 0) & (n < 1000),
    }


PROGRAMS = {"sliding": (SLIDING, "none"), "causal-offset": (CAUSAL_OFFSET, "offsets"),
            "document": (DOCUMENT, "doc"), "prefix-lm": (PREFIX_LM, "none"),
            "empty-batch-1": (NOTHING_IN_BATCH_1, "none")}


def check_block_mask(name, q, k, v, block, kv_len=None, num_splits=None, score_mod=None, score_tensors=()):
    """ours with create_block_mask's BlockMask and the mask program against the fp64 reference on
    the keys torch keeps (the program is first checked to be the Python mask_mod, densely)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, heads, q_len = q.shape[:3]
    offsets = torch.tensor([KV - 4, 1000, 17][:batch], device="cuda", dtype=torch.int32)
    doc = DOC_IDS.cuda()
    mask_mod = mask_mods(offsets, doc)[name]
    program, captured = PROGRAMS[name]
    tensors = {"none": (), "offsets": (offsets,), "doc": (doc,)}[captured]
    bm = create_block_mask(mask_mod, batch, None, q_len, KV, device="cuda", BLOCK_SIZE=block)
    blocks = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    shape = (batch, heads, q_len, KV)
    keep = sp.reference_keep(shape, program, tensors, blocks, block, block, device="cuda")
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]
    assert torch.equal(keep, mask_mod(*idx).expand(shape)), "program and mask_mod differ"
    check(q, k, v, kv_len=kv_len, num_splits=num_splits, score_mod=score_mod, score_tensors=score_tensors,
          keep=keep, mask_mod=program, mask_tensors=tensors, kv_num_blocks=blocks[0], kv_indices=blocks[1],
          full_kv_num_blocks=blocks[2], full_kv_indices=blocks[3], kv_block_size=block, q_block_size=block)


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("group", [1, 8])
def test_block_masks(name, block, group):
    hkv = 2
    check_block_mask(name, sharp(3, hkv * group, 4, 128), rand(3, hkv, KV, 128), rand(3, hkv, KV, 128), block)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (256, 256), (192, 128), (576, 512)])
def test_block_masks_over_kernel_sub_blocks(dqk, dv):
    # kernel KV blocks of 64 and 32 keys: each mask block is 2 or 4 pipeline stages
    hq, hkv = (16, 1) if dqk == 576 else (8, 2)
    check_block_mask("document", sharp(2, hq, 2, dqk), rand(2, hkv, KV, dqk), rand(2, hkv, KV, dv), 128)


@pytest.mark.parametrize("num_splits", [None, 1, 5, 64])
def test_block_mask_with_kv_len_and_forced_splits(num_splits):
    # kv_len cuts into listed blocks (and past one's end); fully masked rows of batch 1
    kv_len = torch.tensor([2500, 900, 129], device="cuda", dtype=torch.int32)
    for name in ("prefix-lm", "empty-batch-1"):
        check_block_mask(name, sharp(3, 16, 1, 128), rand(3, 2, KV, 128), rand(3, 2, KV, 128), 128, kv_len=kv_len,
                         num_splits=num_splits)


def test_mask_program_without_a_block_mask_and_with_a_score_mod():
    q, k, v = sharp(2, 16, 1, 128), rand(2, 4, KV, 128), rand(2, 4, KV, 128)
    shape = (2, 16, 1, KV)
    keep = sp.reference_keep(shape, PREFIX_LM, device="cuda")
    check(q, k, v, keep=keep, mask_mod=PREFIX_LM, score_mod=SOFTCAP)


def test_masks_change_the_result():
    q, k, v = sharp(2, 16, 1, 128), rand(2, 4, KV, 128), rand(2, 4, KV, 128)
    keep = sp.reference_keep((2, 16, 1, KV), SLIDING, device="cuda")
    assert (reference(q, k, v, keep=keep)[0] - reference(q, k, v)[0]).abs().max() > 0.1


def test_matches_torch_flex_attention_with_a_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = sharp(2, 16, 1, 128), rand(2, 4, KV, 128), rand(2, 4, KV, 128)
    bm = create_block_mask(mask_mods(None, None)["sliding"], None, None, 1, KV, device="cuda")
    ref_out, ref_lse = flex_attention(q.float(), k.float(), v.float(), block_mask=bm, enable_gqa=True,
                                      return_lse=True)
    out, lse = ops.flex_decode(q, k, v, return_lse=True, mask_mod=SLIDING, kv_num_blocks=bm.kv_num_blocks,
                               kv_indices=bm.kv_indices, full_kv_num_blocks=bm.full_kv_num_blocks,
                               full_kv_indices=bm.full_kv_indices)
    assert (out.float() - ref_out).abs().max().item() < 2e-2
    assert (lse - ref_lse).abs().max().item() < LSE_TOL * ref_lse.abs().max().item()


PER_HEAD_PREFIX = sp.dumps([["w", "mul", "h", 250], ["lim", "add", "w", 300], ["o", "lt", "kv", "lim"]])


@pytest.mark.parametrize("group, q_len, block", [(4, 1, 128), (8, 4, 128), (4, 2, 64)])
def test_block_masks_per_query_head_under_gqa(group, q_len, block):
    """The query heads of a KV head get different block lists: one CTA per query head (unpacked)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, hkv = 2, 2
    heads = hkv * group

    def mask_mod(b, h, m, n):
        return n < 300 + 250 * h

    bm = create_block_mask(mask_mod, None, heads, q_len, KV, device="cuda", BLOCK_SIZE=block)
    blocks = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    shape = (batch, heads, q_len, KV)
    keep = sp.reference_keep(shape, PER_HEAD_PREFIX, (), blocks, block, block, device="cuda")
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]
    assert torch.equal(keep, mask_mod(*idx).expand(shape)), "program and mask_mod differ"
    check(sharp(batch, heads, q_len, 128), rand(batch, hkv, KV, 128), rand(batch, hkv, KV, 128), keep=keep,
          mask_mod=PER_HEAD_PREFIX, kv_num_blocks=blocks[0], kv_indices=blocks[1], full_kv_num_blocks=blocks[2],
          full_kv_indices=blocks[3], kv_block_size=block, q_block_size=block)


def test_block_masks_we_cannot_walk_are_refused():
    q, kv = rand(1, 8, 1, 128), rand(1, 2, 1024, 128)
    num, idx = torch.ones(1, 8, 1, device="cuda", dtype=torch.int32), torch.zeros(1, 8, 1, 8, device="cuda",
                                                                                  dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="the block mask has 2 heads; expected 1 or 8"):
        ops.flex_decode(q, kv, kv, kv_num_blocks=num[:, :2], kv_indices=idx[:, :2])
    with pytest.raises(UnsupportedError, match="not a multiple"):
        ops.flex_decode(q, kv, kv, kv_num_blocks=num[:, :1], kv_indices=idx[:, :1], kv_block_size=16)
