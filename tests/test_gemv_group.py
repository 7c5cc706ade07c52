"""The decode GEMV over several weights sharing A (one launch for q/k/v or gate/up), on the CPU:
compiled for sm_90a and checked in PTX and ptxas's report; the limits, heuristic, workspace and
spec of a group; ops.gemv_shared_a's argument checks and what it passes the kernel."""

import re

import pytest
import torch

from inductor_cute import UnsupportedError, ops
from inductor_cute.errors import CompileError
from inductor_cute.kernels.common.programs.epilogue import dumps
from inductor_cute.kernels.gemm.config import GemmProblem
from inductor_cute.kernels.gemm.gemv_config import (MAX_REGISTERS, GemvConfig, candidates, default_config, n_blocks,
                                                    spec, splits, unsupported_reason, workspace_sizes)
from inductor_cute.runtime.compiler import compile_spec
from ptx_order import check_waits_then_releases, entries

BF16 = GemmProblem("bfloat16", "bfloat16", "k", "k")
FP16 = GemmProblem("float16", "float16", "k", "k")
QKV = (4096, 1024, 1024)  # Llama-3-8B's q, k, v projections

GROUPS = {
    "bf16-m8-g2": (BF16, GemvConfig(8, 1024, 8, 1), 2),
    "bf16-m16-g3": (BF16, GemvConfig(8, 512, 8, 2), 3),
    "fp16-m16-4-warps-g3": (FP16, GemvConfig(4, 512, 4, 2), 3),
}


@pytest.fixture(scope="module", params=sorted(GROUPS))
def group(request):
    problem, config, weights = GROUPS[request.param]
    return config, weights, compile_spec(spec(problem, config, weights=weights), "sm_90a", keep_ptx=True)


def test_each_weight_runs_its_own_copy_of_the_one_weight_code(group):
    config, weights, compiled = group
    ptx = compiled.ptx
    assert ptx.count(".entry ") == 1  # one launch
    assert ptx.count("mma.sync.aligned") == 2 * config.m_tiles * weights
    assert ptx.count("atom.global.acq_rel.add.u32") == weights  # each branch arrives on its block's counter
    assert ptx.count("fence.acq_rel.gpu") == 2 * weights
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, 16;", ptx)
    assert "ld.shared.v4.b32" in ptx and "ld.global.cg.v4" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_the_group_waits_for_the_previous_grid_before_any_global_access(group):
    (body,) = entries(group[2].ptx)
    check_waits_then_releases(body)


def test_ptxas_reports_no_spills_and_fits_the_register_cap(group):
    report = group[2].ptxas_report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= MAX_REGISTERS


def test_group_problems_outside_the_kernel_are_named():
    assert unsupported_reason(BF16, m=8, n=QKV, k=4096, weights=3) is None
    assert unsupported_reason(BF16, GemvConfig(m_tiles=2), m=16, n=(8, 8), k=8, weights=2) is None
    assert "1..3 weights" in unsupported_reason(BF16, weights=4)
    assert "1..3 weights" in unsupported_reason(BF16, weights=0)
    program = dumps([["v0", "relu", "acc"]])
    for problem in (GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True),
                    GemmProblem("bfloat16", "bfloat16", "k", "k", has_c=True),
                    GemmProblem("bfloat16", "bfloat16", "k", "k", activation="silu"),
                    GemmProblem("bfloat16", "bfloat16", "k", "k", epilogue=program)):
        assert unsupported_reason(problem, weights=1) is None
        assert "no bias, C, activation" in unsupported_reason(problem, weights=2)
    assert "3 N sizes" in unsupported_reason(BF16, m=8, n=(4096, 1024), k=4096, weights=3)
    assert "multiples of 8" in unsupported_reason(BF16, m=8, n=(4096, 1020), k=4096, weights=2)
    assert "M in 1..16" in unsupported_reason(BF16, m=17, n=QKV, k=4096, weights=3)
    assert "m_tiles=2" in unsupported_reason(BF16, GemvConfig(m_tiles=1), m=9, n=QKV, k=4096, weights=3)
    assert "splits" in unsupported_reason(BF16, GemvConfig(k_slice=32), m=8, n=QKV, k=4096, weights=3)


def test_a_group_with_bias_does_not_build():
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True)
    with pytest.raises(CompileError, match="no bias"):
        compile_spec(spec(problem, GemvConfig(), weights=2), "sm_90a")


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("ns", [QKV, (14336, 14336), (4096, 4096)], ids=str)
def test_group_default_is_the_one_weight_heuristic_for_the_summed_n(m, ns):
    for k in (4096, 14336):
        assert default_config(BF16, m, ns, k) == default_config(BF16, m, sum(ns), k)


