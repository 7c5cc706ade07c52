"""torch._grouped_mm under torch.compile on the CPU: which calls our grouped GEMM serves, that our
choices join the stock lowering's autotuning (the stock lowering on real Inductor IR, fake CUDA
tensors, autotune_select_algorithm recorded), that benchmarking never hands our kernel invalid
offsets, and that output code defines a launcher for the chosen call site whose call runs
ops.grouped_mm on the right views (a recorded kernel computing on CPU tensors).
GPU runs: tests/gpu/test_grouped_gemm_compile_gpu.py."""

import contextlib
import dataclasses
import re
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.debug import DebugContext
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering
from torch._inductor.kernel import mm_grouped
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import inductor_cute
from inductor_cute.host import grouped_gemm as host_grouped
from inductor_cute.inductor.gemm.extern import CuteGemmCaller
from inductor_cute.inductor.grouped import gate, runtime
from inductor_cute.inductor.grouped.extern import CuteGroupedCaller
from inductor_cute.inductor.grouped.lowering import GroupedCall, b_major, decline_reason, wgrad_majors
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates
from inductor_cute.kernels.gemm.grouped_wgrad_config import WgradProblem
from inductor_cute.kernels.gemm.grouped_wgrad_config import candidates as wgrad_candidates

BF16 = torch.bfloat16


# ---- the decision, on plain values

# a (256, 128) x b (4, 128, 64) as the transposed view of a (4, 64, 128) weight
K_MAJOR = GroupedCall(a_size=(256, 128), a_stride=(128, 1), b_size=(4, 128, 64), b_stride=(8192, 1, 128),
                      offs_size=(4,), out_size=(256, 64), out_stride=(64, 1))


def call(**changes) -> GroupedCall:
    return dataclasses.replace(K_MAJOR, **changes)


def test_the_moe_forward_in_either_weight_layout_is_served():
    assert decline_reason(K_MAJOR) is None and b_major(K_MAJOR) == "k"
    n_major = call(b_stride=(8192, 64, 1))
    assert decline_reason(n_major) is None and b_major(n_major) == "n"
    one_group = call(b_size=(1, 128, 64), b_stride=(0, 1, 128), offs_size=(1,))  # a size-1 mode's stride is free
    assert decline_reason(one_group) is None
    dynamic_tokens = call(a_size=(None, 128), out_size=(None, 64))
    assert decline_reason(dynamic_tokens) is None


@pytest.mark.parametrize("changes,reason", [
    ({"output_code": "cpp_wrapper"}, "cpp_wrapper output code"),
    ({"device_type": "cpu"}, "not CUDA"),
    ({"a_size": (4, 64, 128), "a_stride": (8192, 128, 1)}, "2-D a x 3-D b"),
    ({"b_size": (128,), "b_stride": (1,)}, "2-D a x 3-D b"),
    ({"offs_size": None}, "no offsets"),
    ({"has_bias": True}, "bias"),
    ({"a_dtype": torch.float16, "b_dtype": torch.float16, "out_dtype": torch.float16}, "bfloat16 throughout"),
    ({"out_dtype": torch.float32}, "bfloat16 throughout"),
    ({"offs_dtype": torch.int64}, "int32"),
    ({"a_size": (256, None), "b_size": (4, None, 64)}, "static"),
    ({"b_size": (None, 128, 64), "offs_size": (None,)}, "static"),
    ({"a_size": (0, 128), "out_size": (0, 64)}, "no tokens"),
    ({"b_size": (4, 128, 60), "b_stride": (7680, 1, 128), "out_size": (256, 60), "out_stride": (64, 1)},
     "multiple of 8"),
    ({"b_size": (600, 128, 64), "offs_size": (600,)}, "groups"),
    ({"a_stride": (1, 256)}, "a of strides"),  # column-major a: ops.grouped_mm would copy it
    ({"a_stride": (132, 1)}, "a of strides"),  # rows 264 bytes apart
    ({"b_stride": (0, 1, 128)}, "neither K- nor N-major"),  # one weight broadcast to every group
    ({"b_stride": (8192, 64, 2)}, "neither K- nor N-major"),
    ({"b_stride": (8192, 1, 132)}, "neither K- nor N-major"),
    ({"out_stride": (1, 256)}, "output"),
])
def test_everything_else_is_declined_with_a_reason(changes, reason):
    got = decline_reason(call(**changes))
    assert got is not None and reason in got, got


def test_benchmark_offsets_are_made_valid():
    good = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    assert runtime.valid_offsets(good, 9) is good
    assert runtime.valid_offsets(torch.tensor([3, 7], dtype=torch.int32), 10).tolist() == [3, 7]  # rows past the end
    for bad in ([5, 3, 9], [1, 2, 14], [-4, 2, 9], [16, 16, 13]):  # the last: stock rounding past the end
        fixed = runtime.valid_offsets(torch.tensor(bad, dtype=torch.int32), 13)
        assert fixed.tolist() == [4, 8, 13] and fixed.dtype == torch.int32


