"""Eager entry points: call our kernels on torch tensors, no torch.compile needed.

Every check that can fail is made before a kernel runs and raises UnsupportedError with one line
that names the problem. The implementations live in `inductor_cute.host`, one module per family.
"""

from .host.common import DTYPE_NAMES
from .host.flex import flex_decode
from .host.gemm import bmm, gemm_plan, gemm_spec_for, gemv_shared_a, mm
from .host.grouped_gemm import grouped_mm, grouped_mm_gate_grad, grouped_mm_gated, grouped_mm_wgrad
from .host.rmsnorm import rmsnorm

__all__ = ["DTYPE_NAMES", "bmm", "flex_decode", "gemm_plan", "gemm_spec_for", "gemv_shared_a", "grouped_mm",
           "grouped_mm_gate_grad", "grouped_mm_gated", "grouped_mm_wgrad", "mm", "rmsnorm"]
