"""The backward kernels on a Hopper GPU: dq, dk, dv against torch autograd of an fp64 attention
reference, judged by the error torch's own computation in the inputs' dtype makes; head dims,
lengths off the blocks, GQA ratios, causal attention through a BlockMask (both its list sets),
a mask program with a captured tensor, rows with nothing to attend, lse from our forward kernel
or from the reference, and torch's flex_attention backward. The allocator is poisoned with NaN
first, so a gradient element the kernels never write shows.

Written before the kernels ever ran on a GPU: a failure here is their first bug report."""

import math

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.flex_backward import flex_attention_backward
from inductor_cute.host.flex_prefill import flex_prefill
from inductor_cute.kernels.common.programs import score as sp

from .test_flex_prefill_gpu import poison_allocator

pytestmark = pytest.mark.gpu

CAUSAL = sp.dumps([["o", "ge", "q", "kv"]])
CAUSAL_OFFSET_200 = sp.dumps([["s", "add", "q", 200], ["o", "ge", "s", "kv"]])  # queries after 200 cached keys
DOCUMENT = sp.dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["o", "eq", "qd", "kd"]])
NOTHING_IN_BATCH_1 = sp.dumps([["z", "eq", "b", 0], ["k", "lt", "kv", 1000], ["o", "and", "z", "k"]])
SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])


def reference(q, k, v, grad_out, scale=None, keep=None, dtype=torch.float64, score=None):
    """(out, lse, dq, dk, dv) of softmax(scale q k^T) v by torch autograd in `dtype`, GQA by
    repeating K/V heads, over the keys `keep` (B, Hq, Lq, Lkv) holds, the scores through
    `score(s, b, h, q, kv)` (a score_mod on broadcasting index tensors) if given; a row with no
    key gives out 0, lse -inf and no gradient."""
    hq, hkv, dqk = q.shape[1], k.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    qf, kf, vf = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = (qf @ kf.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * scale
    if score is not None:
        idx = [torch.arange(n, device=q.device).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(s.shape)]
        s = score(s, *idx).to(dtype)  # a captured fp32 tensor promotes a bf16 reference's scores
    any_key = torch.ones(s.shape[:-1] + (1,), dtype=torch.bool, device=q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
        any_key = keep.any(-1, keepdim=True)
    lse = torch.logsumexp(s.detach().double(), -1)
    p = torch.softmax(torch.where(any_key, s, torch.zeros_like(s)), -1) * any_key
    out = p @ vf.repeat_interleave(hq // hkv, 1)
    out.backward(grad_out.to(dtype))
    return out.detach(), lse.float(), qf.grad, kf.grad, vf.grad


def check(q, k, v, scale=None, keep=None, lse_from="reference", grad_out=None, score=None, **kwargs):
    grad_out = torch.randn_like(q[..., :v.shape[3]]) if grad_out is None else grad_out
    ref_out, ref_lse, *ref_grads = reference(q, k, v, grad_out, scale, keep, score=score)
    _, _, *low_grads = reference(q, k, v, grad_out, scale, keep, dtype=q.dtype, score=score)
    fwd_kwargs = {key: val for key, val in kwargs.items() if key not in ("q_lists", "config")}
    if lse_from == "kernel":
        out, lse = flex_prefill(q, k, v, scale=scale, return_lse=True, **fwd_kwargs)
    else:
        out, lse = ref_out.to(q.dtype), ref_lse
    bwd_kwargs = {**fwd_kwargs, **kwargs.get("q_lists", {}), "config": kwargs.get("config")}
    poison_allocator(8 * (q.numel() + k.numel() + v.numel()) + (1 << 20))
    grads = flex_attention_backward(q, k, v, out, lse, grad_out, scale=scale, **bwd_kwargs)
    for name, got, ref, low, like in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, (q, k, v)):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        assert not got.isnan().any(), f"{name}: unwritten (poisoned) or NaN elements"
        err = (got.double() - ref).abs().max().item()
        low_err = (low.double() - ref).abs().max().item()
        bound = 2 * low_err + 1e-3 * max(1.0, ref.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e}, torch in {q.dtype} {low_err:.3e}"
    return grads


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (100, 77), (128, 128), (129, 300), (1000, 1000), (255, 2049)])
def test_head_dims_and_lengths_off_the_blocks(d, q_len, kv_len):
    check(rand(2, 4, q_len, d), rand(2, 4, kv_len, d), rand(2, 4, kv_len, d))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios_sum_dk_dv_over_the_query_heads(group):
    hkv = 2
    check(rand(2, hkv * group, 700, 128), rand(2, hkv, 900, 128), rand(2, hkv, 900, 128))


