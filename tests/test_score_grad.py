"""score_grad.tangent: a score program's derivative with respect to the score, as a program,
against torch autograd of the same program on fresh random scores (fp64 reference values are not
needed: both sides run the same fp32 ops)."""

import pytest
import torch

from inductor_cute.kernels.common.programs import score as sp
from inductor_cute.kernels.common.programs import score_grad

PROGRAMS = {
    "softcap": [["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]],
    "alibi": [["d", "sub", "kv", "q"], ["df", "float", "d"], ["sl", "load", "t0", "h"], ["bi", "mul", "sl", "df"],
              ["o", "add", "score", "bi"]],
    "scaled by an int": [["o", "mul", "score", 2]],
    "causal by where": [["c", "ge", "q", "kv"], ["hf", "mul", "score", 0.5], ["o", "where", "c", "score", "hf"]],
    "constant where a mask drops": [["c", "ge", "q", "kv"], ["o", "where", "c", "score", -1e4]],
    "exp and exp2": [["e", "exp", "score"], ["f", "exp2", "score"], ["o", "add", "e", "f"]],
    "log of abs": [["a", "abs", "score"], ["a1", "add", "a", 1.0], ["o", "log", "a1"]],
    "log of the score squared": [["s", "mul", "score", "score"], ["s1", "add", "s", 0.5], ["o", "log", "s1"]],
    "sigmoid and neg": [["g", "sigmoid", "score"], ["n", "neg", "score"], ["o", "sub", "g", "n"]],
    "divided by itself": [["a", "abs", "score"], ["a1", "add", "a", 1.0], ["o", "truediv", "score", "a1"]],
    "a divisor that is not the score's": [["kf", "float", "kv"], ["k1", "add", "kf", 1.0],
                                          ["o", "truediv", "score", "k1"]],
    "maximum and minimum": [["m", "maximum", "score", 0.25], ["kf", "float", "kv"], ["k", "mul", "kf", 0.01],
                            ["n", "minimum", "m", "k"], ["o", "maximum", "n", "score"]],
    "independent of the score": [["o", "float", "kv"]],
    "the score itself": [["o", "mul", "score", 1.0]],
}


def leaves(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(n, generator=g, dtype=torch.float32) * 3
    score[:8] = torch.tensor([0.0, 0.25, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0])  # kinks and ties
    idx = [torch.randint(0, 64, (n,), generator=g, dtype=torch.int32) for _ in range(4)]
    slopes = torch.rand(64, generator=g)
    return score, idx, slopes


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_derivative_program_matches_autograd(name):
    text = sp.dumps(PROGRAMS[name])
    dtypes = ("float32",) if '"load"' in text else ()
    score, (b, h, q, kv), slopes = leaves()
    tensors = (slopes,) if dtypes else ()
    program, result, derivative = score_grad.tangent(text, dtypes)
    steps = sp.loads(program, dtypes)
    assert steps[-1][0] == derivative and [s[0] for s in steps[:len(PROGRAMS[name])]] == [s[0] for s in
                                                                                          PROGRAMS[name]]
    x = score.clone().requires_grad_()
    value = sp.reference(text, x, b, h, q, kv, tensors)
    if value.requires_grad:
        (expected,) = torch.autograd.grad(value.sum(), x)
    else:  # a score_mod that ignores the score
        expected = torch.zeros_like(score)
    got = sp.reference(program, score, b, h, q, kv, tensors)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # the result keeps its value and name inside the new program
    env = {"score": score, "b": b, "h": h, "q": q, "kv": kv, **{sp.tensor_name(i): t for i, t in enumerate(tensors)}}
    values = {}
    from inductor_cute.kernels.common.programs.registry import SCORE, evaluate, reference_ops

    evaluate(steps, env, reference_ops(SCORE), keep=values)
    torch.testing.assert_close(values[result], value.detach(), rtol=0, atol=0)


def test_an_op_without_a_derivative_on_the_score_path_is_refused(monkeypatch):
    original = score_grad._rules
    monkeypatch.setattr(score_grad, "_rules", lambda f: {k: v for k, v in original(f).items() if k != "tanh"})
    with pytest.raises(ValueError, match="'tanh' has no derivative"):
        score_grad.tangent(sp.dumps(PROGRAMS["softcap"]))
    # off the score's path it needs none
    assert score_grad.tangent(sp.dumps([["k", "float", "kv"], ["t", "tanh", "k"], ["o", "add", "score", "t"]]))


def test_step_names_of_the_program_are_not_reused():
    text = sp.dumps([["d0_", "tanh", "score"], ["d1_", "mul", "d0_", 2.0]])
    program, result, derivative = score_grad.tangent(text)
    names = [s[0] for s in sp.loads(program)]
    assert len(names) == len(set(names)) and result == "d1_" and derivative not in ("d0_", "d1_")


def test_every_float_op_of_score_programs_has_a_derivative():
    from inductor_cute.kernels.common.programs.registry import SCORE, ops_of

    no_float_result_on_the_score = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "floordiv", "remainder",
                                    "int", "load", "len"}
    rules = score_grad._rules(score_grad._Builder([], set()))
    assert set(ops_of(SCORE)) - no_float_result_on_the_score <= set(rules)
