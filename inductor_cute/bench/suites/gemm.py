"""Dense bf16 GEMMs: ours vs stock Inductor's Triton template (max-autotune, Triton only) vs cuBLAS."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ... import ops
from ...kernels.gemm import config as gemm_config
from ...kernels.gemm import family, gemv_config
from ...kernels.gemm.gemv_config import GemvConfig
from ...runtime import precompile
from ..case import Case
from ..timing import time_side_by_side

# (M, N, K): the anchors of DESIGN.md, then decoder layers of Llama-3 8B/70B, DeepSeek-V3, Qwen3.
SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 14336), (2048, 7168, 2048),
          (128, 14336, 4096), (16, 4096, 4096),
          (4096, 28672, 8192), (4096, 8192, 28672), (4096, 18432, 7168), (8, 6144, 4096)]
QUICK = [(8192, 8192, 8192), (4096, 14336, 4096), (128, 14336, 4096), (16, 4096, 4096)]
EPILOGUE_SHAPE = (4096, 14336, 4096)


def _triton(fn):
    """Stock Inductor with only its Triton GEMM templates, autotuned (max-autotune)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)

    def run(*args):
        with torch._inductor.config.patch(max_autotune_gemm_backends="TRITON"):
            return compiled(*args)

    return run


def _autotuned(a, b, **kw):
    """ops.mm on the fastest of our candidate configs for these operands, picked by timing them
    as torch.compile's autotuning does; (runner, note naming the pick and the default's time)."""
    problem, default, num_sms = ops.gemm_plan(a, b, **kw)
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    configs = gemm_config.candidates(problem, m, n, k, 1, num_sms)
    if isinstance(default, GemvConfig):  # M <= 16 against a K-major weight: the GEMV's configs too
        configs = gemv_config.candidates(problem, m, n, k, 1, num_sms) + configs
    if default not in configs:
        configs = [default, *configs]
    precompile([family.spec(problem, cfg, num_sms) for cfg in configs])
    times = time_side_by_side({cfg: (lambda cfg=cfg: ops.mm(a, b, config=cfg, **kw)) for cfg in configs}, reps=30, rounds=3)
    best = min(times, key=times.get)
    note = f"ours autotuned over {len(configs)} configs: {best.describe()}; heuristic default {times[default]:.1f} us"
    return (lambda: ops.mm(a, b, config=best, **kw)), note


def _operands(m, n, k, b_major):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if b_major == "n":
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    else:  # an nn.Linear weight (N, K), used transposed
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    return a, b


def _mm_case(m, n, k, b_major) -> Case:
    a, b = _operands(m, n, k, b_major)
    triton_mm = _triton(torch.mm)
    ours, note = _autotuned(a, b)
    return Case(name=f"{m}x{n}x{k} B {b_major.upper()}-major", params={"M": m, "N": n, "K": k, "b_major": b_major},
                flops=2 * m * n * k, bytes=2 * (m * k + k * n + m * n), matmul=True, notes=[note],
                runners={"inductor_cute": ours, "triton": lambda: triton_mm(a, b), "aten": lambda: torch.mm(a, b)})


def _bias_gelu_case() -> Case:
    m, n, k = EPILOGUE_SHAPE
    a, b = _operands(m, n, k, "k")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fused = _triton(lambda a, b, bias: F.gelu(a @ b + bias, approximate="tanh"))
    ours, note = _autotuned(a, b, bias=bias, activation="gelu_tanh")
    return Case(name=f"{m}x{n}x{k} bias+gelu", params={"M": m, "N": n, "K": k, "epilogue": "bias+gelu_tanh"},
                flops=2 * m * n * k, bytes=2 * (m * k + k * n + m * n + n), matmul=True, notes=[note],
                runners={"inductor_cute": ours,
                         "triton": lambda: fused(a, b, bias),
                         "aten": lambda: F.gelu(torch.addmm(bias, a, b), approximate="tanh")})


def _residual_case() -> Case:
    m, n, k = EPILOGUE_SHAPE
    a, b = _operands(m, n, k, "k")
    c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    fused = _triton(lambda a, b, c: a @ b + c)
    ours, note = _autotuned(a, b, c=c, beta=1.0)
    return Case(name=f"{m}x{n}x{k} +residual", params={"M": m, "N": n, "K": k, "epilogue": "residual"},
                flops=2 * m * n * k, bytes=2 * (m * k + k * n + 2 * m * n), matmul=True, notes=[note],
                runners={"inductor_cute": ours, "triton": lambda: fused(a, b, c),
                         "aten": lambda: torch.addmm(c, a, b)})


def cases(quick: bool):
    shapes = QUICK if quick else SHAPES
    out = [functools.partial(_mm_case, m, n, k, major) for m, n, k in shapes for major in ("n", "k")]
    return out + [_bias_gelu_case, _residual_case]
