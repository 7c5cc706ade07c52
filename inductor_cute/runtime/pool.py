"""Compiling many kernels at once in worker processes.

Workers are spawned (never forked: forking after CUDA init is unsafe), hide every GPU so no CUDA
context is created, and write straight into the shared cache; the parent only loads.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from ..errors import first_line
from .arch import target_arch
from .cache import CompiledKernelCache
from .spec import KernelSpec


@dataclass
class PrecompileResult:
    spec: KernelSpec
    status: str  # "cached", "compiled" or "failed"
    seconds: float
    error: str | None = None


def _init_worker():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _compile_in_worker(spec: KernelSpec, arch: str, cache_root: str) -> tuple[str, float, str | None]:
    from .loader import ensure_compiled, stats

    start = time.perf_counter()
    try:
        ensure_compiled(spec, arch, CompiledKernelCache(cache_root))
    except Exception as e:  # reported per kernel; one bad config must not sink the others
        return "failed", time.perf_counter() - start, first_line(e)
    status = "compiled" if stats["compiles"] else "cached"
    stats.clear()
    return status, time.perf_counter() - start, None


def precompile(specs: list[KernelSpec], arch: str | None = None, cache: CompiledKernelCache | None = None,
               workers: int | None = None) -> list[PrecompileResult]:
    """Make sure every spec is in the cache, compiling the missing ones in parallel."""
    from .loader import kernel_key

    arch = arch or target_arch().name
    cache = cache or CompiledKernelCache()
    results: dict[int, PrecompileResult] = {}
    missing = []
    for i, spec in enumerate(specs):
        if cache.read(kernel_key(spec, arch)) is not None:
            results[i] = PrecompileResult(spec, "cached", 0.0)
        else:
            missing.append(i)
    if missing:
        n = max(1, min(workers or os.cpu_count() or 1, len(missing)))
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker) as pool:
            futures = {i: pool.submit(_compile_in_worker, specs[i], arch, str(cache.root)) for i in missing}
            for i, fut in futures.items():
                status, seconds, error = fut.result()
                results[i] = PrecompileResult(specs[i], status, seconds, error)
    return [results[i] for i in range(len(specs))]
