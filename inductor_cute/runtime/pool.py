"""Compiling many kernels at once in worker processes.

Workers are fresh interpreters running our own entry point (runtime.worker), not multiprocessing
children: nothing of the user's script is imported or re-run in them, with or without a main
guard. They hide every GPU, write straight into the shared cache, and talk to us over pipes; the
parent only loads. A process keeps one pool per target arch for its whole life, so the start and
the DSL import (seconds) are paid once, not per GEMM that torch.compile autotunes. Workers start
when there is work for them, up to runtime.host_limits.worker_limit(); every compile also holds
one of the host's compile slots, which bounds compiles across processes.

A worker that dies takes its kernel with it: that kernel is tried once more on a fresh worker,
then reported failed. A compile that runs past $INDUCTOR_CUTE_COMPILE_TIMEOUT seconds (default
600; counted from when it starts compiling, not while it waits for a slot or for another process
compiling the same kernel) is killed and reported failed.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .arch import target_arch
from .cache import CompiledKernelCache
from .host_limits import worker_limit
from .spec import KernelSpec
from .wire import MessageBuffer, encode

TIMEOUT_ENV = "INDUCTOR_CUTE_COMPILE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
_ATTEMPTS = 2  # a kernel whose worker dies is tried on a fresh one once more
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


@dataclass
class PrecompileResult:
    spec: KernelSpec
    status: str  # "cached", "compiled" or "failed"
    seconds: float
    error: str | None = None


def compile_timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def _worker_env(arch: str) -> dict:
    # The worker imports this very package and whatever builder modules the parent can import.
    paths = [_PACKAGE_PARENT] + [p or os.getcwd() for p in sys.path]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CUTE_DSL_ARCH": arch, "INDUCTOR_CUTE_ARCH": arch,
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class _Worker:
    def __init__(self, arch: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inductor_cute.runtime.worker", "--parent", str(os.getpid()), "--arch", arch],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env(arch))
        os.set_blocking(self.process.stdout.fileno(), False)
        self.buffer = MessageBuffer()
        self.job: int | None = None  # index into the current run's jobs
        self.deadline: float | None = None  # set once its compile starts

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message) -> None:
        self.process.stdin.write(encode(message))
        self.process.stdin.flush()

    def read(self) -> list | None:
        """Whole messages received so far; None once the worker has closed its end (died)."""
        try:
            data = os.read(self.process.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return []
        return None if not data else self.buffer.feed(data)

    def death(self) -> str:
        code = self.process.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the compile worker {how}"

    def stop(self, wait_s: float = 2.0) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # end of stream: an idle worker exits by itself
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


class WorkerPool:
    """Up to `size` compile workers for one arch, started as work arrives and kept until close()."""

    def __init__(self, arch: str, size: int):
        self.arch = arch
        self.size = max(1, size)
        self.workers: list[_Worker] = []
        self.owner = os.getpid()  # a forked child must not talk to its parent's workers
        self._lock = threading.Lock()

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def run(self, specs: list[KernelSpec], cache_root: str) -> list[PrecompileResult]:
        """Compile (or find cached) every spec; one result per spec, in order."""
        with self._lock:
            results: dict[int, PrecompileResult] = {}
            try:
                self._run(specs, cache_root, results)
            finally:  # interrupted: a busy worker's late reply would confuse the next run
                for w in [w for w in self.workers if w.job is not None]:
                    self._discard(w, kill=True)
            return [results[i] for i in range(len(specs))]

    def _run(self, specs, cache_root, results) -> None:
        pending = collections.deque(range(len(specs)))
        attempts = collections.Counter()
        started: dict[int, float] = {}
        timeout_s = compile_timeout_s()
        selector = selectors.DefaultSelector()
        try:
            while len(results) < len(specs):
                # Hand out work: idle workers first, then new ones up to the pool's size.
                idle = [w for w in self.workers if w.job is None]
                while pending and (idle or len(self.workers) < self.size):
                    w = idle.pop() if idle else self._start()
                    i = pending.popleft()
                    try:
                        w.send({"id": i, "spec": specs[i], "cache": cache_root})
                    except OSError:  # it died while idle: not this kernel's fault
                        self._discard(w, kill=True)
                        pending.appendleft(i)
                        continue
                    w.job, w.deadline = i, None
                    started.setdefault(i, time.perf_counter())
                    selector.register(w.process.stdout, selectors.EVENT_READ, w)
                deadlines = [w.deadline for w in self.workers if w.deadline is not None]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, _ in selector.select(wait):
                    w = key.data
                    messages = w.read()
                    if messages is None:
                        selector.unregister(w.process.stdout)
                        i, error = w.job, w.death()
                        self._discard(w, kill=False)
                        attempts[i] += 1
                        if attempts[i] < _ATTEMPTS:
                            pending.appendleft(i)
                        else:
                            results[i] = PrecompileResult(specs[i], "failed", time.perf_counter() - started[i],
                                                          f"{error} while compiling {specs[i].name}")
                        continue
                    for m in messages:
                        if m.get("event") == "compiling":
                            w.deadline = time.monotonic() + timeout_s
                        else:
                            results[m["id"]] = PrecompileResult(specs[m["id"]], m["status"], m["seconds"], m["error"])
                            selector.unregister(w.process.stdout)
                            w.job, w.deadline = None, None
                now = time.monotonic()
                for w in [w for w in self.workers if w.deadline is not None and w.deadline <= now]:
                    selector.unregister(w.process.stdout)
                    i = w.job
                    self._discard(w, kill=True)
                    results[i] = PrecompileResult(specs[i], "failed", time.perf_counter() - started[i],
                                                  f"compiling {specs[i].name} took over {timeout_s:g} s "
                                                  f"(${TIMEOUT_ENV}); the worker was stopped")
        finally:
            selector.close()

    def _start(self) -> _Worker:
        w = _Worker(self.arch)
        self.workers.append(w)
        return w

    def _discard(self, w: _Worker, kill: bool) -> None:
        self.workers.remove(w)
        w.job = w.deadline = None
        if kill:
            with contextlib.suppress(OSError):
                w.process.kill()
        w.stop()

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        # A thread still inside run() at exit must not hold up the interpreter: then stop them anyway.
        locked = self._lock.acquire(timeout=2.0)
        try:
            workers, self.workers = self.workers, []
            for w in workers:  # all at once: each exits at the end of its stdin
                with contextlib.suppress(OSError):
                    w.process.stdin.close()
            for w in workers:
                w.stop()
        finally:
            if locked:
                self._lock.release()


_shared_pools: dict[str, WorkerPool] = {}
_shared_lock = threading.Lock()


def shared_pool(arch: str) -> WorkerPool:
    """This process's pool for `arch`, made on first use and closed at exit."""
    with _shared_lock:
        pool = _shared_pools.get(arch)
        if pool is None or pool.owner != os.getpid():
            pool = _shared_pools[arch] = WorkerPool(arch, worker_limit())
            atexit.register(pool.close)
        return pool


def precompile(specs: list[KernelSpec], arch: str | None = None, cache: CompiledKernelCache | None = None,
               workers: int | None = None) -> list[PrecompileResult]:
    """Make sure every spec is in the cache, compiling the missing ones in parallel: in the
    process's shared pool, or in a pool of at most `workers` processes made for this call."""
    from .loader import kernel_key, stats

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
        todo = [specs[i] for i in missing]
        if workers is not None:  # a pool of its own, gone when done
            pool = WorkerPool(arch, min(worker_limit(workers), len(missing)))
            try:
                done = pool.run(todo, str(cache.root))
            finally:
                pool.close()
        else:
            done = shared_pool(arch).run(todo, str(cache.root))
        results.update(zip(missing, done))
        for r in done:  # compiles in workers, for callers that count them as `stats` counts ours
            stats[f"worker_{r.status}"] += 1
    return [results[i] for i in range(len(specs))]
