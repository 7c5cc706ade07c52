"""Score programs (kernels/common/programs/score.py) and the op registry they share with epilogue
programs: validation with one-line errors, typing, the canonical text, and the torch reference
evaluator against the score_mods they stand for."""

import pytest
import torch

from inductor_cute import UnsupportedError, ops
from inductor_cute.host import flex as host_flex
from inductor_cute.kernels.common.programs import epilogue as ep
from inductor_cute.kernels.common.programs import registry
from inductor_cute.kernels.common.programs import score as sp

SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = sp.dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
                  ["o", "add", "score", "bias"]])


def grid(batch=2, heads=4, q_len=3, kv_len=7):
    """score (B, H, Lq, Lkv) and the broadcastable int32 index tensors of every element."""
    g = torch.Generator().manual_seed(0)
    score = torch.randn(batch, heads, q_len, kv_len, generator=g) * 10
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate((batch, heads, q_len, kv_len))]
    return score, *idx


def test_reference_softcap_and_alibi():
    score, b, h, q, kv = grid()
    torch.testing.assert_close(sp.reference(SOFTCAP, score, b, h, q, kv), 30 * torch.tanh(score / 30))
    slopes = torch.exp2(-torch.arange(1, 5, dtype=torch.float32))
    torch.testing.assert_close(sp.reference(ALIBI, score, b, h, q, kv, (slopes,)), score + slopes[h] * (kv - q))


def test_reference_integer_ops_follow_torch():
    score, b, h, q, kv = grid()
    prog = sp.dumps([["d", "sub", "q", "kv"], ["r", "remainder", "d", 3], ["f", "floordiv", "d", 2],
                     ["c", "eq", "r", 0], ["both", "and", "c", "c"], ["n", "not", "both"],
                     ["w", "where", "n", "f", 7], ["o", "add", "score", "w"]])
    d = q - kv
    want = score + torch.where(~(d % 3 == 0), torch.div(d, 2, rounding_mode="floor"), 7)
    torch.testing.assert_close(sp.reference(prog, score, b, h, q, kv), want)
    trunc = sp.dumps([["x", "mul", "score", -0.5], ["i", "int", "x"], ["o", "float", "i"]])
    torch.testing.assert_close(sp.reference(trunc, score, b, h, q, kv), (score * -0.5).to(torch.int32).float())


def test_types_follow_torch_promotion():
    types = sp.types_of([["a", "add", "kv", 1], ["c", "mul", "a", 0.5], ["l", "load", "t0", "a"],
                         ["m", "load", "t1", "h"], ["e", "lt", "a", "c"], ["w", "where", "e", "a", 2]],
                        ("int32", "bfloat16"))
    assert [types[n] for n in "aclmew"] == ["i", "f", "i", "f", "b", "i"]


@pytest.mark.parametrize("text, dtypes, message", [
    ("not json", (), "not JSON"),
    ("[]", (), "non-empty list"),
    ('[["a", "pow", "score", 2]]', (), "'pow' with 2 arguments"),
    ('[["a", "tanh", "score", 2]]', (), "'tanh' with 2 arguments"),
    ('[["a", "add", "score", "nope"]]', (), "unknown argument 'nope'"),
    ('[["a", "add", "score", true]]', (), "unknown argument True"),
    ('[["a", "floordiv", "score", 2]]', (), "floordiv needs ints, got f/i"),
    ('[["a", "lt", "score", 0]]', (), "must end in a float"),
    ('[["a", "load", "t0", "h"], ["o", "add", "score", "a"]]', (), "unknown tensor 't0'"),
    ('[["a", "load", "t0", "score"]]', ("float32",), "index must be an int"),
    ('[["a", "neg", "score"], ["a", "neg", "a"]]', (), "'a' is used twice"),
    ('[["h", "neg", "score"]]', (), "'h' is used twice"),
    ('[["a", "load", "t0", "h"]]', ("float64",), "dtype float64 is not supported"),
    ('[["a", "neg", "score"]]', ("float32",) * 5, "at most 4"),
])
def test_invalid_programs_are_named_in_one_line(text, dtypes, message):
    with pytest.raises(ValueError, match=message) as err:
        sp.loads(text, dtypes)
    assert "\n" not in str(err.value)