def test_ragged_groups_count_every_weights_last_block():
    ns = (1000, 8, 24)
    cfg = default_config(BF16, 8, ns, 1000, num_sms=132)
    assert unsupported_reason(BF16, cfg, m=8, n=ns, k=1000, weights=3) is None
    blocks = n_blocks(ns, cfg)
    assert blocks == 8 + 1 + 1 > n_blocks(sum(ns), cfg)
    s = splits(1000, cfg)
    assert s > 1 and blocks * (s - 1) < 0.75 * 132  # one split less would leave a quarter of the SMs idle


def test_group_candidates_start_with_the_default_and_are_valid_and_distinct():
    for m, ns, k in ((8, QKV, 4096), (16, (14336, 14336), 4096), (1, (1000, 8, 24), 1000)):
        cands = candidates(BF16, m, ns, k)
        assert cands[0] == default_config(BF16, m, ns, k) and len(set(cands)) == len(cands) >= 2
        assert all(unsupported_reason(BF16, c, m=m, n=ns, k=k, weights=len(ns)) is None for c in cands)


def test_group_workspace_spans_the_concatenated_blocks():
    cfg = GemvConfig(4, 512, 4, 2)
    partials, counters = workspace_sizes(QKV, 4096, cfg)
    assert counters == 64 + 16 + 16
    assert partials == 8 * 96 * 128 * 8  # splits x N blocks x threads x fragment
    assert workspace_sizes((1000, 8, 24), 4096, cfg)[1] == 16 + 1 + 1
    assert workspace_sizes(QKV, 512, cfg)[0] == 8  # one split: never touched
    assert workspace_sizes((4096,), 4096, cfg) == workspace_sizes(4096, 4096, cfg)


def test_one_weights_spec_is_the_plain_gemvs_and_groups_name_their_count():
    one = spec(BF16, GemvConfig())
    assert "weights" not in one.kwargs and spec(BF16, GemvConfig(), weights=1) == one  # same cache key as before
    two, three = spec(BF16, GemvConfig(), weights=2), spec(BF16, GemvConfig(), weights=3)
    assert two.kwargs["weights"] == 2 and three.kwargs["weights"] == 3
    assert len({one.name, two.name, three.name}) == 3


# ---- ops.gemv_shared_a on CPU tensors, every kernel a recorder (tests/conftest.py)

K = 256


def weights_of(ns, k=K, dtype=torch.bfloat16):
    return [torch.randn(n, k, dtype=dtype) for n in ns]


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("ns", [QKV, (1000, 8, 24), (256, 512)], ids=str)
def test_one_launch_takes_the_weights_and_outputs_as_tuples(cpu_gemm_kernels, m, ns):
    a, ws = torch.randn(m, K, dtype=torch.bfloat16), weights_of(ns)
    outs = ops.gemv_shared_a(a, ws)
    assert [tuple(o.shape) for o in outs] == [(m, n) for n in ns] and all(o.dtype == torch.bfloat16 for o in outs)
    assert len(cpu_gemm_kernels.launches) == 1
    kernel_spec, args = cpu_gemm_kernels.launches[0]
    cfg = default_config(BF16, m, ns, K, num_sms=132)
    assert kernel_spec == spec(BF16, cfg, weights=len(ns))
    a_arg, w_arg, d_arg, c, bias, partials, counters, alpha, beta = args
    assert a_arg is a and isinstance(w_arg, tuple) and isinstance(d_arg, tuple)
    assert all(x is y for x, y in zip(w_arg, ws, strict=True)) and all(x is y for x, y in zip(d_arg, outs, strict=True))
    assert c is None and bias is None and (alpha, beta) == (1.0, 0.0)
    n_partials, n_counters = workspace_sizes(ns, K, cfg)
    assert partials.dtype == torch.float32 and partials.numel() >= n_partials
    assert counters.dtype == torch.int32 and counters.numel() >= n_counters and not counters.any()


def test_fp16_and_a_given_config(cpu_gemm_kernels):
    cfg = GemvConfig(4, 32, 2, 2)
    ops.gemv_shared_a(torch.randn(9, K, dtype=torch.float16), weights_of((64, 8), dtype=torch.float16), config=cfg)
    assert cpu_gemm_kernels.launches[-1][0] == spec(FP16, cfg, weights=2)
    partials, counters = cpu_gemm_kernels.args[5:7]
    assert (partials.numel(), counters.numel()) == workspace_sizes((64, 8), K, cfg)


def test_one_weight_runs_the_kernel_that_mm_runs(cpu_gemm_kernels):
    a, (w,) = torch.randn(8, K, dtype=torch.bfloat16), weights_of((1024,))
    (out,) = ops.gemv_shared_a(a, [w])
    kernel_spec, args = cpu_gemm_kernels.launches[-1]
    assert args[1] is w and args[2] is out
    ops.mm(a, w.t())
    assert cpu_gemm_kernels.launches[-1][0] == kernel_spec == spec(BF16, default_config(BF16, 8, 1024, K, num_sms=132))


