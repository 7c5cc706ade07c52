"""From a KernelSpec to a callable kernel: in-process table, then the disk cache, then the compiler."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import tempfile
import threading
import time

from ..errors import CompileError, first_line
from .arch import target_arch
from .cache import CompiledKernelCache
from . import native
from .artifacts import record_artifact
from .compiler import ENTRY, compile_spec, load_object
from .dsl import import_cute, versions
from .host_limits import compile_slot
from .spec import KernelSpec

# What this process did to get its kernels; the tests and `bench` read it.
stats: collections.Counter = collections.Counter()

_loaded: dict[str, object] = {}
_linked_modules: list = []  # shared libraries stay loaded for the life of the process
_load_lock = threading.Lock()


def kernel_key(spec: KernelSpec, arch: str) -> str:
    return spec.key(arch, versions())


def ensure_compiled(spec: KernelSpec, arch: str, cache: CompiledKernelCache,
                    on_compile_start=None) -> tuple[dict, bytes]:
    """(header, object) for `spec`, from the cache or compiled into it.

    One compile per key across processes: a per-key file lock, then one of the host's compile
    slots (taken inside the key lock, so a process waiting for another's compile holds no slot).
    `on_compile_start()` runs once the slot is held, just before compiling: workers use it to
    start the compile's timeout there rather than while they wait.
    """
    key = kernel_key(spec, arch)
    entry = cache.read(key)
    if entry is None:
        with cache.lock(key):
            entry = cache.read(key)  # another process may have finished while we waited
            if entry is None:
                with compile_slot() as slot:
                    if on_compile_start is not None:
                        on_compile_start()
                    started = time.time()
                    obj = compile_spec(spec, arch)
                    ended = time.time()
                stats["compiles"] += 1
                header = cache.write(key, obj.object_bytes, kernel=spec.name, module=spec.module,
                                     params=spec.kwargs, arch=arch, versions=versions(),
                                     compile_s=round(obj.compile_s, 4), pid=os.getpid(),
                                     compiled_between=[started, ended], compile_slot=slot,
                                     runtime_libs=native.runtime_libraries())
                return header, obj.object_bytes
    stats["disk_hits"] += 1
    return entry


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
    error = None
    for _ in range(2):  # a second round after discarding an entry that would not load
        header, payload = ensure_compiled(spec, arch, cache)
        record_artifact(key, payload, header)  # so torch's cache artifacts carry it to other machines
        fn = _load_linked(key, header, payload, cache)
        if fn is not None:
            return fn
        try:
            import_cute(arch)
            with _temp_copy(cache, payload, ".o") as path:
                fn = load_object(path)
            stats["dsl_loads"] += 1
            return fn
        except Exception as e:
            error = e
            cache.discard(key, f"failed to load: {first_line(e)}")
    raise CompileError(f"kernel {spec.name} compiled but could not be loaded: {first_line(error)}")


def _load_linked(key: str, header: dict, payload: bytes, cache: CompiledKernelCache):
    """The kernel from a shared library linked out of the object (cached too); None if unavailable."""
    libs = header.get("runtime_libs") or []
    link_key = hashlib.sha256("\0".join([key, *libs]).encode()).hexdigest()
    entry = cache.read(link_key)
    library = entry[1] if entry else native.link_shared(payload, libs)
    if library is None:
        return None
    if entry is None:
        cache.write(link_key, library, kernel=header.get("kernel"), linked_from=key, arch=header.get("arch"))
    try:
        with _temp_copy(cache, library, ".so") as path:
            module, fn = native.load_shared(path, ENTRY)
    except Exception as e:
        cache.discard(link_key, f"linked library failed to load: {first_line(e)}")
        return None
    _linked_modules.append(module)
    stats["linked_loads"] += 1
    return fn


@contextlib.contextmanager
def _temp_copy(cache: CompiledKernelCache, data: bytes, suffix: str):
    """`data` in a private file for a loader that takes a path; deleted after loading."""
    tmp_dir = cache.root / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=tmp_dir, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def forget_loaded() -> None:
    """Drop the in-process table (tests use it to exercise the disk path)."""
    _loaded.clear()
