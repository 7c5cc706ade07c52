"""The host and gemm_dynamic suites without a GPU: registration, case lists and names, and that the
dynamic suite's block is the computation its name says."""

import functools

import torch

from inductor_cute.bench.suites import SUITES, gemm_dynamic, host


def test_registered():
    assert SUITES["host"] is host and SUITES["gemm_dynamic"] is gemm_dynamic


def test_gemm_dynamic_cases_name_their_rows_and_share_one_dynamic_compile():
    factories = gemm_dynamic.cases(quick=False)
    assert [f.args[0] for f in factories] == list(gemm_dynamic.ROWS)
    assert all(f.args[1] == gemm_dynamic.ROWS for f in factories)  # one cached dynamic compile per runner
    assert all(f"M={m}" in gemm_dynamic.case_name(m) for m in gemm_dynamic.ROWS)
    assert [f.args[0] for f in gemm_dynamic.cases(quick=True)] == list(gemm_dynamic.QUICK_ROWS)
    assert gemm_dynamic.FIRST_ROWS[0] == 1  # the graph first meets one row


def test_gemm_dynamic_block_is_linear_gelu_linear_plus_residual():
    block = gemm_dynamic.Block(8, 5, device="cpu", dtype=torch.float64)
    assert all(isinstance(p, torch.nn.Parameter) for p in (block.up, block.up_bias, block.down, block.down_bias))
    x = torch.randn(3, 8, dtype=torch.float64)
    h = x @ block.up.t() + block.up_bias
    h = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(block(x), x + h @ block.down.t() + block.down_bias)


def test_host_cases_cover_mm_rows_gemv_and_flex_variants():
    full = host.cases(quick=False)
    assert all(isinstance(f, functools.partial) for f in full)
    mm_rows = [f.args[0] for f in full if f.func is host._mm_case and f.args[-1] == "mm"]
    assert mm_rows == list(host.MM_ROWS)
    assert [f.args[0] for f in full if f.func is host._flex_case] == list(host.FLEX_VARIANTS)
    assert any(f.args[-1] == "gemv" for f in full if f.func is host._mm_case)
    assert len(host.cases(quick=True)) == 2
