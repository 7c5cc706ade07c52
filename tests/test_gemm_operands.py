"""How eager mm/bmm present operands to TMA: layout choice, restriding, copies (CPU tensors)."""

import torch

from inductor_cute.host import gemm as host_gemm
from inductor_cute.host.gemm import _operand, _tma_view


def strides_ok(view, unit):
    return view.stride(unit) == 1 and all(s % 8 == 0 and s > 0 for i, s in enumerate(view.stride()) if i != unit)


def test_row_major_a_is_read_in_place_k_major():
    a = torch.randn(1, 64, 128).permute(1, 2, 0)  # (M, K, L)
    view, unit = _operand(a, (1, 0))
    assert unit == 1 and view.data_ptr() == a.data_ptr() and strides_ok(view, 1)
    assert torch.equal(view, a)


def test_column_major_a_is_read_in_place_m_major():
    a = torch.randn(1, 128, 64).transpose(1, 2).permute(1, 2, 0)  # A (1, 64, 128) column-major
    view, unit = _operand(a, (1, 0))
    assert unit == 0 and view.data_ptr() == a.data_ptr() and torch.equal(view, a)


def test_linear_weight_is_read_in_place_k_major():
    w = torch.randn(256, 64)  # (N, K)
    b = w.t().unsqueeze(0).permute(2, 1, 0)  # B = w.t(), as (N, K, L)
    view, unit = _operand(b, (0, 1))
    assert unit == 1 and view.data_ptr() == w.data_ptr() and torch.equal(view, b)


def test_extent_one_modes_get_packed_strides():
    a = torch.randn(1, 1, 64).permute(1, 2, 0)  # M = 1: its stride is meaningless
    view = _tma_view(a, 1)
    assert view is not None and strides_ok(view, 1) and torch.equal(view, a)


def test_unaligned_rows_and_broadcast_batches_are_copied():
    odd = torch.randn(2, 16, 72)[:, :, :64]  # row stride 72: fine (multiple of 8)
    assert _tma_view(odd.permute(1, 2, 0), 1) is not None
    skew = torch.randn(2, 16, 65)[:, :, :64]  # row stride 65
    view, unit = _operand(skew.permute(1, 2, 0), (1, 0))
    assert unit == 1 and view.data_ptr() != skew.data_ptr() and torch.equal(view, skew.permute(1, 2, 0))
    shared = torch.randn(16, 64).expand(3, 16, 64)  # batch stride 0
    view, _ = _operand(shared.permute(1, 2, 0), (1, 0))
    assert view.stride(2) != 0 and torch.equal(view, shared.permute(1, 2, 0))


def test_misaligned_base_is_copied():
    flat = torch.randn(1 + 16 * 64)
    a = flat[1:].view(1, 16, 64).permute(1, 2, 0)  # base 4 bytes past an aligned address
    assert _tma_view(a, 1) is None
    view, _ = _operand(a, (1, 0))
    assert view.data_ptr() % 16 == 0 and torch.equal(view, a)


def test_impossible_layout_reports_none():
    a = torch.randn(1, 16, 63).permute(1, 2, 0)  # K = 63 contiguous: TMA rows not 16-byte multiples
    view, _ = _operand(a, (1,))
    assert view is None


def _plan(monkeypatch, *args, **kwargs):
    """mm's planning on CPU tensors: the device checks are what a CPU cannot pass."""
    monkeypatch.setattr(host_gemm, "check_cuda", lambda *a: None)
    monkeypatch.setattr(host_gemm, "sm_count", lambda index: 132)
    return host_gemm._prepare_gemm("mm", *args, **kwargs)


def test_plan_reads_linear_weights_in_place_and_defaults_beta(monkeypatch):
    a = torch.randn(1, 32, 64, dtype=torch.bfloat16)
    w = torch.randn(128, 64, dtype=torch.bfloat16)
    c = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    plan, args, out = _plan(monkeypatch, a, w.t().unsqueeze(0), None, c, 2.0, None, "silu", None, None)
    problem, config, num_sms, workspace = plan
    assert (problem.a_major, problem.b_major, problem.has_c, problem.activation) == ("k", "k", True, "silu")
    assert args[1].data_ptr() == w.data_ptr() and args[5:] == (2.0, 1.0)
    assert out.shape == (1, 32, 128) and config.tile_m == 64 and workspace is None