def test_a_single_row_may_have_any_row_stride(cpu_gemm_kernels):
    a = torch.randn(2, 300, dtype=torch.bfloat16)[:1, :K]  # row stride 300: no matter, there is one row
    ops.gemv_shared_a(a, weights_of((64, 64)))
    a_arg = cpu_gemm_kernels.args[0]
    assert a_arg.data_ptr() == a.data_ptr() and a_arg.stride()[1] == 1 and a_arg.stride()[0] % 8 == 0
    assert torch.equal(a_arg, a)


def test_repeats_skip_the_checks(cpu_gemm_kernels, monkeypatch):
    from inductor_cute.host import gemm as host_gemm

    runs = []
    plan = host_gemm._gemv_shared_a_plan
    monkeypatch.setattr(host_gemm, "_gemv_shared_a_plan", lambda *args: runs.append(1) or plan(*args))
    ws = weights_of((128, 64, 64))
    for _ in range(3):
        ops.gemv_shared_a(torch.randn(8, K, dtype=torch.bfloat16), ws)
    ops.gemv_shared_a(torch.randn(4, K, dtype=torch.bfloat16), ws)  # another M: checked again
    assert len(runs) == 2 and len(cpu_gemm_kernels.launches) == 4


def test_no_tokens_no_launch(cpu_gemm_kernels):
    outs = ops.gemv_shared_a(torch.randn(0, K, dtype=torch.bfloat16), weights_of((64, 128)))
    assert [tuple(o.shape) for o in outs] == [(0, 64), (0, 128)] and not cpu_gemm_kernels.launches


def _misaligned(n, k):
    return torch.randn(n * k + 1, dtype=torch.bfloat16)[1:].view(n, k)  # 2 bytes past a 16-byte boundary


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


BAD = {
    "17 tokens": (lambda: (_bf16(17, K), weights_of((64, 64))), "M in 1..16"),
    "K differs": (lambda: (_bf16(8, K), [_bf16(64, K), _bf16(64, 128)]), "K=256 columns"),
    "dtypes differ": (lambda: (_bf16(8, K), [_bf16(64, K), torch.randn(64, K, dtype=torch.float16)]), "alike"),
    "fp32": (lambda: (torch.randn(8, K), [torch.randn(64, K)] * 2), "alike"),
    "4 weights": (lambda: (_bf16(8, K), weights_of((64,) * 4)), "1 to 3 weight tensors"),
    "no weights": (lambda: (_bf16(8, K), []), "1 to 3 weight tensors"),
    "one tensor, not a list": (lambda: (_bf16(8, K), _bf16(64, K)), "1 to 3 weight tensors"),
    "not a tensor": (lambda: (_bf16(8, K), [_bf16(64, K), "w"]), "1 to 3 weight tensors"),
    "3-D A": (lambda: (_bf16(1, 8, K), weights_of((64, 64))), "2-D"),
    "N not a multiple of 8": (lambda: (_bf16(8, K), weights_of((64, 60))), "multiples of 8"),
    "K not a multiple of 8": (lambda: (_bf16(8, 250), weights_of((64, 64), k=250)), "multiples of 8"),
    "transposed weight": (lambda: (_bf16(8, K), [_bf16(64, K), _bf16(K, 64).t()]), "contiguous rows"),
    "strided columns": (lambda: (_bf16(8, K), [_bf16(64, K), _bf16(64, 2 * K)[:, ::2]]), "contiguous rows"),
    "row stride not 16-byte aligned": (lambda: (_bf16(8, K), [_bf16(64, K), _bf16(64, K + 4)[:, :K]]),
                                       "contiguous rows"),
    "misaligned weight": (lambda: (_bf16(8, K), [_bf16(64, K), _misaligned(64, K)]), "16-byte aligned"),
    "misaligned A": (lambda: (_misaligned(8, K), weights_of((64, 64))), "16-byte aligned"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_are_named(cpu_gemm_kernels, case):
    make, message = BAD[case]
    a, ws = make()
    with pytest.raises(UnsupportedError, match=f"^gemv_shared_a: .*{message}"):
        ops.gemv_shared_a(a, ws)
    assert not cpu_gemm_kernels.launches


def test_a_config_that_cannot_run_the_group_is_named(cpu_gemm_kernels):
    with pytest.raises(UnsupportedError, match="cannot run this problem: M=9 needs m_tiles=2"):
        ops.gemv_shared_a(_bf16(9, K), weights_of((64, 64)), config=GemvConfig(m_tiles=1))


def test_cpu_tensors_are_refused():
    with pytest.raises(UnsupportedError, match="^gemv_shared_a: tensors must be on a CUDA device, got cpu$"):
        ops.gemv_shared_a(_bf16(8, K), weights_of((64, 64)))
