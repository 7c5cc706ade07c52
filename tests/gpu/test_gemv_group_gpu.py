"""The decode GEMV over several weights sharing A (one launch for q/k/v or gate/up) on the H200
against an fp32 reference: 2 and 3 weights, ragged N_i, M from 1 to 16, forced K splits, repeated
calls (the split counters reset themselves), bf16 and fp16, ops.gemv_shared_a eager and under
CUDA-graph capture. Each weight's result must also be bitwise the one-weight kernel's with the
same config (the same code and split order). Outputs are poisoned with NaN first so an unwritten
element shows."""

import pytest
import torch

from inductor_cute.kernels.gemm.config import GemmProblem
from inductor_cute.kernels.gemm.gemv_config import (GemvConfig, default_config, spec, splits, unsupported_reason,
                                                    workspace_sizes)
from inductor_cute.runtime import get_kernel, precompile

pytestmark = pytest.mark.gpu

NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
TOKENS = (1, 7, 8, 16)
# (N of each weight, K): Llama-3-8B q/k/v and gate/up, ragged N and K, tiny, and a long K
GROUPS = [((4096, 1024, 1024), 4096), ((14336, 14336), 4096), ((1000, 8, 24), 1000), ((8, 8), 8),
          ((1024, 4096), 14336)]
FP16_GROUPS = GROUPS[:3]
# configs that force many splits with a ragged K tail, one-step slices, 8 warps, and one warp
FORCED = {"k32": GemvConfig(4, 32, 2, 2), "k96-s3": GemvConfig(4, 96, 3, 1), "w8-s8": GemvConfig(8, 512, 8, 2),
          "w1": GemvConfig(1, 256, 4, 1), "v2-k64": GemvConfig(4, 64, 2, 2, vecs=2),  # v2: wide steps
          "m32-w8": GemvConfig(8, 1024, 4, 4)}  # 4 token tiles: explicit configs only so far
FORCED_CASES = [(1, (1000, 8, 24), 2008), (7, (200, 64), 1000), (16, (8, 8, 8), 2048), (8, (4096, 1024, 1024), 1000),
                (32, (4096, 1024, 1024), 4096), (27, (1000, 8, 24), 2008)]

_counters: dict[torch.device, torch.Tensor] = {}


def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def problem_of(dtype):
    return GemmProblem(NAMES[dtype], NAMES[dtype], "k", "k")


