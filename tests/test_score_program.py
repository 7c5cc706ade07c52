"""Score programs (kernels/score_program.py): validation with one-line errors, typing, the canonical
text, and the torch reference evaluator against the score_mods they stand for."""

import pytest
import torch

from inductor_cute import UnsupportedError, ops
from inductor_cute.kernels import score_program as sp

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


def test_canonical_text_is_whitespace_free_and_stable():
    spaced = '[["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]]'
    assert sp.canonical(spaced) == SOFTCAP == sp.canonical(SOFTCAP)


def test_flex_decode_refuses_bad_score_programs_in_one_line():
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedError, match="^flex_decode: score_mod: score step a: unknown argument 'x'$"):
        ops._score_mod_operands('[["a", "add", "score", "x"]]', (), cpu)
    with pytest.raises(UnsupportedError, match="must be a 1-D tensor"):
        ops._score_mod_operands(ALIBI, (torch.ones(2, 2),), cpu)
    with pytest.raises(UnsupportedError, match="without a score_mod"):
        ops._score_mod_operands(None, (torch.ones(2),), cpu)
    text, dtypes, slots = ops._score_mod_operands(ALIBI.replace(",", ", "), (torch.ones(8)[::2],), cpu)
    assert text == ALIBI and dtypes == ("float32",) and slots[0].is_contiguous() and slots[1:] == [None] * 3