def test_one_registry_types_both_kinds_of_program():
    """Both kinds validate and type through the registry; an epilogue counts a bool as a number
    (Inductor's `(y > 0).float() * y` keeps the bool, the kernel converts it to 0/1 as torch does),
    a score program does not; every op either kind uses has a torch reference."""
    assert len(ep.loads(ep.dumps([["c", "gt", "acc", 0], ["o", "mul", "c", "full"]]))) == 2
    with pytest.raises(ValueError, match="^score step o: mul needs numbers, got b/f$"):
        sp.loads(sp.dumps([["c", "gt", "score", 0], ["o", "mul", "c", "score"]]))
    with pytest.raises(ValueError, match="^epilogue step o: where needs a bool and two numbers, got f/f/f$"):
        ep.loads(ep.dumps([["o", "where", "acc", "row", "full"]]))
    with pytest.raises(ValueError, match="'floordiv' with 2 arguments is not supported"):
        ep.loads(ep.dumps([["o", "floordiv", "acc", 2]]))  # a score-only op
    assert set(ep.ARITY) & set(sp.ARITY) == {"neg", "abs", "exp", "exp2", "log", "tanh", "sigmoid", "add", "sub", "mul",
                                             "truediv", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne",
                                             "where"}
    assert set(registry.reference_ops()) == set(ep.ARITY) | set(sp.ARITY)


def test_epilogue_reference_follows_torch():
    acc, row, full = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    acc[0, 0] = float("nan")
    program = ep.dumps([["a", "add", "acc", "row"], ["m", "maximum", "a", 0.0], ["g", "gt", "full", 0],
                        ["w", "where", "g", "m", "full"], ["s", "mul", "g", "w"], ["o", "rsqrt", "s"]])
    a = acc + row
    want = torch.rsqrt((full > 0) * torch.where(full > 0, torch.maximum(a, torch.tensor(0.0)), full))
    torch.testing.assert_close(ep.reference(program, acc, row, full), want, equal_nan=True)


def test_canonical_text_is_whitespace_free_and_stable():
    spaced = '[["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]]'
    assert sp.canonical(spaced) == SOFTCAP == sp.canonical(SOFTCAP)


def test_flex_decode_refuses_bad_score_programs_in_one_line():
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedError, match="^flex_decode: score_mod: score step a: unknown argument 'x'$"):
        host_flex._score_mod_operands('[["a", "add", "score", "x"]]', (), cpu)
    with pytest.raises(UnsupportedError, match="must be a 1-D tensor"):
        host_flex._score_mod_operands(ALIBI, (torch.ones(2, 2),), cpu)
    with pytest.raises(UnsupportedError, match="without a score_mod"):
        host_flex._score_mod_operands(None, (torch.ones(2),), cpu)
    text, dtypes, slots = host_flex._score_mod_operands(ALIBI.replace(",", ", "), (torch.ones(8)[::2],), cpu)
    assert text == ALIBI and dtypes == ("float32",) and slots[0].is_contiguous() and slots[1:] == [None] * 3


SLIDING = sp.dumps([["d", "sub", "q", "kv"], ["ge", "ge", "d", 0], ["lt", "lt", "d", 4], ["o", "and", "ge", "lt"]])


def test_mask_programs_have_no_score_and_end_in_a_bool():
    score, b, h, q, kv = grid()
    torch.testing.assert_close(sp.reference_mask(SLIDING, b, h, q, kv), ((q >= kv) & (q - kv < 4)).expand(score.shape))
    with pytest.raises(ValueError, match="unknown argument 'score'"):
        sp.loads('[["o", "gt", "score", 0]]', mask=True)
    with pytest.raises(ValueError, match="must end in a bool"):
        sp.loads('[["o", "add", "kv", 1]]', mask=True)
    with pytest.raises(UnsupportedError, match="^flex_decode: mask_mod: mask program must end in a bool$"):
        host_flex._score_mod_operands('[["o", "add", "kv", 1]]', (), torch.device("cpu"), "mask")


