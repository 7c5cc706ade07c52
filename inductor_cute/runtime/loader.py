"""From a KernelSpec to a callable kernel: in-process table, then the disk cache, then the compiler."""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import threading

from ..errors import CompileError
from .arch import target_arch
from .cache import CompiledKernelCache
from .compiler import compile_spec, load_object
from .dsl import import_cute, versions
from .spec import KernelSpec

# What this process did to get its kernels; the tests and `bench` read it.
stats: collections.Counter = collections.Counter()

_loaded: dict[str, object] = {}
_load_lock = threading.Lock()


def kernel_key(spec: KernelSpec, arch: str) -> str:
    return spec.key(arch, versions())


def ensure_compiled(spec: KernelSpec, arch: str, cache: CompiledKernelCache) -> bytes:
    """The object for `spec`, from the cache or compiled into it; one compile per key across processes."""
    key = kernel_key(spec, arch)
    entry = cache.read(key)
    if entry is None:
        with cache.lock(key):
            entry = cache.read(key)  # another process may have finished while we waited
            if entry is None:
                obj = compile_spec(spec, arch)
                stats["compiles"] += 1
                cache.write(key, obj.object_bytes, kernel=spec.name, module=spec.module,
                            params=spec.kwargs, arch=arch, versions=versions(),
                            compile_s=round(obj.compile_s, 4), pid=os.getpid())
                return obj.object_bytes
    stats["disk_hits"] += 1
    return entry[1]


def get_kernel(spec: KernelSpec, arch: str | None = None, cache: CompiledKernelCache | None = None):
    """The loaded kernel for `spec` on `arch` (default: this process's target); compiles on a miss.

    An in-process hit costs a hash of the spec and a dictionary lookup: no tracing.
    """
    arch = arch or target_arch().name
    key = kernel_key(spec, arch)
    fn = _loaded.get(key)
    if fn is not None:
        stats["memory_hits"] += 1
        return fn
    with _load_lock:
        fn = _loaded.get(key)
        if fn is None:
            fn = _load_or_recompile(spec, arch, key, cache or CompiledKernelCache())
            _loaded[key] = fn
    return fn


def _load_or_recompile(spec, arch, key, cache):
    import_cute(arch)
    error = None
    for _ in range(2):  # a second round after discarding an entry that would not load
        payload = ensure_compiled(spec, arch, cache)
        try:
            return _load_bytes(payload, cache)
        except Exception as e:
            error = e
            cache.discard(key, f"failed to load: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    raise CompileError(f"kernel {spec.name} compiled but could not be loaded: {error}")


def _load_bytes(payload: bytes, cache: CompiledKernelCache):
    # The DSL's loader takes a path; the object is copied out of the entry, loaded, and deleted.
    tmp_dir = cache.root / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=tmp_dir, suffix=".o")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return load_object(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def forget_loaded() -> None:
    """Drop the in-process table (tests use it to exercise the disk path)."""
    _loaded.clear()
