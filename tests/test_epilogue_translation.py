"""Epilogue programs and their translation from real Inductor IR, on the CPU.

A graph is lowered by Inductor (its own lowering of mm/addmm and the pointwise ops after it), the
pointwise buffers are translated against the GEMM buffer, and the program is evaluated with
torch ops on operand views rebuilt from the translation's strides and offsets, the way the
generated call hands them to the kernel, against the function itself."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_cute.inductor.epilogue import translate
from inductor_cute.kernels.epilogue_program import dumps, evaluate, loads, reference_ops
from inductor_cute.kernels.gemm_config import GemmConfig, GemmProblem, gemm_spec, problem_error
from inductor_cute.runtime.compiler import compile_spec


class _Gemm:
    """What translate() reads of our template node, taken from Inductor's own extern GEMM buffer."""

    def __init__(self, buf):
        self.buf = buf
        self.op = buf.python_kernel_name.split(".")[-1].removesuffix("_out") if buf.python_kernel_name else "mm"
        self.op = "addmm" if "addmm" in self.op else ("bmm" if "bmm" in self.op else "mm")
        self.alpha = float(buf.kwargs.get("alpha", 1.0))
        self.beta = float(buf.kwargs.get("beta", 1.0))
        self.inputs = buf.inputs

    def __getattr__(self, name):
        return getattr(self.buf, name)


class _Node:
    def __init__(self, buf):
        self.node = buf

    def get_name(self):
        return self.node.get_name()


def lowered(fn, *args):
    """(Epilogue, GEMM output shape, graph-input name -> tensor) for fn(*args)."""
    gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    graph = GraphLowering(gm)
    with V.set_graph_handler(graph):
        graph.run(*args)
        gemm = next(b for b in graph.buffers if isinstance(b, ir.ExternKernel))
        pointwise = [_Node(b) for b in graph.buffers if isinstance(b, ir.ComputedBuffer)]
        epi = translate(_Gemm(gemm), pointwise)
        shape = tuple(int(s) for s in gemm.get_size())
        inputs = dict(zip(graph.graph_input_names, args))
    return epi, shape, inputs


def run_program(fn, *args, acc):
    epi, shape, inputs = lowered(fn, *args)

    def view(operand):
        if operand is None:
            return None
        return inputs[operand.name].reshape(-1).as_strided(shape, operand.strides, operand.offset)

    env = {"acc": acc.reshape(shape), "row": view(epi.row), "full": view(epi.full)}
    return evaluate(loads(epi.program), env, reference_ops()), epi


A, B = torch.randn(8, 16), torch.randn(16, 32)
A3 = torch.randn(2, 4, 16)
ROW, FULL = torch.randn(32), torch.randn(8, 32)
FUSABLE = {
    "bias+gelu_erf": (lambda a, b, r: F.gelu(a @ b + r), ROW),
    "bias+gelu_tanh": (lambda a, b, r: F.gelu(a @ b + r, approximate="tanh"), ROW),
    "silu*2+residual": (lambda a, b, f: F.silu(a @ b) * 2 + f, FULL),
    "relu": (lambda a, b, _: torch.relu(a @ b), ROW),
    "clamp": (lambda a, b, _: torch.clamp(a @ b, -1, 1), ROW),
    "sigmoid*tanh-bias": (lambda a, b, r: (lambda y: torch.sigmoid(y) * torch.tanh(y) - r)(a @ b), ROW),
    "where": (lambda a, b, f: (lambda y: torch.where(y > 0, y, f))(a @ b), FULL),
    "maximum": (lambda a, b, f: torch.maximum(a @ b, f), FULL),
    "offset row": (lambda a, b, r: a @ b + r[3:], torch.randn(35)),
    "addmm": (lambda a, b, r: torch.addmm(r, a, b, alpha=2.0, beta=0.5) * 3, FULL),
    "addmm row+silu": (lambda a, b, r: F.silu(torch.addmm(r, a, b)), ROW),
}


@pytest.mark.parametrize("name", sorted(FUSABLE))
def test_translated_program_computes_the_same_function(name):
    fn, extra = FUSABLE[name]
    got, _ = run_program(fn, A, B, extra, acc=A @ B)
    torch.testing.assert_close(got, fn(A, B, extra), atol=1e-5, rtol=1e-5)