def test_reference_keep_follows_flex_attention_block_masks():
    """Partial blocks through the mask program, full blocks whole, unlisted blocks never; batch and
    head rows broadcast by modulo; against create_block_mask's dense mask of the same mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.arange(700, dtype=torch.int32) // 250

    def doc_causal(b, h, m, n):
        return (doc[n] == doc[m + 600]) & (m + 600 >= n)

    program = sp.dumps([["qpos", "add", "q", 600], ["a", "load", "t0", "kv"], ["c", "load", "t0", "qpos"],
                        ["same", "eq", "a", "c"], ["causal", "ge", "qpos", "kv"], ["o", "and", "same", "causal"]])
    for block in (128, 256):
        bm = create_block_mask(doc_causal, None, None, 4, 700, device="cpu", BLOCK_SIZE=block)
        keep = sp.reference_keep((2, 3, 4, 700), program, (doc,), (bm.kv_num_blocks, bm.kv_indices,
                                 bm.full_kv_num_blocks, bm.full_kv_indices), block, block)
        idx = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate((2, 3, 4, 700))]
        assert torch.equal(keep, doc_causal(*idx).expand(2, 3, 4, 700))
        # the blocks alone decide when the mask program is dropped: full blocks and whole partial blocks
        blocks_only = sp.reference_keep((2, 3, 4, 700), "", (), (bm.kv_num_blocks, bm.kv_indices, None, None),
                                        block, block)
        assert not blocks_only[..., :250].any() and blocks_only[..., 600].all()


def test_block_mask_operands_are_checked_in_one_line():
    cpu = torch.device("cpu")
    num, idx = torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 4, dtype=torch.int32)

    def operands(block_mask, kv_block_size=128, q_block_size=128, heads=8, group=4, q_len=1, kv_block=128):
        return host_flex._block_mask_operands(block_mask, kv_block_size, q_block_size, heads, group, q_len, kv_block, cpu)

    slots = operands((num, idx.long(), None, None))
    assert [t.dtype for t in slots] == [torch.int32] * 4 and slots[2].sum() == 0  # no full blocks: zero counts
    with pytest.raises(UnsupportedError, match="^flex_decode: block mask KV block size 64 is not a multiple"):
        operands((num, idx, None, None), kv_block_size=64)
    with pytest.raises(UnsupportedError, match="together or not at all"):
        operands((num, idx, num, None))
    with pytest.raises(UnsupportedError, match="kv_indices must be a non-empty 4-D int32 tensor"):
        operands((num, idx[0], None, None))
    per_head = operands((num.expand(1, 8, 1), idx.expand(1, 8, 1, 4), None, None))  # GQA 4: run unpacked
    assert per_head[0].shape == (1, 8, 1) and per_head[0].is_contiguous()
    with pytest.raises(UnsupportedError, match="the block mask has 2 heads; expected 1 or 8"):
        operands((num.expand(1, 2, 1), idx.expand(1, 2, 1, 4), None, None))
    with pytest.raises(UnsupportedError, match="query length 32 spans more than one"):
        operands((num, idx, None, None), q_block_size=16, q_len=32)


def test_exp2_is_a_score_op_and_one_element_tensors_get_unit_stride():
    score, b, h, q, kv = grid()
    program = sp.dumps([["n", "neg", "h"], ["s", "exp2", "n"], ["o", "mul", "score", "s"]])
    torch.testing.assert_close(sp.reference(program, score, b, h, q, kv), score * torch.exp2(-h.float()))
    # Inductor hands a flattened 0-d buffer over with stride 0; the kernel declares compact tensors
    offset = torch.arange(4, dtype=torch.int32)[2:3].as_strided((1,), (0,))
    load = sp.dumps([["a", "load", "t0", 0], ["o", "add", "score", "a"]])
    _, _, slots = host_flex._score_mod_operands(load, (offset,), torch.device("cpu"))
    assert slots[0].stride() == (1,) and slots[0].item() == 2
