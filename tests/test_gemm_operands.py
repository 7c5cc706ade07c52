"""How eager mm/bmm present operands to TMA: layout choice, restriding, copies (CPU tensors)."""

import torch

from inductor_cute.ops import _operand, _tma_view


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
