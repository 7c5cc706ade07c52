"""Epilogue programs and their translation from real Inductor IR, on the CPU.

A graph is lowered by Inductor (its own lowering of mm/addmm and the pointwise ops after it), the
pointwise buffers are translated against the GEMM buffer, and the program is evaluated with
torch ops on operand views rebuilt from the translation's strides and offsets, the way the
generated call hands them to the kernel, against the function itself."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from inductor_cute.inductor.gemm.epilogue import translate
from inductor_cute.kernels.common.programs.epilogue import dumps, loads, reference
from inductor_cute.kernels.gemm.config import GemmConfig, GemmProblem, spec, unsupported_reason
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


def lowered(fn, *args, dynamic=None):
    """(Epilogue, GEMM output shape, graph-input name -> tensor) for fn(*args). `dynamic`:
    {argument index: dims} traced as symbolic sizes (the shape is then the hint's)."""
    shape_env, traced = None, args
    if dynamic:
        shape_env = ShapeEnv()
        mode = FakeTensorMode(shape_env=shape_env)
        traced = [mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=[
            DimDynamic.DYNAMIC if d in dynamic.get(i, ()) else DimDynamic.STATIC for d in range(t.dim())]))
            for i, t in enumerate(args)]
        with mode:
            gm = make_fx(fn, decomposition_table=select_decomp_table())(*traced)
    else:
        gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    graph = GraphLowering(gm, shape_env=shape_env)
    with V.set_graph_handler(graph):
        graph.run(*traced)
        gemm = next(b for b in graph.buffers if isinstance(b, ir.ExternKernel))
        pointwise = [_Node(b) for b in graph.buffers if isinstance(b, ir.ComputedBuffer)]
        epi = translate(_Gemm(gemm), pointwise)
        shape = tuple(graph.sizevars.optimization_hints(gemm.get_size()))
        inputs = dict(zip(graph.graph_input_names, args))
    return epi, shape, inputs


def run_program(fn, *args, acc, dynamic=None):
    epi, shape, inputs = lowered(fn, *args, dynamic=dynamic)

    def view(operand):
        if operand is None:
            return None
        return inputs[operand.name].reshape(-1).as_strided(shape, operand.strides, operand.offset)

    return reference(epi.program, acc.reshape(shape), view(epi.row), view(epi.full)), epi


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
    "bool*value": (lambda a, b, _: (lambda y: (y > 0).float() * y)(a @ b), ROW),  # the bool itself, as 0/1
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


BF16 = {
    "silu*2+residual": lambda a, b, f: F.silu(a @ b) * 2 + f,
    "gelu_tanh+residual": lambda a, b, f: F.gelu(a @ b, approximate="tanh") + f,
    "relu+residual": lambda a, b, f: torch.relu(a @ b) + f,
    "silu*gelu": lambda a, b, _: (lambda y: F.silu(y) * F.gelu(y))(a @ b),
}


@pytest.mark.parametrize("name", sorted(BF16))
def test_bf16_epilogues_round_once_at_the_store(name):
    # A bf16 op inside a pointwise body ends in a cast to bf16 that Inductor's Triton code keeps in
    # fp32 (`x.to(tl.float32)`), so silu(y) * 2 + r rounds only when it is stored; the translator
    # once read that cast as a rounding and refused the fusion on the GPU.
    fn = BF16[name]
    a, b, f = A.bfloat16(), B.bfloat16(), FULL.bfloat16()
    got, epi = run_program(fn, a, b, f, acc=a.float() @ b.float())
    assert epi.out.get_dtype() == torch.bfloat16
    torch.testing.assert_close(got, fn(a.float(), b.float(), f.float()), atol=1e-5, rtol=1e-5)


def test_bf16_linear_on_3d_activations_with_dynamic_tokens():
    # the GPU test's graph: F.gelu(Linear(x), "tanh") + r, x and r (2, S, D) with S dynamic
    fn = lambda x, w, bias, r: F.gelu(F.linear(x, w, bias), approximate="tanh") + r  # noqa: E731
    x, w, bias, r = A3.bfloat16(), B.t().contiguous().bfloat16(), ROW.bfloat16(), torch.randn(2, 4, 32).bfloat16()
    got, epi = run_program(fn, x, w, bias, r, dynamic={0: (1,), 3: (1,)},
                           acc=x.float().reshape(8, 16) @ w.float().t())
    assert epi.row is not None and epi.full is not None and epi.full.strides == (32, 1)
    want = fn(x.float(), w.float(), bias.float(), r.float())
    torch.testing.assert_close(got.reshape(2, 4, 32), want, atol=1e-5, rtol=1e-5)