def test_up_to_16_rows_against_a_linear_weight_run_the_gemv(monkeypatch):
    from inductor_cute.kernels.gemm.config import GemmConfig
    from inductor_cute.kernels.gemm.config import GemmProblem
    from inductor_cute.kernels.gemm.gemv_config import GemvConfig, default_config

    w = torch.randn(4096, 4096, dtype=torch.bfloat16)
    for m in (1, 7, 16):
        a, c = torch.randn(1, m, 4096, dtype=torch.bfloat16), torch.randn(1, m, 4096, dtype=torch.bfloat16)
        plan, args, _ = _plan(monkeypatch, a, w.t().unsqueeze(0), None, c, 1.0, None, "identity", None, None)
        assert plan[1] == default_config(GemmProblem("bfloat16", "bfloat16", "k", "k", has_c=True), m, 4096, 4096,
                                         num_sms=132)
        assert plan[3] == (4 * 4096 // 128 * 256 * 4 * plan[1].m_tiles, 4096 // 128, True)  # 4 K splits
        # the kernel's 2-D operands: A (M, K), W (N, K) read in place, D and C (M, N)
        assert [t.shape for t in args[:4]] == [(m, 4096), (4096, 4096), (m, 4096), (m, 4096)]
        assert args[1].data_ptr() == w.data_ptr() and torch.equal(args[3], c[0])
    not_gemv = [(torch.randn(1, 17, 4096), w.t().unsqueeze(0)),  # 17 rows
                (torch.randn(1, 8, 4096), w.unsqueeze(0)),  # N-major B
                (torch.randn(2, 8, 4096), w.t().expand(2, 4096, 4096))]  # batched
    for a, b in not_gemv:
        plan, _, _ = _plan(monkeypatch, a.bfloat16(), b, None, None, 1.0, None, "identity", None, None)
        assert isinstance(plan[1], GemmConfig)
    import pytest

    from inductor_cute import UnsupportedError

    a = torch.randn(1, 17, 4096, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="m_tiles=3"):
        _plan(monkeypatch, a, w.t().unsqueeze(0), None, None, 1.0, None, "identity", None, None,
              config=GemvConfig(m_tiles=2))
    with pytest.raises(UnsupportedError, match="M in 1..32"):  # an explicit config's most rows
        _plan(monkeypatch, torch.randn(1, 33, 4096, dtype=torch.bfloat16), w.t().unsqueeze(0), None, None, 1.0,
              None, "identity", None, None, config=GemvConfig(m_tiles=4))
    with pytest.raises(UnsupportedError, match="m_tiles=2"):
        _plan(monkeypatch, a[:, :9], w.t().unsqueeze(0), None, None, 1.0, None, "identity", None, None,
              config=GemvConfig(m_tiles=1))


def test_config_tuples_round_trip_for_generated_code():
    from inductor_cute.kernels.gemm.config import GemmConfig
    from inductor_cute.kernels.gemm.family import as_tuple, from_tuple
    from inductor_cute.kernels.gemm.gemv_config import GemvConfig

    for cfg in (GemmConfig(128, 128, 64, 2, 1, 6, 2, True, False), GemvConfig(8, 1024, 8, 2)):
        assert from_tuple(as_tuple(cfg)) == cfg and eval(repr(as_tuple(cfg))) == as_tuple(cfg)


def test_plan_of_an_empty_output_launches_nothing(monkeypatch):
    a, b = torch.randn(1, 0, 64, dtype=torch.float16), torch.randn(1, 64, 24, dtype=torch.float16)
    plan, args, out = _plan(monkeypatch, a, b, None, None, 1.0, None, "identity", None, None)
    assert plan is None and args is None and out.shape == (1, 0, 24)


def test_plan_refuses_what_tma_cannot_read(monkeypatch):
    import pytest

    from inductor_cute import UnsupportedError

    a = torch.randn(1, 32, 60, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        _plan(monkeypatch, a, torch.randn(1, 60, 64, dtype=torch.bfloat16), None, None, 1.0, None, "identity",
              None, None)
    with pytest.raises(UnsupportedError, match="N=20 must be a multiple of 8"):
        _plan(monkeypatch, torch.randn(1, 32, 64, dtype=torch.bfloat16), torch.randn(1, 64, 20, dtype=torch.bfloat16),
              None, None, 1.0, None, "identity", None, None)
    with pytest.raises(UnsupportedError, match="activation 'swish'"):
        _plan(monkeypatch, torch.randn(1, 32, 64, dtype=torch.bfloat16), torch.randn(1, 64, 64, dtype=torch.bfloat16),
              None, None, 1.0, None, "swish", None, None)


def test_column_major_a_with_an_odd_m_is_copied_k_major(monkeypatch):
    a = torch.randn(1, 64, 13, dtype=torch.bfloat16).transpose(1, 2)  # (1, 13, 64), M-major, M % 8 != 0
    b = torch.randn(1, 64, 32, dtype=torch.bfloat16)
    plan, args, _ = _plan(monkeypatch, a, b, None, None, 1.0, None, "identity", None, None)
    assert plan[0].a_major == "k" and args[0].stride(1) == 1 and torch.equal(args[0], a.permute(1, 2, 0))


def test_a_k_too_deep_for_the_gemv_falls_back_to_the_gemm(monkeypatch):
    from inductor_cute.kernels.gemm.config import GemmConfig

    k = 64 * 11 * 1024  # 64 splits of an A slice that no longer fits in shared memory
    a, w = torch.randn(1, 8, k, dtype=torch.bfloat16), torch.randn(64, k, dtype=torch.bfloat16)
    plan, _, _ = _plan(monkeypatch, a, w.t().unsqueeze(0), None, None, 1.0, None, "identity", None, None)
    assert isinstance(plan[1], GemmConfig) and plan[3] is None