def test_routed_offsets_spread_the_even_split():
    even = torch.arange(1, 129, dtype=torch.int32) * 256  # what torch gives autotuning: 256 rows each
    routed = runtime.routed_offsets(even, 8)
    sizes = torch.diff(routed, prepend=routed.new_zeros(1))
    assert routed.dtype == torch.int32 and routed[-1] == 128 * 256 and bool((sizes >= 0).all())
    assert bool((routed[:-1] % 8 == 0).all())  # ends rounded as torch rounds them
    assert 200 < sizes.min() < 240 and 270 < sizes.max() < 320  # a balanced router's spread, about 16 rows
    assert torch.equal(routed, runtime.routed_offsets(even, 8))  # seeded: every choice meets the same
    # the last end stays the total (rows past it unrouted) even when it is no multiple of 8
    odd = runtime.routed_offsets(torch.tensor([50, 101], dtype=torch.int32), 8)
    assert odd[-1] == 101 and 0 <= odd[0] <= 101 and odd[0] % 8 == 0
    assert runtime.routed_offsets(None, 8) is None


# ---- the stock lowering on real Inductor IR (fake CUDA tensors on the CPU)

def _all_compiled(specs, *args, **kwargs):
    return [SimpleNamespace(status="compiled") for _ in specs]


def lower(fn, specs, *, backends="ATEN,ICUTE", enabled=True, max_autotune=True, configs=None, codegen=False,
          precompile=_all_compiled, enable_kwargs=None):
    """Lower fn on fake CUDA tensors (`specs`: (shape, dtype[, strides])): (each call the stock
    lowering made of autotune_select_algorithm, as (choices, keyword arguments); the output code
    when `codegen`). The recorded select picks the last choice (ours when offered). `configs`
    replaces our candidate list; `precompile` stands in for the compile workers (by default: all
    compiled, nothing compiles)."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    with mode:
        args = [torch.empty_strided(s[0], s[2] if len(s) > 2 else torch.empty(s[0]).stride(), dtype=s[1],
                                    device="cuda") for s in specs]
        gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    calls = []

    def select(name, choices, input_nodes, layout, **kwargs):
        calls.append((list(choices), kwargs))
        return choices[-1].output_node(), choices[-1]

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(mm_grouped, "autotune_select_algorithm", select))  # before enable()
        stack.enter_context(mock.patch.object(mm_grouped, "use_triton_template", lambda *a, **k: False))  # asks CUDA
        stack.enter_context(mock.patch("inductor_cute.inductor.grouped.lowering.sm_count", lambda index: 132))
        stack.enter_context(mock.patch("inductor_cute.host.common.sm_count", lambda index: 132))
        stack.enter_context(mock.patch("inductor_cute.runtime.arch.device_arch", lambda *a: None))
        stack.enter_context(mock.patch("inductor_cute.inductor.gemm.specs.precompile", precompile))
        if configs is not None:
            for module in ("grouped_config", "grouped_wgrad_config"):
                stack.enter_context(mock.patch(f"inductor_cute.kernels.gemm.{module}.candidates",
                                               lambda *a, **k: list(configs)))
        if enabled:
            stack.enter_context(inductor_cute.enable(**(enable_kwargs or {})))
        stack.enter_context(inductor_config.patch(max_autotune=max_autotune, max_autotune_gemm_backends=backends,
                                                  cuda_backend="triton"))
        stack.enter_context(mock.patch("torch._inductor.scheduler.has_triton", lambda: True))
        stack.enter_context(V.set_fake_mode(mode))
        stack.enter_context(DebugContext())
        graph = GraphLowering(gm, shape_env=shape_env)
        stack.enter_context(V.set_graph_handler(graph))
        graph.run(*args)
        code = graph.codegen()[0].value if codegen else None
    return calls, code


def moe_up(a, w, offs):  # b: the transposed view of an (E, N, K) weight
    return torch._grouped_mm(a, w.transpose(1, 2), offs, out_dtype=BF16)


def grouped(a, b, offs):
    return torch._grouped_mm(a, b, offs)


TOKENS, K, N, E = 256, 128, 64, 4
MOE_SPECS = [((TOKENS, K), BF16), ((E, N, K), BF16), ((E,), torch.int32)]


def ours(choices) -> list:
    return [c for c in choices if isinstance(c, CuteGroupedCaller)]


@pytest.mark.parametrize("fn,w_shape,major", [(moe_up, (E, N, K), "k"), (grouped, (E, K, N), "n")])
def test_our_configs_join_the_stock_choices(fn, w_shape, major):
    specs = [MOE_SPECS[0], (w_shape, BF16), MOE_SPECS[2]]
    (stock_choices, stock_kwargs), = lower(fn, specs, enabled=False)[0]
    (choices, kwargs), = lower(fn, specs)[0]
    assert [str(c) for c in choices[:len(stock_choices)]] == [str(c) for c in stock_choices]  # ATen's, unchanged
    problem = GroupedProblem("bfloat16", "bfloat16", "k", major)
    want = candidates(problem, TOKENS, N, K, E, 132)
    assert [c.kwargs["config"] for c in ours(choices)] == [runtime.as_tuple(cfg) for cfg in want]
    assert len(choices) == len(stock_choices) + len(want) and all(c.problem == problem for c in ours(choices))
    assert kwargs.keys() == stock_kwargs.keys() and 2 in kwargs["input_gen_fns"]  # valid offsets for everyone


def test_every_choice_is_timed_on_routed_offsets_when_ours_join(monkeypatch):
    (_, stock_kwargs), = lower(moe_up, MOE_SPECS, enabled=False)[0]
    (_, kwargs), = lower(moe_up, MOE_SPECS)[0]
    even = torch.tensor([64, 128, 192, 256], dtype=torch.int32)  # the stock generator's answer
    monkeypatch.setattr(mm_grouped, "create_offsets", lambda *args: even)
    assert torch.equal(stock_kwargs["input_gen_fns"][2](None), even)
    assert torch.equal(kwargs["input_gen_fns"][2](None), runtime.routed_offsets(even, 8))
    assert not torch.equal(runtime.routed_offsets(even, 8), even)
    # without choices of ours the stock timing inputs stay
    (_, declined_kwargs), = lower(moe_up, MOE_SPECS, configs=[])[0]
    assert torch.equal(declined_kwargs["input_gen_fns"][2](None), even)


def test_a_failure_while_joining_leaves_the_stock_call_as_it_was(monkeypatch):
    from inductor_cute.inductor.grouped import lowering as grouped_lowering

    (stock_choices, stock_kwargs), = lower(moe_up, MOE_SPECS, enabled=False)[0]

    def broken(*args):
        raise RuntimeError("no offsets")

    monkeypatch.setattr(grouped_lowering, "_with_routed_offsets", broken)
    (choices, kwargs), = lower(moe_up, MOE_SPECS)[0]
    assert [str(c) for c in choices] == [str(c) for c in stock_choices] and kwargs.keys() == stock_kwargs.keys()


def test_our_choices_are_bound_to_the_stock_input_nodes_and_layout():
    (choices, _), = lower(moe_up, MOE_SPECS)[0]
    aten, *mine = choices
    assert mine and all(c.input_nodes is aten.input_nodes or c.input_nodes == aten.input_nodes for c in mine)
    assert all(c.layout == aten.layout for c in mine)


def test_three_d_by_three_d_gets_our_bmm_choices():
    # torch._grouped_mm without offsets on 3-D operands is a bmm: our GEMM's configs join, bound to
    # the grouped call's inputs and layout, beside the stock choices
    specs = [((E, 64, K), BF16), ((E, K, N), BF16)]
    fn = lambda a, b: torch._grouped_mm(a, b)  # noqa: E731
    (stock_choices, _), = lower(fn, specs, enabled=False)[0]
    with mock.patch("torch.cuda.get_device_properties", lambda *a: SimpleNamespace(multi_processor_count=132)):
        ((choices, _),), code = lower(fn, specs, codegen=True)  # the recorded select picks ours
    mine = [c for c in choices if isinstance(c, CuteGemmCaller)]
    assert [str(c) for c in choices[:len(stock_choices)]] == [str(c) for c in stock_choices]
    assert mine and len(choices) == len(stock_choices) + len(mine)
    assert all(c.kwargs["op"] == "bmm" and c.layout == stock_choices[0].layout for c in mine)
    assert re.search(r"GemmLauncher\(op='bmm'.*\.launch", code) and re.search(r"icute_gemm_\d+\(a_1, b_1, buf", code)


def test_three_d_by_two_d_keeps_the_stock_choices(caplog):
    specs = [((E, 64, K), BF16), ((K, N * E), BF16), ((E,), torch.int32)]
    fn = lambda a, b, offs: torch._grouped_mm(a, b, offs)  # noqa: E731
    stock_calls, _ = lower(fn, specs, enabled=False)
    with caplog.at_level("INFO", logger="inductor_cute"):
        calls, _ = lower(fn, specs)
    assert [[str(c) for c in choices] for choices, _ in calls] == [[str(c) for c in choices]
                                                                   for choices, _ in stock_calls]
    assert "3-D x 3-D without offsets" in caplog.text


def test_nothing_is_offered_without_max_autotune_or_our_token():
    for kw in ({"max_autotune": False}, {"backends": "ATEN,TRITON"}):
        (choices, _), = lower(moe_up, MOE_SPECS, **kw)[0]
        assert not ours(choices) and choices


def test_disable_leaves_the_stock_lowering():
    from torch._inductor import lowering

    op = torch.ops.aten._grouped_mm.default
    stock, select = lowering.lowerings[op], mm_grouped.autotune_select_algorithm
    with inductor_cute.enable():
        assert lowering.lowerings[op] is not stock and mm_grouped.autotune_select_algorithm is not select
    assert lowering.lowerings[op] is stock and mm_grouped.autotune_select_algorithm is select


def test_a_failed_compile_drops_that_config():
    configs = [GroupedConfig(128, 128, 64, 4, 2), GroupedConfig(64, 128, 64, 4, 1)]
    results = [SimpleNamespace(status="failed", error="ptxas"), SimpleNamespace(status="compiled")]
    (choices, _), = lower(moe_up, MOE_SPECS, configs=configs, precompile=lambda specs, *a, **k: results)[0]
    assert [c.kwargs["config"] for c in ours(choices)] == [runtime.as_tuple(configs[1])]


def test_benchmarking_never_passes_invalid_offsets(monkeypatch):
    (choices, _), = lower(moe_up, MOE_SPECS, configs=[GroupedConfig(64, 128, 64, 4, 1)])[0]
    mine, = ours(choices)
    timed = []
    monkeypatch.setattr(CuteGemmCaller, "benchmark", lambda self, *args, out: timed.append(args[2].tolist()) or 1.0)
    a, b, out = torch.randn(TOKENS, K).bfloat16(), torch.randn(E, N, K).bfloat16().transpose(1, 2), None
    assert mine.benchmark(a, b, torch.tensor([77, -3, 900, 12], dtype=torch.int32), out=out) == 1.0  # random
    assert mine.benchmark(a, b, torch.tensor([0, 64, 64, 200], dtype=torch.int32), out=out) == 1.0  # valid: kept
    assert timed == [[64, 128, 192, 256], [0, 64, 64, 200]]


# ---- output code: the chosen call site's launcher, run on CPU tensors

def reference_kernel(spec):
    """A grouped GEMM kernel computing on the CPU from exactly the views it is given: a (tokens,
    K), b (N, K, groups), offs, out (tokens, N); or, the weight-gradient form, a (M, tokens),
    b (N, tokens), offs, out (M, N, groups)."""
    def kernel(a, b, offs, out, rows=None, gate=None, up=None):  # rows: gathered rows; gate, up: gate_grad's
        reference_kernel.launches.append((spec, (a, b, offs, out)))
        a = a if rows is None else a[rows]
        start = 0
        for g, end in enumerate(offs.tolist()):
            if b.dim() == 2:
                out[:, :, g] = (a[:, start:end].float() @ b[:, start:end].float().t()).to(out.dtype)
            else:
                out[start:end] = (a[start:end].float() @ b[:, :, g].float().t()).to(out.dtype)
            start = end

    return kernel


@pytest.fixture
def cpu_grouped_kernels(monkeypatch):
    """ops.grouped_mm on CPU tensors: device checks passed, 132 SMs, every kernel a reference_kernel."""
    reference_kernel.launches = []
    monkeypatch.setattr(host_grouped, "check_cuda", lambda *tensors: None)
    monkeypatch.setattr(host_grouped, "sm_count", lambda index: 132)
    monkeypatch.setattr(host_grouped, "get_kernel", reference_kernel)
    host_grouped._grouped_kernel.cache_clear()
    runtime._LAUNCHERS.clear()
    yield reference_kernel.launches
    host_grouped._grouped_kernel.cache_clear()
    runtime._LAUNCHERS.clear()


def run_output_code(code: str, tensors: dict, out: torch.Tensor) -> None:
    """Run the launcher definition and its call that output code holds, on these tensors (graph
    inputs by name) with `out` as the output buffer."""
    (name, definition), = re.findall(r"^(icute_grouped_mm_\d+) = (.*)$", code, re.MULTILINE)
    (called, arguments), = re.findall(r"^\s+(icute_grouped_mm_\d+)\((.*)\)$", code, re.MULTILINE)
    assert called == name
    launch = eval(definition, {"inductor_cute": inductor_cute})

    def reinterpret_tensor(t, size, stride, offset):
        return t.as_strided(size, stride, t.storage_offset() + offset)

    buffers = {b: out for b in re.findall(r"\bbuf\d+\b", arguments)}
    eval(f"launch({arguments})", {"launch": launch, "reinterpret_tensor": reinterpret_tensor, **tensors, **buffers})


def test_output_code_runs_ops_grouped_mm_on_the_call_sites_tensors(cpu_grouped_kernels):
    config = GroupedConfig(64, 128, 64, 4, 1)
    _, code = lower(moe_up, MOE_SPECS, backends="ICUTE", configs=[config], codegen=True)
    assert f"import {runtime.MODULE}" in code
    definition, = re.findall(r"^icute_grouped_mm_\d+ = (.*)$", code, re.MULTILINE)
    assert definition == f"{runtime.MODULE}.GroupedLauncher(config={runtime.as_tuple(config)!r}).launch"
    assert "extern_kernels._grouped_mm" not in code
    a, w = torch.randn(TOKENS, K).bfloat16(), torch.randn(E, N, K).div(K ** 0.5).bfloat16()
    sizes = [100, 0, 120, 20]  # an empty group, and 16 rows past the last offset
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = torch.full((TOKENS, N), float("nan"), dtype=BF16)
    for _ in range(2):  # the launcher is built once per call site; each call runs ops.grouped_mm
        run_output_code(code, {"a_1": a, "w_1": w, "offs_1": offs}, out)
    assert len(cpu_grouped_kernels) == 2
    spec, (a_view, b_view, offs_arg, out_view) = cpu_grouped_kernels[-1]
    assert spec.kwargs["b_major"] == "k" and GroupedConfig(*(spec.kwargs[f] for f in config.as_params())) == config
    assert a_view.data_ptr() == a.data_ptr() and b_view.data_ptr() == w.data_ptr()  # read in place
    assert b_view.shape == (N, K, E) and b_view.stride() == (K, 1, N * K)
    assert torch.equal(offs_arg, offs) and out_view.data_ptr() == out.data_ptr()
    want = torch.cat([a[s:e].float() @ w[g].float().t() for g, (s, e) in
                      enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist()))])
    torch.testing.assert_close(out[:240].float(), want, atol=2e-2, rtol=2e-2)
    assert out[240:].isnan().all(), "rows past the last offset were written"


def test_our_extern_kernel_is_what_autotuning_times(cpu_grouped_kernels):
    from torch._inductor.select_algorithm import extern_kernels

    with inductor_cute.enable():
        assert extern_kernels.inductor_cute_grouped_mm is runtime.grouped_mm
    config = runtime.as_tuple(GroupedConfig(64, 128, 64, 4, 1))
    a, b = torch.randn(64, K).bfloat16(), torch.randn(2, K, N).bfloat16()  # row-major weight: N-major
    offs, out = torch.tensor([30, 64], dtype=torch.int32), torch.empty(64, N, dtype=BF16)
    runtime.grouped_mm(a, b, offs, out=out, config=config)
    runtime.grouped_mm(a, b, offs, out=out, config=config)
    assert list(runtime._LAUNCHERS) == [(config, "")]  # one launcher per config, reused
    assert cpu_grouped_kernels[-1][0].kwargs["b_major"] == "n"
    torch.testing.assert_close(out[:30].float(), a[:30].float() @ b[0].float(), atol=2e-2, rtol=2e-2)


# ---- the MoE backward: the input gradient (the forward form, b the transposed weight) and the
# weight gradient (2-D a x 2-D b, groups splitting the reduction)

# a (M=128, tokens=256) as autograd passes it (grad_out.t(): M-major), b (tokens, N=64) row-major
WGRAD = GroupedCall(a_size=(K, TOKENS), a_stride=(1, K), b_size=(TOKENS, N), b_stride=(N, 1),
                    offs_size=(E,), out_size=(E, K, N), out_stride=(K * N, N, 1))


def test_the_weight_gradient_in_either_operand_layout_is_served():
    assert decline_reason(WGRAD) is None and wgrad_majors(WGRAD) == ("m", "n")
    token_major = dataclasses.replace(WGRAD, a_stride=(TOKENS, 1), b_stride=(1, TOKENS))
    assert decline_reason(token_major) is None and wgrad_majors(token_major) == ("k", "k")
    dynamic_tokens = dataclasses.replace(WGRAD, a_size=(K, None), b_size=(None, N))
    assert decline_reason(dynamic_tokens) is None


@pytest.mark.parametrize("changes,reason", [
    ({"a_size": (None, TOKENS), "out_size": (E, None, N)}, "static"),
    ({"offs_size": (None,)}, "static"),
    ({"a_size": (0, TOKENS)}, "M=0"),
    ({"a_size": (K, 0), "b_size": (0, N)}, "no tokens"),
    ({"a_size": (100, TOKENS), "out_size": (E, 100, N), "out_stride": (100 * N, N, 1)}, "M=100"),
    ({"b_size": (TOKENS, 60), "b_stride": (60, 1), "out_size": (E, K, 60)}, "N=60"),
    ({"offs_size": (600,), "out_size": (600, K, N)}, "groups"),
    ({"a_stride": (2, 2 * K)}, "a of strides"),
    ({"b_stride": (N + 4, 1)}, "b of strides"),
    ({"a_size": (K, 250), "a_stride": (256, 1), "b_size": (250, N)}, "a of strides"),  # tokens contiguous, 250
    ({"a_size": (K, None), "a_stride": (256, 1), "b_size": (None, N)}, "a of strides"),
    ({"out_stride": (K * N, 1, K)}, "output"),
    ({"has_bias": True}, "bias"),
    ({"out_dtype": torch.float32}, "bfloat16 throughout"),
])
def test_weight_gradients_we_cannot_serve_are_declined(changes, reason):
    got = decline_reason(dataclasses.replace(WGRAD, **changes))
    assert got is not None and reason in got, got


def wgrad(a, b, offs):  # what autograd calls for an MoE weight: a = grad.t(), b = x
    return torch._grouped_mm(a.t(), b, offs)


WGRAD_SPECS = [((TOKENS, K), BF16), ((TOKENS, N), BF16), ((E,), torch.int32)]


def test_our_weight_gradient_configs_join_the_stock_choices(caplog):
    (stock_choices, stock_kwargs), = lower(wgrad, WGRAD_SPECS, enabled=False)[0]
    with caplog.at_level("INFO", logger="inductor_cute"):
        (choices, kwargs), = lower(wgrad, WGRAD_SPECS)[0]
    assert [str(c) for c in choices[:len(stock_choices)]] == [str(c) for c in stock_choices]
    problem = WgradProblem("bfloat16", "bfloat16", "m", "n")
    want = wgrad_candidates(problem, K, N, TOKENS, E, 132)
    assert [c.kwargs["config"] for c in ours(choices)] == [runtime.as_tuple(cfg) for cfg in want]
    assert all(c.problem == problem for c in ours(choices))
    assert kwargs.keys() == stock_kwargs.keys() and 2 in kwargs["input_gen_fns"]
    assert "(weight gradient) (a m-major, b n-major)" in caplog.text


def moe_training_step(x, w, offs, grad):
    """An MoE expert GEMM's forward and both gradients as autograd computes them: w (E, N, K) as MoE
    layers store it."""
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs)
    return torch.autograd.grad(y, (x, w), grad)


def autograd_graph():
    """moe_training_step as autograd computes it, traced on fake CPU tensors (autograd's engine
    cannot run fake CUDA ones without CUDA); `lower` then lowers it on fake CUDA tensors."""
    x, w = torch.zeros(TOKENS, K, dtype=BF16, requires_grad=True), torch.zeros(E, N, K, dtype=BF16, requires_grad=True)
    offs, grad = torch.tensor([64, 128, 192, 256], dtype=torch.int32), torch.zeros(TOKENS, N, dtype=BF16)
    with torch.enable_grad():
        graph = make_fx(moe_training_step, tracing_mode="fake")(x, w, offs, grad)
    assert sum(n.target is torch.ops.aten._grouped_mm.default for n in graph.graph.nodes) == 3
    return graph


def test_every_grouped_mm_of_the_moe_backward_gets_our_choices():
    specs = [((TOKENS, K), BF16), ((E, N, K), BF16), ((E,), torch.int32), ((TOKENS, N), BF16)]
    calls, _ = lower(autograd_graph(), specs)
    problems = [ours(choices)[0].problem for choices, _ in calls]
    assert len(calls) == 3 and all(ours(choices) for choices, _ in calls)
    assert sorted(map(repr, problems)) == sorted(map(repr, [
        GroupedProblem("bfloat16", "bfloat16", "k", "k"),  # forward: the transposed view of w
        GroupedProblem("bfloat16", "bfloat16", "k", "n"),  # input gradient: w itself, row-major
        WgradProblem("bfloat16", "bfloat16", "m", "n"),  # weight gradient: grad.t() x x
    ]))


def test_the_moe_backwards_output_code_computes_autograds_gradients(cpu_grouped_kernels, monkeypatch):
    """The backward's whole output code (both gradients through our launchers, the views Inductor
    passes them) run on CPU tensors with a kernel computing from the views it is given, against
    the fp32 gradients: dx[rows of g] = grad[rows] @ w[g], dw[g] = grad[rows].t() @ x[rows]."""
    x, w = torch.randn(TOKENS, K).bfloat16(), torch.randn(E, N, K).div(K ** 0.5).bfloat16()
    sizes = [100, 0, 120, 36]  # an empty group
    offs, grad = torch.tensor(sizes).cumsum(0).to(torch.int32), torch.randn(TOKENS, N).bfloat16()
    ends = offs.tolist()
    rows = list(zip([0, *ends[:-1]], ends))
    want_dx = torch.cat([grad[s:e].float() @ w[g].float() for g, (s, e) in enumerate(rows)])
    want_dw = torch.stack([grad[s:e].float().t() @ x[s:e].float() for s, e in rows])
    specs = [((TOKENS, K), BF16), ((E, N, K), BF16), ((E,), torch.int32), ((TOKENS, N), BF16)]
    _, code = lower(autograd_graph(), specs, backends="ICUTE", configs=[GroupedConfig(64, 128, 64, 4, 1)],
                    codegen=True)
    assert code.count(f"{runtime.MODULE}.GroupedLauncher(") == 2 and "extern_kernels._grouped_mm" not in code
    module = {}
    exec(compile(code, "<output code>", "exec"), module)
    module["empty_strided_cuda"] = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype).fill_(
        float("nan"))
    monkeypatch.setattr(torch.cuda, "_DeviceGuard", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    dx, dw = module["call"]([x, w, offs, grad])
    forms = sorted(spec.module.rsplit(".", 1)[-1] for spec, _ in cpu_grouped_kernels)
    assert forms == ["grouped_sm90", "grouped_wgrad_sm90"]
    torch.testing.assert_close(dx.float(), want_dx, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(dw.float(), want_dw, atol=5e-2, rtol=2e-2)
    assert (dw[1] == 0).all()


def test_the_input_gradient_of_a_row_major_weight_is_k_major():
    # forward b = w (E, K, N) row-major; autograd's input gradient takes b = w.transpose(-2, -1)
    dgrad = call(a_size=(TOKENS, N), a_stride=(N, 1), b_size=(E, N, K), b_stride=(N * K, 1, N),
                 out_size=(TOKENS, K), out_stride=(K, 1))
    assert decline_reason(dgrad) is None and b_major(dgrad) == "k"


def test_output_code_runs_the_weight_gradient_on_the_call_sites_tensors(cpu_grouped_kernels):
    config = GroupedConfig(64, 128, 64, 4, 1)
    _, code = lower(wgrad, WGRAD_SPECS, backends="ICUTE", configs=[config], codegen=True)
    assert "extern_kernels._grouped_mm" not in code
    x, dy = torch.randn(TOKENS, K).bfloat16(), torch.randn(TOKENS, N).bfloat16()
    sizes = [100, 0, 120, 20]  # an empty group, and 16 tokens past the last offset
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    out = torch.full((E, K, N), float("nan"), dtype=BF16)
    run_output_code(code, {"a_1": x, "b_1": dy, "offs_1": offs}, out)
    spec, (a_view, b_view, _, out_view) = cpu_grouped_kernels[-1]
    assert spec.module.endswith("grouped_wgrad_sm90") and (spec.kwargs["a_major"], spec.kwargs["b_major"]) == ("m", "n")
    assert a_view.data_ptr() == x.data_ptr() and a_view.shape == (K, TOKENS) and a_view.stride() == (1, K)
    assert b_view.data_ptr() == dy.data_ptr() and b_view.shape == (N, TOKENS) and b_view.stride() == (1, N)
    assert out_view.shape == (K, N, E) and out_view.data_ptr() == out.data_ptr()
    starts = [0, *offs.tolist()[:-1]]
    want = torch.stack([x[s:e].float().t() @ dy[s:e].float() for s, e in zip(starts, offs.tolist())])
    torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=2e-2)
    assert (out[1] == 0).all(), "the empty group's gradient is not zero"


def test_benchmarking_the_weight_gradient_splits_the_tokens(monkeypatch):
    (choices, _), = lower(wgrad, WGRAD_SPECS, configs=[GroupedConfig(64, 128, 64, 4, 1)])[0]
    mine, = ours(choices)
    timed = []
    monkeypatch.setattr(CuteGemmCaller, "benchmark", lambda self, *args, out: timed.append(args[2].tolist()) or 1.0)
    a, b = torch.randn(TOKENS, K).bfloat16().t(), torch.randn(TOKENS, N).bfloat16()
    assert mine.benchmark(a, b, torch.tensor([77, -3, 900, 12], dtype=torch.int32), out=None) == 1.0
    assert timed == [[64, 128, 192, 256]]  # over b's rows (the tokens), not a's


# ---- the fused MoE gate's op (grouped/gate_lowering.py)

def gated(a, w, offs):
    return gate.OP(a, w.transpose(1, 2), offs, "silu")


GATED_SPECS = [((TOKENS, K), BF16), ((E, 2 * 128, K), BF16), ((E,), torch.int32)]


def record_gated_selects(monkeypatch) -> list:
    from torch._inductor import select_algorithm

    recorded = []

    def select(name, choices, input_nodes, layout, **kwargs):
        recorded.append((name, list(choices), kwargs, layout))
        return choices[-1].output_node(), choices[-1]

    monkeypatch.setattr(select_algorithm, "autotune_select_algorithm", select)
    return recorded


def test_the_fused_gate_autotunes_our_gated_configs_on_routed_offsets(monkeypatch):
    recorded = record_gated_selects(monkeypatch)
    _, code = lower(gated, GATED_SPECS, codegen=True, enable_kwargs={"fuse_moe_gate": True})
    (name, choices, kwargs, layout), = recorded
    problem = GroupedProblem("bfloat16", "bfloat16", "k", "k", "silu")
    want = candidates(problem, TOKENS, 2 * 128, K, E, 132)
    assert name == "grouped_mm_gated" and want
    unfused, *ours = choices  # torch's kernels computing the same, then ours
    assert unfused.choice.name == "inductor_cute_grouped_mm_unfused" and unfused.kwargs == {"activation": "silu"}
    assert [c.kwargs["config"] for c in ours] == [runtime.as_tuple(cfg) for cfg in want]
    assert all(c.kwargs["activation"] == "silu" and c.problem == problem for c in ours)
    assert list(layout.size) == [TOKENS, 128] and layout.dtype == BF16
    node = SimpleNamespace(get_device=lambda: torch.device("cpu"), get_dtype=lambda: torch.int32)
    offs = kwargs["input_gen_fns"][2](node)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert offs.dtype == torch.int32 and offs[-1] == TOKENS and len(set(sizes.tolist())) > 1  # routed, not even
    assert re.search(r"GroupedLauncher\(config=\(.*\), activation='silu'\)\.launch", code)


def test_the_fused_gate_without_our_backend_is_the_fallback_kernel(monkeypatch):
    recorded = record_gated_selects(monkeypatch)
    for kw in ({"max_autotune": False}, {"backends": "ATEN,TRITON"}):
        _, code = lower(gated, GATED_SPECS, codegen=True, enable_kwargs={"fuse_moe_gate": True}, **kw)
        assert "inductor_cute.grouped_mm_gated" in code and "GroupedLauncher" not in code
    assert not recorded


def test_a_gated_call_our_kernel_cannot_serve_is_the_fallback_kernel(monkeypatch, caplog):
    recorded = record_gated_selects(monkeypatch)
    fp16 = [((TOKENS, K), torch.float16), ((E, 2 * 128, K), torch.float16), ((E,), torch.int32)]
    with caplog.at_level("INFO", logger="inductor_cute"):
        _, code = lower(gated, fp16, codegen=True, enable_kwargs={"fuse_moe_gate": True})
    assert "inductor_cute.grouped_mm_gated" in code and "GroupedLauncher" not in code and not recorded
    assert "to its fallback: dtypes torch.float16" in caplog.text


def test_a_failure_while_autotuning_the_gate_is_the_fallback_kernel(monkeypatch):
    from inductor_cute.inductor.grouped import gate_lowering

    def broken(*args):
        raise RuntimeError("no choices today")

    monkeypatch.setattr(gate_lowering, "_autotuned", broken)
    _, code = lower(gated, GATED_SPECS, codegen=True, enable_kwargs={"fuse_moe_gate": True})
    assert "inductor_cute.grouped_mm_gated" in code and "GroupedLauncher" not in code


def test_a_gated_launcher_the_kernel_refuses_computes_unfused(monkeypatch):
    def refuse(*args, **kwargs):
        raise host_grouped.UnsupportedError("an unaligned pointer")

    monkeypatch.setattr(runtime.host_grouped, "grouped_mm_gated", refuse)
    a, b = torch.randn(40, K).bfloat16(), torch.randn(E, K, 2 * 48).bfloat16()
    offs, out = torch.tensor([10, 10, 30, 40], dtype=torch.int32), torch.full((40, 48), float("nan"), dtype=BF16)
    runtime.GroupedLauncher(runtime.as_tuple(GroupedConfig()), "silu").launch(a, b, offs, out)
    assert torch.equal(out, gate.unfused(a, b, offs, "silu"))


def test_the_gated_launcher_runs_the_gated_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime.host_grouped, "grouped_mm_gated",
                        lambda *args, config, rows: calls.append((args, config, rows)))
    config = runtime.as_tuple(GroupedConfig(128, 256, 64, 4, 2))
    launcher = runtime.GroupedLauncher(config, "silu")
    assert eval(repr(launcher), {"GroupedLauncher": runtime.GroupedLauncher}).activation == "silu"
    a, b, offs, out = (torch.empty(1),) * 4
    launcher.launch(a, b, offs, out)
    runtime.grouped_mm_gated(a, b, offs, out=out, config=config, activation="silu")
    assert [(args[3], cfg, rows) for args, cfg, rows in calls] == [("silu", GroupedConfig(128, 256, 64, 4, 2), None)] * 2