def test_fp16_and_custom_scales():
    check(rand(2, 8, 300, 128, dtype=torch.float16), rand(2, 8, 500, 128, dtype=torch.float16),
          rand(2, 8, 500, 128, dtype=torch.float16), scale=0.3)
    check(rand(2, 8, 300, 64), rand(2, 2, 300, 64), rand(2, 2, 300, 64), scale=-0.1)


def test_strided_views_as_models_hold_them():
    q = rand(2, 333, 8, 128).transpose(1, 2)
    k, v = rand(2, 333, 2, 128).transpose(1, 2), rand(2, 333, 2, 128).transpose(1, 2)
    check(q, k, v, grad_out=rand(2, 333, 8, 128).transpose(1, 2))


def test_lse_and_out_from_our_forward_kernel():
    check(rand(2, 8, 1000, 128), rand(2, 2, 1000, 128), rand(2, 2, 1000, 128), lse_from="kernel")


def block_mask_kwargs(mask_mod, batch, heads, q_len, kv_len, block):
    """The entry's keyword arguments for torch's BlockMask of `mask_mod`: both list sets. `block`:
    one size, or (query block, KV block) as create_block_mask takes them."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cuda", BLOCK_SIZE=block)
    q_block, kv_block = block if isinstance(block, tuple) else (block, block)
    return dict(kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices, full_kv_num_blocks=bm.full_kv_num_blocks,
                full_kv_indices=bm.full_kv_indices, kv_block_size=kv_block, q_block_size=q_block,
                q_lists=dict(q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices,
                             full_q_num_blocks=bm.full_q_num_blocks, full_q_indices=bm.full_q_indices))


def check_block_mask(q, k, v, mask_mod, program, tensors=(), block=128, mask_heads=None, **kwargs):
    batch, heads, q_len = q.shape[:3]
    kv_len = k.shape[2]
    mask = block_mask_kwargs(mask_mod, batch, mask_heads, q_len, kv_len, block)
    fwd = (mask["kv_num_blocks"], mask["kv_indices"], mask["full_kv_num_blocks"], mask["full_kv_indices"])
    shape = (batch, heads, q_len, kv_len)
    keep = sp.reference_keep(shape, program, tensors, fwd, mask["kv_block_size"], mask["q_block_size"], device="cuda")
    idx = [torch.arange(n, device="cuda").view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]
    assert torch.equal(keep, mask_mod(*idx).expand(shape)), "program and mask_mod differ"
    return check(q, k, v, keep=keep, mask_mod=program, mask_tensors=tensors, **mask, **kwargs)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("length", [128, 1000, 2048])
def test_causal_through_a_block_mask(group, length):
    hkv = 2
    check_block_mask(rand(2, hkv * group, length, 128), rand(2, hkv, length, 128), rand(2, hkv, length, 128),
                     lambda b, h, m, n: m >= n, CAUSAL)


@pytest.mark.parametrize("d", [64, 128])
def test_causal_with_256_blocks_and_a_per_head_mask(d):
    check_block_mask(rand(2, 4, 777, d), rand(2, 4, 777, d), rand(2, 4, 777, d), lambda b, h, m, n: m >= n,
                     CAUSAL, block=256, mask_heads=4)


def test_causal_block_mask_with_lse_from_our_forward():
    check_block_mask(rand(1, 8, 1000, 64), rand(1, 2, 1000, 64), rand(1, 2, 1000, 64), lambda b, h, m, n: m >= n,
                     CAUSAL, lse_from="kernel")


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("d", [64, 128])
def test_block_masks_of_finer_blocks_than_the_kernels(block, d):
    """BLOCK_SIZE 64 and 32: both list sets coarsened to 128 x 128 from the forward's, the fine
    blocks' states read by the mask program (host walked_block_masks); lse from our forward, which
    walks the same mask its own way; a per-head mask and lengths off the blocks."""
    check_block_mask(rand(2, 4, 777, d), rand(2, 2, 777, d), rand(2, 2, 777, d), lambda b, h, m, n: m >= n,
                     CAUSAL, block=block, mask_heads=4, lse_from="kernel")


@pytest.mark.parametrize("block", [(256, 64), (64, 128)])  # (query block, KV block)
def test_mixed_finer_blocks_and_fewer_queries_than_keys(block):
    """One side finer, the other a multiple; 700 queries over 900 keys (the mask offset by the 200
    cached ones)."""
    check_block_mask(rand(2, 4, 700, 128), rand(2, 2, 900, 128), rand(2, 2, 900, 128),
                     lambda b, h, m, n: m + 200 >= n, CAUSAL_OFFSET_200, block=block, lse_from="kernel")


def test_document_mask_of_64_blocks_with_a_captured_tensor():
    doc = (torch.arange(1500, device="cuda") // 300).to(torch.int32)
    check_block_mask(rand(1, 8, 1500, 128), rand(1, 2, 1500, 128), rand(1, 2, 1500, 128),
                     lambda b, h, m, n: doc[m] == doc[n], DOCUMENT, (doc,), block=64)


def test_document_mask_with_a_captured_tensor():
    doc = (torch.arange(1500, device="cuda") // 300).to(torch.int32)
    check_block_mask(rand(1, 8, 1500, 128), rand(1, 2, 1500, 128), rand(1, 2, 1500, 128),
                     lambda b, h, m, n: doc[m] == doc[n], DOCUMENT, (doc,))


def test_rows_with_nothing_to_attend_get_zero_gradients():
    # batch 1 keeps no key at all: its lse is -inf and every gradient of it 0
    dq, dk, dv = check_block_mask(rand(2, 4, 300, 128), rand(2, 4, 1200, 128), rand(2, 4, 1200, 128),
                                  lambda b, h, m, n: (b == 0) & (n < 1000), NOTHING_IN_BATCH_1, lse_from="kernel")
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[0, :, 1000:] == 0).all()


def test_mask_program_without_a_block_mask():
    q, k, v = rand(1, 4, 500, 128), rand(1, 4, 600, 128), rand(1, 4, 600, 128)
    keep = sp.reference_keep((1, 4, 500, 600), CAUSAL, device="cuda")
    check(q, k, v, keep=keep, mask_mod=CAUSAL)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_flex_attention_backward(causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = rand(2, 16, 1024, 128), rand(2, 4, 1024, 128), rand(2, 4, 1024, 128)
    grad_out = rand(2, 16, 1024, 128)
    kwargs, bm = {}, None
    if causal:
        bm = create_block_mask(lambda b, h, m, n: m >= n, None, None, 1024, 1024, device="cuda")
        kwargs = dict(mask_mod=CAUSAL, kv_num_blocks=bm.kv_num_blocks, kv_indices=bm.kv_indices,
                      full_kv_num_blocks=bm.full_kv_num_blocks, full_kv_indices=bm.full_kv_indices,
                      q_num_blocks=bm.q_num_blocks, q_indices=bm.q_indices, full_q_num_blocks=bm.full_q_num_blocks,
                      full_q_indices=bm.full_q_indices)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = flex_attention(*leaves, block_mask=bm, enable_gqa=True, return_lse=True)
    ref_out.backward(grad_out)
    grads = flex_attention_backward(q, k, v, ref_out.detach(), ref_lse.detach().float(), grad_out, **kwargs)
    for name, got, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        ref = leaf.grad.float()
        err = (got.float() - ref).abs().max().item()
        assert err < 2e-2 * max(1.0, ref.abs().max().item()), f"{name}: max difference {err:.3e} from torch"


@pytest.mark.parametrize("dq_reduce", [False, True])
def test_k_and_v_shared_by_the_query_batches(dq_reduce):
    # one K/V of batch 1 for three query batches: dk and dv (batch 1) sum over them; lse from the
    # reference, then from our forward kernel taking the shared cache itself
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    config = FlexBackwardConfig(**DQ_REDUCE) if dq_reduce else None
    q, k, v = rand(3, 8, 300, 128), rand(1, 2, 500, 128), rand(1, 2, 500, 128)
    check(q, k, v, config=config)
    check(q, k, v, lse_from="kernel", config=config)


def test_empty_inputs():
    q = rand(1, 2, 5, 128)
    empty = rand(1, 2, 0, 128)
    dq, dk, dv = flex_attention_backward(q, empty, empty, q, torch.zeros(1, 2, 5, device="cuda"), q)
    assert (dq == 0).all() and dk.shape == dv.shape == (1, 2, 0, 128)


def test_unsupported_inputs_are_refused_in_one_line():
    q = rand(1, 4, 256, 128)
    lse = torch.zeros(1, 4, 256, device="cuda")
    q96 = rand(1, 4, 256, 96)
    cases = [
        (lambda: flex_attention_backward(q96, q96, q96, q96, lse, q96), "head dims 96/96"),
        (lambda: flex_attention_backward(q, q, q, q, lse, q, score_mod=CAUSAL), "score_mod: score program must end"),
        (lambda: flex_attention_backward(q, q, q, q, lse.double(), q), "lse must be"),
        (lambda: flex_attention_backward(q, q, q, q, lse, q, mask_tensors=(lse.flatten(),)), "without a mask_mod"),
    ]
    for call, message in cases:
        with pytest.raises(UnsupportedError, match=message) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("flex_backward: ")


@pytest.mark.parametrize("d, overlap", [(64, True), (128, False)])
def test_overlapped_schedules(d, overlap):
    # dq_overlap at both head dims, the dK/dV kernel's overlap where it fits (64/64)
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    config = FlexBackwardConfig(4, 4, overlap=overlap, dq_overlap=True)
    check(rand(2, 8, 1000, d), rand(2, 2, 1000, d), rand(2, 2, 1000, d), config=config)
    check_block_mask(rand(1, 8, 777, d), rand(1, 2, 777, d), rand(1, 2, 777, d), lambda b, h, m, n: m >= n, CAUSAL,
                     config=config)


@pytest.mark.parametrize("d", [64, 128])
def test_exp_under_dp(d):
    # S and dP committed apart, P exponentiated while dP computes (both kernels; and with dq_reduce)
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    for config in (FlexBackwardConfig(4, 4, exp_under_dp=True), FlexBackwardConfig(**DQ_REDUCE, exp_under_dp=True)):
        check(rand(2, 8, 1000, d), rand(2, 2, 1000, d), rand(2, 2, 1000, d), config=config)
        check_block_mask(rand(1, 8, 777, d), rand(1, 2, 777, d), rand(1, 2, 777, d), lambda b, h, m, n: m >= n,
                         CAUSAL, config=config)


DQ_REDUCE = dict(stages=3, dq_stages=4, dq_reduce=True)


@pytest.mark.parametrize("ds_buffers", [1, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group, q_len, kv_len", [(1, 128, 128), (4, 1000, 1000), (2, 300, 1111)])
def test_dq_reduce_five_products(group, q_len, kv_len, d, ds_buffers):
    # dq from the dK/dV kernel (TMA reduce into an fp32 workspace): lengths off the blocks (keys
    # past the end in the last KV block), GQA (dq per query head, dk/dv summed over them); at d64
    # each warp group adds all columns over its own keys; one dS buffer or one per block parity
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    config = FlexBackwardConfig(**DQ_REDUCE, ds_buffers=ds_buffers)
    check(rand(2, 2 * group, q_len, d), rand(2, 2, kv_len, d), rand(2, 2, kv_len, d), config=config)
    check(rand(1, 8, q_len, d), rand(1, 2, kv_len, d), rand(1, 2, kv_len, d), lse_from="kernel", config=config)


@pytest.mark.parametrize("ds_buffers", [1, 2])
def test_dq_reduce_with_block_masks(ds_buffers):
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    config = FlexBackwardConfig(**DQ_REDUCE, ds_buffers=ds_buffers)
    check_block_mask(rand(2, 8, 1000, 128), rand(2, 2, 1000, 128), rand(2, 2, 1000, 128), lambda b, h, m, n: m >= n,
                     CAUSAL, config=config)
    doc = (torch.arange(1500, device="cuda") // 300).to(torch.int32)
    check_block_mask(rand(1, 8, 1500, 128), rand(1, 2, 1500, 128), rand(1, 2, 1500, 128),
                     lambda b, h, m, n: doc[m] == doc[n], DOCUMENT, (doc,), block=256, config=config)
    dq, dk, dv = check_block_mask(rand(2, 4, 300, 128), rand(2, 4, 1200, 128), rand(2, 4, 1200, 128),
                                  lambda b, h, m, n: (b == 0) & (n < 1000), NOTHING_IN_BATCH_1, lse_from="kernel",
                                  config=config)
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


ALIBI = sp.dumps([["d", "sub", "kv", "q"], ["df", "float", "d"], ["sl", "load", "t0", "h"], ["bi", "mul", "sl", "df"],
                  ["o", "add", "score", "bi"]])


def softcap(s, b, h, m, n):
    return 30 * torch.tanh(s / 30)


@pytest.mark.parametrize("d, q_len, kv_len", [(128, 1000, 1000), (64, 300, 777)])
def test_score_mod_gradients_softcap(d, q_len, kv_len):
    # the score program recomputed and differentiated in both main kernels: scores scaled large
    # enough for tanh to bend (scale 0.5)
    q, k, v = rand(2, 8, q_len, d), rand(2, 2, kv_len, d), rand(2, 2, kv_len, d)
    check(q, k, v, scale=0.5, score=softcap, score_mod=SOFTCAP)
    check(q, k, v, scale=0.5, score=softcap, score_mod=SOFTCAP, lse_from="kernel")


def test_score_mod_gradients_alibi_with_a_captured_tensor_and_a_causal_block_mask():
    slopes = torch.rand(8, device="cuda")

    def alibi(s, b, h, m, n):
        return s + slopes[h] * (n - m)

    check_block_mask(rand(1, 8, 1000, 64), rand(1, 2, 1000, 64), rand(1, 2, 1000, 64), lambda b, h, m, n: m >= n,
                     CAUSAL, score=alibi, score_mod=ALIBI, score_tensors=(slopes,))


def test_score_mod_gradients_with_dq_reduce():
    from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardConfig

    q, k, v = rand(2, 8, 1000, 128), rand(2, 2, 1111, 128), rand(2, 2, 1111, 128)
    check(q, k, v, scale=0.5, score=softcap, score_mod=SOFTCAP, config=FlexBackwardConfig(**DQ_REDUCE))


def test_head_dims_64_32(monkeypatch):
    # PyTorch's flex tests mix 64-wide queries and keys with 32-wide values (the lowering takes
    # them in training graphs once this and the prefill's GPU tests pass)
    from inductor_cute.kernels.attention import flex_prefill_config as fpc

    monkeypatch.setattr(fpc, "GPU_UNCHECKED_HEAD_DIMS", set())  # the forward's lse: its check is here too
    check(rand(2, 8, 1000, 64), rand(2, 2, 1000, 64), rand(2, 2, 1000, 32))
    check_block_mask(rand(1, 4, 777, 64), rand(1, 4, 777, 64), rand(1, 4, 777, 32), lambda b, h, m, n: m >= n,
                     CAUSAL, lse_from="kernel")


def test_head_dims_192_128():
    # DeepSeek's MLA shapes (the torch.compile lowering takes them once this passes)
    check(rand(2, 8, 1000, 192), rand(2, 2, 1000, 192), rand(2, 2, 1000, 128))
    check_block_mask(rand(1, 16, 777, 192), rand(1, 16, 777, 192), rand(1, 16, 777, 128), lambda b, h, m, n: m >= n,
                     CAUSAL, lse_from="kernel")


KINKED = sp.dumps([["a", "abs", "score"], ["n", "mul", "a", -0.5], ["m", "maximum", "score", "n"],
                   ["c", "ge", "q", "kv"], ["o", "where", "c", "m", "score"]])


def test_score_mod_gradients_through_abs_maximum_and_where():
    # the kernel's own evaluation of the derivative program (make_score_fn outputs), on ops whose
    # derivative is not a constant; no block mask, a mask program on every block
    def kinked(s, b, h, m, n):
        return torch.where(m >= n, torch.maximum(s, -0.5 * s.abs()), s)

    q, k, v = rand(1, 4, 500, 128), rand(1, 4, 600, 128), rand(1, 4, 600, 128)
    keep = sp.reference_keep((1, 4, 500, 600), CAUSAL, device="cuda")
    check(q, k, v, keep=keep, mask_mod=CAUSAL, score=kinked, score_mod=KINKED)
