"""Compiling many kernels at once in worker processes.

Workers are spawned (never forked: forking after CUDA init is unsafe), hide every GPU so no CUDA
context is created, and write straight into the shared cache; the parent only loads. The default
pool lives as long as the process, so the spawn and the DSL import (seconds) are paid once, not
per GEMM that torch.compile autotunes.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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


_shared_pool: ProcessPoolExecutor | None = None


def _new_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker)


def _process_pool() -> ProcessPoolExecutor:
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = _new_pool(os.cpu_count() or 1)
        atexit.register(_shared_pool.shutdown, wait=False, cancel_futures=True)
    return _shared_pool


def _run(pool: ProcessPoolExecutor, specs, missing, arch, cache) -> dict:
    futures = {i: pool.submit(_compile_in_worker, specs[i], arch, str(cache.root)) for i in missing}
    out = {}
    for i, fut in futures.items():
        status, seconds, error = fut.result()
        out[i] = PrecompileResult(specs[i], status, seconds, error)
    return out


def precompile(specs: list[KernelSpec], arch: str | None = None, cache: CompiledKernelCache | None = None,
               workers: int | None = None) -> list[PrecompileResult]:
    """Make sure every spec is in the cache, compiling the missing ones in parallel: in the
    process's shared pool, or in a pool of `workers` processes made for this call."""
    global _shared_pool
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
    if missing and workers is not None:  # a pool of its own, gone when done
        with _new_pool(max(1, min(workers, len(missing)))) as pool:
            results.update(_run(pool, specs, missing, arch, cache))
    elif missing:
        try:
            results.update(_run(_process_pool(), specs, missing, arch, cache))
        except BrokenProcessPool:  # a worker died (killed, out of memory): one retry on a fresh pool
            _shared_pool = None
            results.update(_run(_process_pool(), specs, missing, arch, cache))
    return [results[i] for i in range(len(specs))]
