"""The kernel library in plain CuTe DSL, one module per kernel family and arch.

A kernel module provides `build(**params) -> (jit function, fake arguments)`, the entry point the
runtime compiles; modules never import torch._inductor.
"""

from __future__ import annotations

# Hidden sizes of common LLMs: what `demo` precompiles when there is no GPU.
LIBRARY_HIDDEN_SIZES = (2048, 4096, 5120, 7168, 8192)


def library_specs(dtypes=("bfloat16", "float16")):
    """KernelSpecs of the default configurations of the whole library, for precompiling: RMSNorm
    over common hidden sizes, and nn.Linear-shaped bf16 GEMMs (prefill and decode tiles, plain and
    with a bias+GELU epilogue)."""
    from .gemm import config as gemm
    from .gemm.config import GemmProblem
    from .norm.rmsnorm_config import rmsnorm_spec

    specs = [rmsnorm_spec(n, d) for d in dtypes for n in LIBRARY_HIDDEN_SIZES]
    for problem in (GemmProblem("bfloat16", "bfloat16", "k", "k"),
                    GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True, activation="gelu_tanh")):
        specs += [gemm.spec(problem, gemm.default_config(problem, m, 14336, 4096)) for m in (4096, 16)]
    return specs
