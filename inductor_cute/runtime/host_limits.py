"""How much compiling one host can take: worker counts, and compile slots shared by every process.

A compile worker (a `python -m inductor_cute.runtime.worker` process) peaked at 445 MiB (VmHWM in
/proc/<pid>/status) after compiling an RMSNorm and 459 MiB after a GEMM with a bias+GELU epilogue,
on the CI machine (2026-12-03); the DSL import, which brings torch, is ~340 MiB of it, and a worker
that only finds kernels in the cache never imports it (~22 MiB). We budget 1 GiB per worker:
about twice what we measured, for larger kernels.

Every compile on the host, in a worker or in-process, holds one of N compile slots: flock()ed
files in a per-user directory. Processes that each size their own pool (torchrun ranks on one
host) therefore run at most N compiles at once in total. A process killed while compiling
releases its slot with its file descriptors, so a slot cannot go stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
import time
from pathlib import Path

WORKER_MEMORY_BYTES = 1 << 30  # budget per compile worker; measured peak ~0.45 GiB
WORKERS_ENV = "INDUCTOR_CUTE_COMPILE_WORKERS"  # requested pool size; default: as many as fit
SLOTS_ENV = "INDUCTOR_CUTE_COMPILE_SLOTS"  # compiles at once on this host; default: as many as fit
SLOTS_DIR_ENV = "INDUCTOR_CUTE_COMPILE_SLOTS_DIR"  # where the slot files live (tests use a private one)
_POLL_S = 0.05


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _memory_bound() -> int | None:
    available = available_memory_bytes()
    return None if available is None else available // WORKER_MEMORY_BYTES


def worker_limit(requested: int | None = None) -> int:
    """Workers one process may run: min(usable cores, requested, available memory / 1 GiB), at
    least 1. `requested` defaults to $INDUCTOR_CUTE_COMPILE_WORKERS."""
    if requested is None and os.environ.get(WORKERS_ENV):
        requested = int(os.environ[WORKERS_ENV])
    bounds = [usable_cores()]
    if requested is not None:
        bounds.append(requested)
    if (memory := _memory_bound()) is not None:
        bounds.append(memory)
    return max(1, min(bounds))


def slot_count() -> int:
    """Compiles at once on this host: $INDUCTOR_CUTE_COMPILE_SLOTS, else min(host cores, available
    memory / 1 GiB). Processes that compute different counts share the first slots, so the bound
    is the largest count any of them uses."""
    if os.environ.get(SLOTS_ENV):
        return max(1, int(os.environ[SLOTS_ENV]))
    bounds = [os.cpu_count() or 1]
    if (memory := _memory_bound()) is not None:
        bounds.append(memory)
    return max(1, min(bounds))


def slots_dir() -> Path:
    """$INDUCTOR_CUTE_COMPILE_SLOTS_DIR, else a directory of this user's under the temp directory
    (host-wide, whatever cache directory a process uses)."""
    if os.environ.get(SLOTS_DIR_ENV):
        path = Path(os.environ[SLOTS_DIR_ENV])
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.gettempdir()) / f"inductor_cute-{os.getuid()}" / "compile-slots"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.parent.stat().st_uid != os.getuid():  # someone else's directory: do not share it
        path = Path.home() / ".cache" / "inductor_cute" / "compile-slots"
        path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def compile_slot():
    """Hold one of the host's compile slots for the body; waits while all are taken. Yields the
    slot's number."""
    n = slot_count()
    directory = slots_dir()
    files = [open(directory / f"slot-{i}.lock", "a+") for i in range(n)]
    held = None
    try:
        first = random.randrange(n)  # spread the processes over the slots rather than all try slot 0
        while held is None:
            for j in range(n):
                f = files[(first + j) % n]
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = (first + j) % n
                break
            else:
                time.sleep(_POLL_S * (0.5 + random.random()))
        yield held
    finally:
        if held is not None:
            fcntl.flock(files[held], fcntl.LOCK_UN)
        for f in files:
            f.close()