def test_real_roundings_to_16_bits_are_refused():
    # Without emulate_precision_casts Inductor's Triton code rounds no intermediate value (not even
    # an explicit .half().float()); with it the casts are real and the kernel cannot round mid-program.
    fn = lambda a, b, _: (a @ b * 1e5).half().float()  # noqa: E731
    got, _ = run_program(fn, A, B, FULL, acc=A @ B)
    torch.testing.assert_close(got, A @ B * 1e5)
    with inductor_config.patch(emulate_precision_casts=True):
        with pytest.raises(NotImplementedError, match="rounded to 16 bits"):
            lowered(fn, A, B, FULL)
        with pytest.raises(NotImplementedError, match="rounded to 16 bits"):
            lowered(BF16["silu*2+residual"], A.bfloat16(), B.bfloat16(), FULL.bfloat16())


def test_addmm_input_roles_follow_torch():
    from inductor_cute.inductor.gemm.runtime import input_role

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
    assert unsupported_reason(ok) is None
    assert "must match" in unsupported_reason(GemmProblem("bfloat16", "bfloat16", "k", "k", epilogue=program))
    assert "cannot be combined" in unsupported_reason(GemmProblem("bfloat16", "bfloat16", "k", "k", True, False,
                                                                  "relu", program))


def test_a_translated_program_compiles_into_the_gemm():
    epi, _, _ = lowered(FUSABLE["bias+gelu_tanh"][0], A, B, ROW)
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, epilogue=epi.program)
    compiled = compile_spec(spec(problem, GemmConfig(128, 128, 64, 1, 1, 4, 2, True)), "sm_90a", keep_ptx=True)
    assert "tanh.approx" in compiled.ptx and "wgmma.mma_async" in compiled.ptx
    assert "0 bytes spill stores" in compiled.ptxas_report


# ---- Inductor's scheduler on the CPU: fake CUDA tensors, our template node in place of the chosen
# addmm (what CuteGemmCaller.output_node returns when fusion is on), CuteChoices as V.choices and
# our CUDA scheduling; no GPU, no Triton, no kernel is compiled (the scheduler fuses before codegen).

_CONFIG = (128, 128, 64, 1, 1, 6, 2, True, False)  # what the H200 picked for these shapes


def _our_addmm(inp, mat1, mat2, *, beta=1, alpha=1, node="template", config=_CONFIG):
    """Our chosen addmm: the template node (fusion on) or the plain extern node (fusion off)."""
    from torch._inductor import lowering

    from inductor_cute.inductor.gemm.extern import RUNTIME, CuteGemmOut
    from inductor_cute.inductor.gemm.template import CuteGemmTemplateBuffer

    (m, _), (_, n) = mat1.get_size(), mat2.get_size()
    inputs = [ir.ExternKernel.realize_input(t) for t in (lowering.expand(inp, [m, n]), mat1, mat2)]
    layout = ir.FixedLayout(mat1.get_device(), mat1.get_dtype(), [m, n], [n, 1])
    kwargs = {"op": "addmm", "config": config, "alpha": float(alpha), "beta": float(beta)}
    if node == "extern":
        return ir.TensorBox.create(CuteGemmOut(layout=layout, inputs=inputs, kwargs=kwargs,
                                               python_kernel_name=f"{RUNTIME}.gemm"))
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True)
    return ir.TensorBox.create(CuteGemmTemplateBuffer(layout, inputs, op="addmm", kwargs=kwargs, problem=problem,
                                                      num_sms=132))


