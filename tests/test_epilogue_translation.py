"""Epilogue programs and their translation from real Inductor IR, on the CPU: a graph is lowered
by Inductor (torch's own lowering of mm and the pointwise ops after it), the pointwise buffers are
translated, and the program is evaluated with torch ops against the function itself."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_cute.inductor.epilogue import translate
from inductor_cute.kernels.epilogue_program import dumps, evaluate, loads, operands, reference_ops
from inductor_cute.kernels.gemm_config import GemmConfig, GemmProblem, gemm_spec, problem_error
from inductor_cute.runtime.compiler import compile_spec


class _Gemm:
    """What translate() needs of our template node, standing in for Inductor's extern mm buffer."""

    op, alpha, beta, inputs = "mm", 1.0, 1.0, []

    def __init__(self, buf):
        self.buf = buf

    def get_name(self):
        return self.buf.get_name()

    def get_size(self):
        return self.buf.get_size()


class _Node:
    def __init__(self, buf):
        self.node = buf

    def get_name(self):
        return self.node.get_name()


def lowered_epilogue(fn, *args):
    gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    graph = GraphLowering(gm)
    with V.set_graph_handler(graph):
        graph.run(*args)
        gemm = next(b for b in graph.buffers if not isinstance(b, ir.ComputedBuffer))
        pointwise = [_Node(b) for b in graph.buffers if isinstance(b, ir.ComputedBuffer)]
        return translate(_Gemm(gemm), pointwise)


A, B = torch.randn(8, 16), torch.randn(16, 32)
ROW, FULL = torch.randn(32), torch.randn(8, 32)
FUSABLE = {
    "bias+gelu_erf": (lambda a, b, r: F.gelu(a @ b + r), ROW),
    "bias+gelu_tanh": (lambda a, b, r: F.gelu(a @ b + r, approximate="tanh"), ROW),
    "silu*2+residual": (lambda a, b, f: F.silu(a @ b) * 2 + f, FULL),
    "relu": (lambda a, b, _: torch.relu(a @ b), None),
    "clamp": (lambda a, b, _: torch.clamp(a @ b, -1, 1), None),
    "sigmoid*tanh-bias": (lambda a, b, r: (lambda y: torch.sigmoid(y) * torch.tanh(y) - r)(a @ b), ROW),
    "where": (lambda a, b, f: (lambda y: torch.where(y > 0, y, f))(a @ b), FULL),
    "max-with-nan": (lambda a, b, f: torch.maximum(a @ b, f), FULL),
}


@pytest.mark.parametrize("name", sorted(FUSABLE))
def test_translated_program_computes_the_same_function(name):
    fn, extra = FUSABLE[name]
    epi = lowered_epilogue(fn, A, B, extra if extra is not None else ROW)
    env = {"acc": A @ B, "row": ROW if epi.row else None, "full": FULL if epi.full else None}
    got = evaluate(loads(epi.program), env, reference_ops())
    torch.testing.assert_close(got, fn(A, B, extra), atol=1e-5, rtol=1e-5)
    assert (epi.row is not None) == (extra is ROW and "row" in operands(loads(epi.program)))


@pytest.mark.parametrize("fn,extra,reason", [
    (lambda a, b, _: (a @ b).t().contiguous(), FULL, "another shape"),
    (lambda a, b, c: a @ b + c, torch.randn(8, 1), "not contiguous along N"),
    (lambda a, b, c: a @ b + c + c.flip(0), FULL, "more than one full operand"),
    (lambda a, b, _: (a @ b).to(torch.int32), FULL, "cast to torch.int32"),
])
def test_untranslatable_epilogues_are_refused_with_a_reason(fn, extra, reason):
    with pytest.raises(NotImplementedError, match=reason):
        lowered_epilogue(fn, A, B, extra)


def test_program_validation_names_the_problem():
    with pytest.raises(ValueError, match="not supported"):
        loads(dumps([["v0", "cosh", "acc"]]))
    with pytest.raises(ValueError, match="unknown argument"):
        loads(dumps([["v0", "add", "acc", "v9"]]))
    with pytest.raises(ValueError, match="used twice"):
        loads(dumps([["v0", "relu", "acc"], ["v0", "relu", "acc"]]))
    program = dumps([["v0", "add", "acc", "row"]])
    ok = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, epilogue=program)
    assert problem_error(ok) is None
    assert "must match" in problem_error(GemmProblem("bfloat16", "bfloat16", "k", "k", epilogue=program))
    assert "cannot be combined" in problem_error(GemmProblem("bfloat16", "bfloat16", "k", "k", True, False, "relu",
                                                            program))


def test_a_translated_program_compiles_into_the_gemm():
    epi = lowered_epilogue(FUSABLE["bias+gelu_tanh"][0], A, B, ROW)
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, epilogue=epi.program)
    compiled = compile_spec(gemm_spec(problem, GemmConfig(128, 128, 64, 1, 1, 4, 2, True)), "sm_90a", keep_ptx=True)
    assert "tanh.approx" in compiled.ptx and "wgmma.mma_async" in compiled.ptx
    assert "0 bytes spill stores" in compiled.ptxas_report
