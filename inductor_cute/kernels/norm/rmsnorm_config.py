"""RMSNorm's launch configuration and limits: plain Python, usable without the CuTe DSL."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ELEMENT_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}
VECTOR_BITS = 128  # every access is one 16-byte vector
MAX_N = 32768  # above this a row no longer fits one CTA's registers without spilling


@dataclass(frozen=True)
class RMSNormConfig:
    threads_per_cta: int  # a multiple of threads_per_row, at most 1024
    rows_per_cta: int  # one row per group of threads_per_row threads
    vec: int  # elements per 16-byte access

    @property
    def threads_per_row(self) -> int:
        return self.threads_per_cta // self.rows_per_cta

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def unsupported_reason(n: int, dtype_name: str) -> str | None:
    """Why a (hidden size, dtype) has no kernel, in words for the user; None when supported."""
    if dtype_name not in ELEMENT_BITS:
        return f"dtype {dtype_name} is not supported (use bfloat16, float16 or float32)"
    vec = VECTOR_BITS // ELEMENT_BITS[dtype_name]
    if n < 1 or n % vec:
        return f"hidden size {n} must be a positive multiple of {vec} for {dtype_name} (16-byte rows)"
    if n > MAX_N:
        return f"hidden size {n} exceeds the largest supported, {MAX_N}"
    return None


def default_config(n: int, dtype_name: str) -> RMSNormConfig:
    """Threads per row from N: each thread holds about 32 elements (a few vectors) of its row."""
    vec = VECTOR_BITS // ELEMENT_BITS[dtype_name]
    n_vectors = max(1, n // vec)
    per_thread = max(1, 32 // vec)
    if n_vectors <= 32 * per_thread:
        # Short rows: up to one warp per row (a power of two, so shuffles stay in aligned lane groups).
        threads_per_row = min(32, 1 << (n_vectors - 1).bit_length())
    else:
        # Whole warps; among vector counts near the target, waste the fewest slots on the ragged tail.
        candidates = []
        for vectors in range(max(1, per_thread // 2), per_thread + per_thread // 2 + 1):
            threads = min(1024, _ceil_div(_ceil_div(n_vectors, vectors), 32) * 32)
            slots = threads * _ceil_div(n_vectors, threads)
            candidates.append((slots, abs(vectors - per_thread), threads))
        threads_per_row = min(candidates)[2]
    rows = max(1, 128 // threads_per_row)  # small rows: pack several into a 128-thread CTA
    return RMSNormConfig(threads_per_cta=threads_per_row * rows, rows_per_cta=rows, vec=vec)


KERNEL_MODULE = "inductor_cute.kernels.norm.rmsnorm_sm90"


def rmsnorm_spec(n: int, dtype_name: str, config: RMSNormConfig | None = None):
    """The KernelSpec of an RMSNorm kernel (the default configuration unless one is given)."""
    from ...runtime.spec import KernelSpec

    config = config or default_config(n, dtype_name)
    return KernelSpec.make(KERNEL_MODULE, N=n, dtype_name=dtype_name, **config.as_params())