def scheduled(fn, shapes, dynamic=(), codegen=False, node="template", config=_CONFIG):
    """The scheduler's nodes (lists of the operation names fused into each) for fn on bf16 CUDA
    tensors of `shapes`; sizes listed in `dynamic` become one symbolic size each; `node` is what
    our chosen addmm becomes (see _our_addmm). With `codegen`, also the output code (the fused
    kernel's compile is skipped)."""
    import functools
    from types import SimpleNamespace
    from unittest import mock

    from torch._dynamo.source import ConstantSource
    from torch._inductor import lowering
    from torch._inductor.debug import DebugContext

    from inductor_cute.inductor.gemm.choices import CuteChoices
    from inductor_cute.inductor.install import Settings, hook

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    syms = {n: shape_env.create_symintnode(shape_env.create_symbol(n, source=ConstantSource(f"s{n}")), hint=n)
            for n in dynamic}
    with mode:
        args = [torch.empty([syms.get(n, n) for n in shape], dtype=torch.bfloat16, device="cuda") for shape in shapes]
        gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    addmm = torch.ops.aten.addmm.default
    scheduling = hook("cuda_scheduling")
    saved, installed_before = lowering.lowerings[addmm], scheduling.installed()
    lowering.lowerings[addmm] = functools.partial(_our_addmm, node=node, config=config)
    scheduling.install()
    try:
        with inductor_config.patch(benchmark_epilogue_fusion=False, cuda_backend="triton"), \
                mock.patch("torch._inductor.scheduler.has_triton", lambda: True), \
                V.set_fake_mode(mode), V.set_choices_handler(CuteChoices(settings=Settings(fuse_epilogues=True))), \
                DebugContext():
            graph = GraphLowering(gm, shape_env=shape_env)
            with V.set_graph_handler(graph):
                graph.run(*args)
                if not codegen:
                    graph._update_scheduler()
                    return [[n.get_name() for n in node.get_nodes()] for node in graph.scheduler.nodes]
                compiled = lambda specs, *a, **k: [SimpleNamespace(status="compiled") for _ in specs]  # noqa: E731
                with mock.patch("inductor_cute.runtime.precompile", compiled):
                    code = graph.codegen()[0].value  # schedules again, then writes the wrapper
                return [[n.get_name() for n in node.get_nodes()] for node in graph.scheduler.nodes], code
    finally:
        lowering.lowerings[addmm] = saved
        if not installed_before:
            scheduling.uninstall()


def our_launchers(code: str) -> tuple[dict, list]:
    """The launchers output code defines in its header ({name: definition}) and its calls of them
    ([(name, argument text)])."""
    definitions = dict(re.findall(r"^(icute_gemm_\d+) = (.*)$", code, re.MULTILINE))
    calls = re.findall(r"^\s+(icute_gemm_\d+)\((.*)\)$", code, re.MULTILINE)
    assert "runtime.gemm(" not in code
    return definitions, calls


LINEAR = {  # the GPU tests' functions of (weight, bias, x, residual)
    "silu*2+residual": lambda w, b, x, r: F.silu(F.linear(x, w, b)) * 2 + r,
    "relu+residual": lambda w, b, x, r: torch.relu(F.linear(x, w, b)) + r,
    "gelu_tanh+residual": lambda w, b, x, r: F.gelu(F.linear(x, w, b), approximate="tanh") + r,
}


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_the_scheduler_fuses_bf16_epilogues_into_our_gemm(name):
    assert scheduled(LINEAR[name], [(2048, 1024), (2048,), (1000, 1024), (1000, 2048)]) == [["op0", "op1"]]


@pytest.mark.parametrize("dynamic", [(), (300,)], ids=["static", "dynamic"])
def test_the_scheduler_fuses_into_a_linear_on_3d_activations(dynamic):
    shapes = [(2048, 1024), (2048,), (2, 300, 1024), (2, 300, 2048)]
    assert scheduled(LINEAR["gelu_tanh+residual"], shapes, dynamic) == [["op0", "op1"]]


def test_the_fused_call_on_3d_activations_writes_its_output_as_the_gemm_shape():
    shapes = [(2048, 1024), (2048,), (2, 300, 1024), (2, 300, 2048)]
    nodes, code = scheduled(LINEAR["gelu_tanh+residual"], shapes, (300,), codegen=True)
    definitions, calls = our_launchers(code)
    assert nodes == [["op0", "op1"]] and len(definitions) == len(calls) == 1
    (name, definition), = definitions.items()
    assert definition.startswith("inductor_cute.inductor.gemm.runtime.GemmLauncher(op='mm', config=(128, 128, 64, ")
    assert "epilogue='[[" in definition and definition.endswith(").launch")
    assert calls[0][0] == name  # a, b, out, row, full: positional
    assert re.fullmatch(r"reinterpret_tensor\(x_1, .*\), reinterpret_tensor\(w_1, .*\), "
                        r"reinterpret_tensor\(buf1, \(2\*s\d+, 2048\), \(2048, 1\), 0\), "
                        r"reinterpret_tensor\(b_1, .*\), reinterpret_tensor\(r_1, .*\)", calls[0][1]), calls[0][1]


