"""The decode GEMV on the H200 against an fp32 reference: token counts 1..16, ragged N and K,
forced K splits, every epilogue, fp16 and fp32 outputs, repeated calls (the split counters reset
themselves), NaN/Inf. Outputs are poisoned with NaN first so an unwritten element shows."""

import pytest
import torch
import torch.nn.functional as F

from inductor_cute.kernels.common.programs.epilogue import dumps
from inductor_cute.kernels.gemm.config import GemmProblem
from inductor_cute.kernels.gemm.gemv_config import (GemvConfig, default_config, spec, splits, unsupported_reason,
                                                    workspace_sizes)
from inductor_cute.runtime import get_kernel, precompile

pytestmark = pytest.mark.gpu

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 2e-4}
ACTS = {"identity": lambda x: x, "relu": F.relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_erf": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}
TOKENS = (1, 2, 7, 8, 16)
NK = [(8, 8), (8, 1000), (1000, 8), (1000, 1000), (4096, 4096), (14336, 4096), (4096, 14336)]
# configs that force many splits with a ragged K tail, one-step slices, and the 8-warp CTA
FORCED = {"k32": GemvConfig(4, 32, 2, 2), "k96-s3": GemvConfig(4, 96, 3, 1), "w8-s8": GemvConfig(8, 512, 8, 2),
          "w1": GemvConfig(1, 256, 4, 1),
          # wide steps (2 K-adjacent vectors per thread and row): many splits with ragged K tails,
          # and the shape the H200 sweep is to try at large N
          "v2-k64": GemvConfig(4, 64, 2, 2, vecs=2), "v2-w8-s6": GemvConfig(8, 1024, 6, 2, vecs=2),
          # 3 and 4 token tiles (M up to 24, 32): only explicit configs take them so far
          "m24-k96": GemvConfig(4, 96, 3, 3), "m32-w8": GemvConfig(8, 1024, 4, 4)}
PROGRAM = dumps([["v0", "add", "acc", "row"], ["v1", "mul", "full", 0.5], ["v2", "add", "v0", "v1"],
                 ["v3", "sigmoid", "v2"]])

_counters: dict[torch.device, torch.Tensor] = {}


def counters(device, n):
    """One zeroed counter buffer per device, shared by every call (each call leaves it zero)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _counters[device] = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
    return buf


def problem_for(a, out_dtype, bias, c, activation, epilogue):
    return GemmProblem(NAMES[a.dtype], NAMES[out_dtype], "k", "k", bias is not None, c is not None,
                       activation, epilogue)


def gemv(a, w, *, bias=None, c=None, alpha=1.0, beta=0.0, activation="identity", epilogue="", out_dtype=None,
         config=None, out=None):
    """out = epilogue(a @ w.t()) through the exported kernel: what ops.mm would do for small M."""
    (m, k), n = a.shape, w.shape[0]
    out_dtype = out_dtype or a.dtype
    problem = problem_for(a, out_dtype, bias, c, activation, epilogue)
    if config is None:  # (M > 16 only with an explicit config of 3-4 token tiles)
        assert unsupported_reason(problem, m=m, n=n, k=k) is None
        config = default_config(problem, m, n, k, num_sms=torch.cuda.get_device_properties(a.device).multi_processor_count)
    assert unsupported_reason(problem, config, m=m, n=n, k=k) is None
    n_partials, n_counters = workspace_sizes(n, k, config)
    partials = torch.empty(n_partials, device=a.device, dtype=torch.float32)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype) if out is None else out
    get_kernel(spec(problem, config))(a, w, out, c, bias, partials, counters(a.device, n_counters),
                                      float(alpha), float(beta))
    return out


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def operands(m, n, k, dtype=torch.bfloat16):
    return torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype)


def reference(a, w, bias=None, c=None, alpha=1.0, beta=0.0, act="identity"):
    x = alpha * (a.float() @ w.float().t())
    if bias is not None:
        x = x + bias.float()
    if c is not None:
        x = x + beta * c.float()
    return ACTS[act](x)


def check(out, ref, dtype):
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel this module uses in parallel worker processes first."""
    specs = set()
    plain = {dt: GemmProblem(NAMES[dt], NAMES[dt], "k", "k") for dt in (torch.bfloat16, torch.float16)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in TOKENS:
        for n, k in NK:
            specs.add(spec(plain[torch.bfloat16], default_config(plain[torch.bfloat16], m, n, k, num_sms=sms)))
            for cfg in FORCED.values():
                if m <= 8 * cfg.m_tiles:
                    specs.add(spec(plain[torch.bfloat16], cfg))
    cfg = default_config(plain[torch.bfloat16], 7, 1000, 1000, num_sms=sms)
    for act in ACTS:
        specs.add(spec(GemmProblem("bfloat16", "bfloat16", "k", "k", True, False, act), cfg))
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        specs.add(spec(GemmProblem("bfloat16", NAMES[dt], "k", "k", True, True, "silu"), cfg))
        specs.add(spec(GemmProblem("bfloat16", NAMES[dt], "k", "k", False, True), cfg))
    specs.add(spec(plain[torch.float16], cfg))
    specs.add(spec(plain[torch.float16], GemvConfig(4, 96, 3, 1)))  # the NaN test's
    specs.add(spec(GemmProblem("bfloat16", "bfloat16", "k", "k", True, True, epilogue=PROGRAM), cfg))
    failed = [r for r in precompile(sorted(specs, key=lambda s: s.name)) if r.status == "failed"]
    assert not failed, failed[0].error


@pytest.mark.parametrize("n,k", NK, ids=[f"{n}x{k}" for n, k in NK])
@pytest.mark.parametrize("m", TOKENS)
def test_tokens_and_sizes(m, n, k):
    a, w = operands(m, n, k)
    out = gemv(a, w, out=poisoned(m, n, torch.bfloat16))
    check(out, reference(a, w), torch.bfloat16)


@pytest.mark.parametrize("name", sorted(FORCED))
@pytest.mark.parametrize("m,n,k", [(1, 1000, 1000), (7, 4096, 1000), (16, 200, 2008), (8, 8, 2048), (19, 4096, 1000),
                                   (32, 200, 2008)])
def test_forced_configs(name, m, n, k):
    cfg = FORCED[name]
    if m > 8 * cfg.m_tiles:
        pytest.skip("config covers fewer tokens")
    a, w = operands(m, n, k)
    out = gemv(a, w, config=cfg, out=poisoned(m, n, torch.bfloat16))
    check(out, reference(a, w), torch.bfloat16)


@pytest.mark.parametrize("act", list(ACTS))
def test_bias_and_activation(act):
    a, w = operands(7, 1000, 1000)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    out = gemv(a, w, bias=bias, activation=act, out=poisoned(7, 1000, torch.bfloat16))
    check(out, reference(a, w, bias=bias, act=act), torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_residual_with_alpha_beta_and_bias(out_dtype):
    a, w = operands(7, 1000, 1000)
    bias = torch.randn(1000, device="cuda", dtype=out_dtype)
    c = torch.randn(7, 1000, device="cuda", dtype=out_dtype)
    out = gemv(a, w, bias=bias, c=c, alpha=0.5, beta=-2.0, activation="silu", out_dtype=out_dtype,
               out=poisoned(7, 1000, out_dtype))
    check(out, reference(a, w, bias, c, 0.5, -2.0, "silu"), out_dtype)


def test_broadcast_residual_row_and_strided_operands():
    big_a = torch.randn(7, 1064, device="cuda", dtype=torch.bfloat16)
    a = big_a[:, 32:1032]  # row stride 1064, 16-byte aligned start
    w = torch.randn(1000, 1000, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(1, 1000, device="cuda", dtype=torch.bfloat16).expand(7, 1000)  # row stride 0
    out_big = poisoned(7, 1024, torch.bfloat16)
    out = gemv(a, w, c=c, beta=1.0, out=out_big[:, :1000])
    check(out, reference(a, w, c=c, beta=1.0), torch.bfloat16)
    assert out_big[:, 1000:].isnan().all(), "wrote past N"


def test_fp16_inputs():
    a, w = operands(7, 1000, 1000, torch.float16)
    out = gemv(a, w, out=poisoned(7, 1000, torch.float16))
    check(out, reference(a, w), torch.float16)


def test_epilogue_program():
    a, w = operands(7, 1000, 1000)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(7, 1000, device="cuda", dtype=torch.bfloat16)
    out = gemv(a, w, bias=bias, c=c, epilogue=PROGRAM, out=poisoned(7, 1000, torch.bfloat16))
    ref = torch.sigmoid(a.float() @ w.float().t() + bias.float() + 0.5 * c.float())
    check(out, ref, torch.bfloat16)


def test_repeated_calls_are_deterministic_and_leave_counters_zero():
    """Split-K sums in split order, whichever CTA arrives last; the counters reset themselves.
    Different shapes share the one counter buffer in between."""
    a, w = operands(16, 4096, 4096)
    cfg = default_config(GemmProblem("bfloat16", "bfloat16", "k", "k"), 16, 4096, 4096,
                         num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits(4096, cfg) > 1
    first = gemv(a, w)
    for i in range(20):
        other_a, other_w = operands(1 + i % 16, 1000, 1000)
        gemv(other_a, other_w)
        assert torch.equal(gemv(a, w), first)
    torch.cuda.synchronize()
    assert not _counters[a.device].any(), "a split counter was left non-zero"
    check(first, reference(a, w), torch.bfloat16)


def test_nan_and_inf_propagate_like_torch():
    a, w = operands(8, 1000, 1000, torch.float16)
    a[3, 5] = float("nan")
    w[7, 9] = float("inf")
    w[20, 999] = float("-inf")  # in the ragged last K step
    ours = gemv(a, w, config=GemvConfig(4, 96, 3, 1))  # many splits: the partial path carries them
    theirs = a.float() @ w.float().t()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.isinf(), theirs.isinf())


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (8, 6144, 4096), (16, 1000, 1000), (5, 4096, 14336)])
def test_ops_mm_routes_small_m_against_a_linear_weight_to_the_gemv(m, n, k):
    from inductor_cute import ops

    a, w = operands(m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    assert isinstance(ops.gemm_plan(a, w.t())[1], GemvConfig)
    out = poisoned(m, n, torch.bfloat16)
    ops.mm(a, w.t(), bias=bias, c=c, beta=0.5, activation="silu", out=out)
    check(out, reference(a, w, bias, c, beta=0.5, act="silu"), torch.bfloat16)
    for _ in range(3):  # repeated calls take the fast path, with a fresh workspace each time
        again = poisoned(m, n, torch.bfloat16)
        ops.mm(a, w.t(), bias=bias, c=c, beta=0.5, activation="silu", out=again)
        assert torch.equal(again, out)


def test_ops_mm_gemv_under_cuda_graph_capture_and_on_a_side_stream():
    from inductor_cute import ops

    a, w = operands(8, 4096, 4096)
    assert splits(4096, ops.gemm_plan(a, w.t())[1]) > 1  # the split path, with its counters
    expected = ops.mm(a, w.t())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up off the capture, as CUDA graphs require
            ops.mm(a, w.t())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.mm(a, w.t())
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
    a.copy_(torch.randn_like(a))  # the graph reads the new input in place
    graph.replay()
    torch.cuda.synchronize()
    check(captured, reference(a, w), torch.bfloat16)
