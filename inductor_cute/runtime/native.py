"""Linking an exported object into a shared library that TVM-FFI loads without the CuTe DSL.

Loading through the DSL means importing it (0.5-3 s per process); a linked library loads in
milliseconds, so a warm process never imports the DSL. Linking needs a C compiler driver (`cc`, or
$CC), which Triton needs as well; without one the loader falls back to the DSL.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile


def runtime_libraries() -> list[str]:
    """The shared libraries an exported object needs, as the DSL in this process resolves them."""
    from cutlass.runtime import find_runtime_libraries

    return [os.path.realpath(p) for p in find_runtime_libraries(enable_tvm_ffi=True)]


@functools.lru_cache(maxsize=None)
def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def link_shared(object_bytes: bytes, libraries: list[str]) -> bytes | None:
    """The object linked into a shared library against `libraries`; None if that cannot be done."""
    cc = _compiler()
    if cc is None or not libraries or not all(os.path.exists(p) for p in libraries):
        return None
    rpaths = sorted({os.path.dirname(p) for p in libraries})
    with tempfile.TemporaryDirectory(prefix="inductor_cute_link_") as tmp:
        obj, lib = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
        with open(obj, "wb") as f:
            f.write(object_bytes)
        cmd = [cc, "-shared", "-o", lib, obj, *libraries, *(f"-Wl,-rpath,{d}" for d in rpaths)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        with open(lib, "rb") as f:
            return f.read()


def load_shared(path: str, entry: str):
    """(module, function) of a linked library; the module must outlive every call of the function."""
    import tvm_ffi

    module = tvm_ffi.load_module(path)
    return module, getattr(module, entry)
