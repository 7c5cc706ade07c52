"""What each fused epilogue costs over the plain GEMM, on one large bf16 shape (H200).

    python3 benchmarks/epilogue_cost.py
"""

import torch

from inductor_cute import ops
from inductor_cute.bench.timing import time_us
from inductor_cute.runtime import precompile

M, N, K = 4096, 14336, 4096


def main():
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    variants = {"plain": {}, "bias": {"bias": bias}, "relu": {"activation": "relu"},
                "gelu_tanh": {"activation": "gelu_tanh"}, "bias+gelu_tanh": {"bias": bias, "activation": "gelu_tanh"},
                "silu": {"activation": "silu"}, "residual": {"c": c}}
    precompile([ops.gemm_spec_for(a, b, **kw) for kw in variants.values()])
    base = None
    for name, kw in variants.items():
        t = time_us(lambda: ops.mm(a, b, **kw))
        base = base or t
        print(f"{name:16} {t:8.1f} us  {2 * M * N * K / t / 1e6:6.1f} TFLOP/s  {100 * (t / base - 1):+5.1f}%")


if __name__ == "__main__":
    main()