def counters(device, n):
    """One zeroed counter buffer per device, shared by every call (each call leaves it zero)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _counters[device] = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)
    return buf


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def launch(a, ws, config, outs):
    """outs[i] = a @ ws[i].t() through the exported kernel (one weight: the plain GEMV's)."""
    (m, k), ns = a.shape, tuple(w.shape[0] for w in ws)
    problem = problem_of(a.dtype)
    assert unsupported_reason(problem, config, m=m, n=ns, k=k, weights=len(ws)) is None
    n_partials, n_counters = workspace_sizes(ns, k, config)
    partials = torch.empty(n_partials, device=a.device, dtype=torch.float32)
    w_arg, d_arg = (ws[0], outs[0]) if len(ws) == 1 else (tuple(ws), tuple(outs))
    get_kernel(spec(problem, config, weights=len(ws)))(a, w_arg, d_arg, None, None, partials,
                                                       counters(a.device, n_counters), 1.0, 0.0)
    return outs


def group_gemv(a, ws, config=None, outs=None):
    ns = tuple(w.shape[0] for w in ws)
    config = config or default_config(problem_of(a.dtype), a.shape[0], ns, a.shape[1], num_sms=sms())
    outs = outs if outs is not None else [poisoned(a.shape[0], n, a.dtype) for n in ns]
    return launch(a, ws, config, outs), config


def operands(m, ns, k, dtype=torch.bfloat16):
    return (torch.randn(m, k, device="cuda", dtype=dtype),
            [torch.randn(n, k, device="cuda", dtype=dtype) for n in ns])


def check(out, a, w):
    ref = a.float() @ w.float().t()
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[a.dtype], f"relative error {err:.2e}"


def check_group(outs, a, ws, config):
    """Every output against the fp32 reference, and bitwise against the one-weight kernel."""
    for out, w in zip(outs, ws, strict=True):
        check(out, a, w)
        (alone,) = launch(a, [w], config, [poisoned(*out.shape, a.dtype)])
        assert torch.equal(out, alone), "differs from the one-weight kernel with the same config"


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel this module uses in parallel worker processes first."""
    specs = set()

    def add(problem, cfg, weights):
        specs.update({spec(problem, cfg, weights=weights), spec(problem, cfg)})

    for dtype, groups in ((torch.bfloat16, GROUPS), (torch.float16, FP16_GROUPS)):
        problem = problem_of(dtype)
        for m in TOKENS:
            for ns, k in groups:
                add(problem, default_config(problem, m, ns, k, num_sms=sms()), len(ns))
    bf16 = problem_of(torch.bfloat16)
    for cfg in FORCED.values():
        for m, ns, _ in FORCED_CASES:
            if m <= 8 * cfg.m_tiles:
                add(bf16, cfg, len(ns))
    failed = [r for r in precompile(sorted(specs, key=lambda s: s.name)) if r.status == "failed"]
    assert not failed, failed[0].error


@pytest.mark.parametrize("ns,k", GROUPS, ids=[f"{'-'.join(map(str, ns))}x{k}" for ns, k in GROUPS])
@pytest.mark.parametrize("m", TOKENS)
def test_groups_bf16(m, ns, k):
    a, ws = operands(m, ns, k)
    outs, config = group_gemv(a, ws)
    check_group(outs, a, ws, config)


@pytest.mark.parametrize("ns,k", FP16_GROUPS, ids=[f"{'-'.join(map(str, ns))}x{k}" for ns, k in FP16_GROUPS])
@pytest.mark.parametrize("m", TOKENS)
def test_groups_fp16(m, ns, k):
    a, ws = operands(m, ns, k, torch.float16)
    outs, config = group_gemv(a, ws)
    check_group(outs, a, ws, config)


@pytest.mark.parametrize("name", sorted(FORCED))
@pytest.mark.parametrize("m,ns,k", FORCED_CASES,
                         ids=[f"m{m}-{'-'.join(map(str, ns))}x{k}" for m, ns, k in FORCED_CASES])
def test_forced_splits(name, m, ns, k):
    cfg = FORCED[name]
    if m > 8 * cfg.m_tiles:
        pytest.skip("config covers fewer tokens")
    a, ws = operands(m, ns, k)
    outs, _ = group_gemv(a, ws, cfg)
    check_group(outs, a, ws, cfg)


def test_outputs_are_written_within_their_own_columns_only():
    """Outputs as views of wider buffers, one of them sliced at an odd row stride: nothing past
    N_i is written, and A may be a 16-byte aligned slice of a wider row."""
    ns, k = (1000, 8, 24), 1000
    big_a = torch.randn(7, k + 72, device="cuda", dtype=torch.bfloat16)
    a = big_a[:, 64:64 + k]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in ns]
    bigs = [poisoned(7, n + 40 + 3 * i, torch.bfloat16) for i, n in enumerate(ns)]
    for cfg in (FORCED["k96-s3"], default_config(problem_of(torch.bfloat16), 7, ns, k, num_sms=sms())):
        for big in bigs:
            big.fill_(float("nan"))
        outs, _ = group_gemv(a, ws, cfg, [big[:, :n] for big, n in zip(bigs, ns)])
        for out, w, big, n in zip(outs, ws, bigs, ns):
            check(out, a, w)
            assert big[:, n:].isnan().all(), "wrote past N"


def test_repeated_calls_are_deterministic_and_leave_counters_zero():
    """Split-K sums in split order, whichever CTA arrives last; the counters (over the whole
    group's blocks) reset themselves. Other groups share the one counter buffer in between."""
    a, ws = operands(8, (4096, 1024, 1024), 4096)
    cfg = default_config(problem_of(torch.bfloat16), 8, (4096, 1024, 1024), 4096, num_sms=sms())
    assert splits(4096, cfg) > 1
    first, _ = group_gemv(a, ws)
    for i in range(20):
        other_a, other_ws = operands(1 + i % 16, (1000, 8, 24) if i % 2 else (14336, 14336), 1000 if i % 2 else 4096)
        group_gemv(other_a, other_ws)
        again, _ = group_gemv(a, ws)
        assert all(torch.equal(x, y) for x, y in zip(again, first))
    torch.cuda.synchronize()
    assert not _counters[a.device].any(), "a split counter was left non-zero"
    check_group(first, a, ws, cfg)


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("ns,k", GROUPS[:3], ids=["qkv", "gate-up", "ragged"])
def test_ops_gemv_shared_a(m, ns, k):
    from inductor_cute import ops

    a, ws = operands(m, ns, k)
    outs = ops.gemv_shared_a(a, ws)
    for out, w in zip(outs, ws, strict=True):
        check(out, a, w)
    for _ in range(3):  # repeated calls take the remembered plan, with fresh outputs each time
        assert all(torch.equal(x, y) for x, y in zip(ops.gemv_shared_a(a, ws), outs))


def test_ops_gemv_shared_a_single_row_with_an_odd_row_stride():
    from inductor_cute import ops

    k = 4096
    a = torch.randn(2, k + 4, device="cuda", dtype=torch.bfloat16)[:1, :k]  # row stride K + 4
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in (4096, 1024, 1024)]
    for out, w in zip(ops.gemv_shared_a(a, ws), ws):
        check(out, a, w)


def test_ops_gemv_shared_a_under_cuda_graph_capture_and_on_a_side_stream():
    from inductor_cute import ops

    a, ws = operands(8, (4096, 1024, 1024), 4096)
    expected = ops.gemv_shared_a(a, ws)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up off the capture, as CUDA graphs require
            ops.gemv_shared_a(a, ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.gemv_shared_a(a, ws)
    for _ in range(3):
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(captured, expected))
    a.copy_(torch.randn_like(a))  # the graph reads the new input in place
    ws[1].copy_(torch.randn_like(ws[1]))  # and the weights: parameters may change in place
    graph.replay()
    torch.cuda.synchronize()
    for out, w in zip(captured, ws):
        check(out, a, w)