def test_linear_on_3d_activations_fuses_across_the_row_split():
    fn = lambda x, b, r: F.gelu(x @ b + r)  # noqa: E731  (B, S, K) @ (K, N): an mm on (B*S, K)
    got, epi = run_program(fn, A3, B, ROW, acc=A3.reshape(8, 16) @ B)
    torch.testing.assert_close(got.reshape(2, 4, 32), fn(A3, B, ROW), atol=1e-5, rtol=1e-5)
    residual = torch.randn(2, 4, 32)
    got, epi = run_program(lambda x, b, f: x @ b + f, A3, B, residual, acc=A3.reshape(8, 16) @ B)
    assert epi.full.strides == (32, 1)
    torch.testing.assert_close(got.reshape(2, 4, 32), A3 @ B + residual, atol=1e-5, rtol=1e-5)


def test_a_bare_cast_becomes_a_one_step_program():
    a, b = A.bfloat16(), B.bfloat16()
    got, epi = run_program(lambda a, b, _: (a @ b).float(), a, b, ROW, acc=a.float() @ b.float())
    assert len(loads(epi.program)) == 1 and epi.out.get_dtype() == torch.float32
    torch.testing.assert_close(got, (a @ b).float(), atol=3e-2, rtol=1e-2)


def test_addmm_input_roles_follow_torch():
    from inductor_cute.inductor.runtime import input_role

    assert input_role((32,), (1,), 32, 1.0) == "row"
    assert input_role((8, 32), (0, 1), 32, 1.0) == "row"
    assert input_role((32,), (1,), 32, 0.5) == "full"  # scaled: C with beta
    assert input_role((8, 32), (32, 1), 32, 1.0) == "full"
    assert input_role((8, 32), (32, 1), 32, 0.0) is None  # torch ignores the input (and its NaNs)
    assert input_role((), (), 32, 1.0) == "full"  # a 0-d input broadcasts through C


def test_relu_and_maximum_propagate_nan():
    acc = A @ B
    acc[0, 0] = float("nan")
    got, _ = run_program(lambda a, b, _: torch.relu(a @ b), A, B, ROW, acc=acc)
    assert got[0, 0].isnan() and not got[1:].isnan().any()


@pytest.mark.parametrize("fn,extra,reason", [
    (lambda a, b, _: (a @ b).t().contiguous(), FULL, "not stored row-major|other elements|another indexing"),
    (lambda a, b, c: a @ b + c, torch.randn(8, 1), "not a row or a full tensor"),
    (lambda a, b, c: a @ b + c + c.flip(0), FULL, "non-negative"),
    (lambda a, b, c: a @ b + c.repeat_interleave(2, 0), torch.randn(4, 32), "not affine"),
    (lambda a, b, c: a @ b + c.repeat(2, 1), torch.randn(4, 32), "not affine"),
    (lambda a, b, _: (a @ b).to(torch.int32), FULL, "cast to torch.int32"),
    (lambda a, b, _: (a @ b * 1e5).half().float(), FULL, "rounded to 16 bits"),
    (lambda a, b, c: torch.addmm(c, a, b), torch.randn(8, 1), "broadcasts in a way"),
])
def test_untranslatable_epilogues_are_refused_with_a_reason(fn, extra, reason):
    with pytest.raises(NotImplementedError, match=reason):
        lowered(fn, A, B, extra)


def test_program_validation_names_the_problem():
    with pytest.raises(ValueError, match="not supported"):
        loads(dumps([["v0", "cosh", "acc"]]))
    with pytest.raises(ValueError, match="unknown argument"):
        loads(dumps([["v0", "add", "acc", "v9"]]))
    with pytest.raises(ValueError, match="used twice"):
        loads(dumps([["v0", "relu", "acc"], ["v0", "relu", "acc"]]))
    with pytest.raises(ValueError, match="non-empty"):
        loads("[]")
    program = dumps([["v0", "add", "acc", "row"]])
    ok = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, epilogue=program)
    assert problem_error(ok) is None
    assert "must match" in problem_error(GemmProblem("bfloat16", "bfloat16", "k", "k", epilogue=program))
    assert "cannot be combined" in problem_error(GemmProblem("bfloat16", "bfloat16", "k", "k", True, False, "relu",
                                                            program))


def test_a_translated_program_compiles_into_the_gemm():
    epi, _, _ = lowered(FUSABLE["bias+gelu_tanh"][0], A, B, ROW)
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, epilogue=epi.program)
    compiled = compile_spec(gemm_spec(problem, GemmConfig(128, 128, 64, 1, 1, 4, 2, True)), "sm_90a", keep_ptx=True)
    assert "tanh.approx" in compiled.ptx and "wgmma.mma_async" in compiled.ptx
    assert "0 bytes spill stores" in compiled.ptxas_report
