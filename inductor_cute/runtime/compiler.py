"""Compiling a KernelSpec into an exported TVM-FFI object, with no GPU needed.

Runs in whichever process calls it; `cute.compile` is not thread-safe, so calls are serialised
within a process. Parallel compilation uses worker processes (see runtime.pool).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass

from ..errors import CompileError, first_line
from .dsl import import_cute
from .spec import KernelSpec

# Symbol name of every exported kernel; each object holds exactly one.
ENTRY = "kernel"

_compile_lock = threading.Lock()


@dataclass
class CompiledObject:
    object_bytes: bytes  # relocatable ELF object holding host code and the embedded cubin
    compile_s: float
    ptx: str | None = None
    ptxas_report: str | None = None  # ptxas -v: registers, stack frame, spill stores/loads


def ptx_fingerprint(ptx: str) -> str:
    """Hash of the PTX with kernel symbol names taken out: the DSL spells the builder's module path
    into them (cut to a fixed length), so equal fingerprints mean the same generated code wherever
    the kernel's module lives. Each symbol becomes K<n>, numbered by first appearance."""
    names: dict[str, str] = {}

    def placeholder(m: re.Match) -> str:
        base, param = m.group(1), m.group(2) or ""
        return names.setdefault(base, f"K{len(names)}") + param

    normal = re.sub(r"(kernel_cutlass_\w+?)(_param_\d+)?\b", placeholder, ptx)
    return hashlib.sha256(normal.encode()).hexdigest()[:16]


def _log_ptx(spec: KernelSpec, ptx: str | None) -> None:
    # INDUCTOR_CUTE_PTX_LOG=FILE: one line per compile (params, fingerprint), to check that a
    # refactoring leaves every kernel's code unchanged.
    with open(os.environ["INDUCTOR_CUTE_PTX_LOG"], "a") as f:
        f.write(json.dumps([spec.module.rsplit(".", 1)[-1], spec.kwargs, ptx_fingerprint(ptx or "")],
                           sort_keys=True, default=repr) + "\n")


def compile_spec(spec: KernelSpec, arch: str, keep_ptx: bool = False) -> CompiledObject:
    """Trace and compile `spec` for `arch`; returns the exported object (and PTX and the ptxas
    report if asked)."""
    keep_ptx = keep_ptx or bool(os.environ.get("INDUCTOR_CUTE_PTX_LOG"))
    cutlass = import_cute(arch)
    cute = cutlass.cute
    builder = importlib.import_module(spec.module)
    with _compile_lock, tempfile.TemporaryDirectory(prefix="inductor_cute_") as tmp:
        options = f"--enable-tvm-ffi --gpu-arch {arch}"
        report_path = os.path.join(tmp, "ptxas.txt")
        if keep_ptx:
            options += f" --keep-ptx --dump-dir {tmp} --remark-filter ptxas --remark-output {report_path}"
        start = time.perf_counter()
        try:
            fn, args = builder.build(**spec.kwargs)
            compiled = cute.compile(fn, *args, options=options)
            path = os.path.join(tmp, "kernel.o")
            compiled.export_to_c(path, function_name=ENTRY)
        except Exception as e:
            raise CompileError(f"compiling {spec.name} for {arch} failed: {first_line(e)}") from e
        elapsed = time.perf_counter() - start
        ptx = report = None
        if keep_ptx:
            ptx_files = glob.glob(os.path.join(tmp, "*.ptx"))
            if ptx_files:
                with open(ptx_files[0]) as f:
                    ptx = f.read()
            if os.path.exists(report_path):
                with open(report_path) as f:
                    report = f.read()
        if os.environ.get("INDUCTOR_CUTE_PTX_LOG"):
            _log_ptx(spec, ptx)
        with open(path, "rb") as f:
            return CompiledObject(f.read(), elapsed, ptx, report)


def load_object(path: str):
    """Load an exported object and return its kernel as a TVM-FFI function taking torch tensors."""
    import cutlass.cute as cute

    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    return getattr(module, ENTRY)