def test_a_fused_epilogue_drops_the_stages_its_c_tile_needs():
    """The H200 picked 128x192x64 with 5 stages for the GPU test's addmm: 200 KB of stages leave no
    room for the residual's C tile, so the fused launch runs the same tile with 4 stages."""
    from inductor_cute.kernels.gemm.config import GemmConfig, GemmProblem, unsupported_reason

    deep = GemmConfig(128, 192, 64, 1, 1, 5, 2, True, False)
    fused = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, has_c=True, epilogue="program")
    assert unsupported_reason(fused, deep) is not None  # what made the GPU test's fusion fail before
    shapes = [(2048, 1024), (2048,), (1000, 1024), (1000, 2048)]
    config = tuple(deep.as_params().values())
    nodes, code = scheduled(LINEAR["silu*2+residual"], shapes, codegen=True, config=config)
    (definition,) = our_launchers(code)[0].values()
    assert nodes == [["op0", "op1"]]
    fitted = tuple(dataclasses.replace(deep, stages=4).as_params().values())
    assert definition.startswith(f"inductor_cute.inductor.gemm.runtime.GemmLauncher(op='mm', config={fitted!r}, ")


@pytest.mark.parametrize("node", ["template", "extern"])
def test_an_unfused_gemm_calls_a_launcher_defined_in_the_header(node):
    shapes = [(2048, 1024), (2048,), (1000, 1024), (1000, 2048)]
    linear = lambda w, b, x, r: F.linear(x, w, b)  # noqa: E731
    _, code = scheduled(linear, shapes, codegen=True, node=node)
    definitions, calls = our_launchers(code)
    assert list(definitions.values()) == [
        f"inductor_cute.inductor.gemm.runtime.GemmLauncher(op='addmm', config={_CONFIG!r}, alpha=1.0, beta=1.0)"
        ".launch_static"]  # static shapes: no layout key per call
    (name, args), = calls  # inp (the bias row, broadcast), a, b, out
    assert name in definitions
    assert args == "reinterpret_tensor(b_1, (1000, 2048), (0, 1), 0), x_1, reinterpret_tensor(w_1, (1024, 2048), " \
                   "(1, 1024), 0), buf0"
    assert code.index(f"{name} = ") < code.index("def call(")  # built once, at import


def test_output_code_builds_its_launchers_in_a_fresh_process(tmp_path):
    # What a graph served from Inductor's FX cache does: import the code in a process that never lowered it.
    import os
    import subprocess
    import sys
    import textwrap

    _, code = scheduled(FUSABLE_LINEAR, [(256, 64), (256,), (32, 64), (32, 256)], codegen=True)
    (tmp_path / "output_code.py").write_text(code)
    script = textwrap.dedent("""
        import importlib.util, json, sys, torch
        from inductor_cute.host import gemm as host_gemm
        spec = importlib.util.spec_from_file_location("output_code", sys.argv[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        (name,) = [n for n in vars(module) if n.startswith("icute_gemm_")]
        launcher = getattr(module, name).__self__
        remembered = lambda: len(launcher._plans) + (launcher._static is not None)  # noqa: E731
        plans_at_import = remembered()
        launches = []
        host_gemm.check_cuda = lambda *tensors: None  # CPU tensors
        host_gemm.sm_count = lambda index: 132
        host_gemm.get_kernel = lambda spec: lambda *args: launches.append(args)
        t = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)  # noqa: E731
        x, w, out, row, full = t(32, 64), t(256, 64), t(32, 256), t(256), t(32, 256)
        for _ in range(2):
            getattr(module, name)(x, w.t(), out, row, full)
        print(json.dumps({"type": type(launcher).__name__, "plans_at_import": plans_at_import,
                          "plans": remembered(), "launches": len(launches)}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "output_code.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"type": "GemmLauncher", "plans_at_import": 0,
                                                                "plans": 1, "launches": 2}


FUSABLE_LINEAR = lambda w, b, x, r: F.silu(F.linear(x, w, b)) + r  # noqa: E731
