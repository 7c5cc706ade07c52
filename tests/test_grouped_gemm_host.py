"""The grouped GEMM's host side on the CPU: which layout of the weight the kernel gets (views, not
copies, for what torch's MoE layers pass), and the refusals that need no GPU."""

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.grouped_gemm import _b_operand, _tma_view, grouped_mm


def test_transposed_weights_are_k_major_views():
    w = torch.randn(4, 256, 128).bfloat16()  # (E, N, K) as stored by an MoE layer
    b = w.transpose(1, 2)  # (E, K, N)
    view, major = _b_operand(b)
    assert major == "k" and view.data_ptr() == w.data_ptr()
    assert view.shape == (256, 128, 4) and view.stride() == (128, 1, 256 * 128)


def test_row_major_weights_are_n_major_views():
    b = torch.randn(4, 128, 256).bfloat16()
    view, major = _b_operand(b)
    assert major == "n" and view.data_ptr() == b.data_ptr() and view.stride() == (1, 256, 128 * 256)


def test_weights_with_unaligned_strides_are_copied_k_major():
    b = torch.randn(3, 64, 70).bfloat16()[:, :, :64]  # rows 140 bytes apart: neither layout is TMA-able
    view, major = _b_operand(b)
    assert major == "k" and view.stride()[1] == 1
    assert torch.equal(view.permute(2, 1, 0), b)


def test_single_group_gets_a_packed_batch_stride():
    b = torch.randn(1, 64, 32).bfloat16()
    view = _tma_view(b, 2)
    assert view.stride(0) % 8 == 0 and view.stride()[1:] == (32, 1)


def test_cpu_tensors_are_refused():
    with pytest.raises(UnsupportedError, match="CUDA device"):
        grouped_mm(torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16(),
                   torch.tensor([4, 8], dtype=torch.int32))
