"""`python -m inductor_cute doctor`: what is installed, what GPU is here, and a compile self-check."""

from __future__ import annotations

import platform
import time


def _line(ok: bool | None, label: str, detail: str) -> None:
    mark = {True: "ok  ", False: "FAIL", None: "--  "}[ok]
    print(f"[{mark}] {label:<14} {detail}")


def run_doctor() -> int:
    from .errors import InductorCuteError
    from .runtime import arch
    from .runtime.cache import CompiledKernelCache
    from .runtime.dsl import dsl_available, versions

    failures = 0
    _line(True, "python", platform.python_version())
    try:
        import torch

        _line(True, "torch", torch.__version__)
    except ImportError as e:
        _line(False, "torch", str(e))
        return 1
    try:
        import triton

        _line(True, "triton", triton.__version__)
    except ImportError:
        _line(None, "triton", "not installed (needed for benchmarks and torch.compile on GPU)")
    gpu = torch.cuda.is_available()
    if gpu:
        name = torch.cuda.get_device_name()
        try:
            info = arch.device_arch()
            _line(True, "gpu", f"{name}, {arch.sm_count(info)} SMs, target {info.name}")
        except InductorCuteError as e:
            _line(False, "gpu", str(e))
            failures += 1
    else:
        _line(None, "gpu", "no CUDA GPU visible: checking compilation only (for sm_90a)")
    try:
        target = arch.target_arch().name
        _line(True, "target", target)
    except InductorCuteError as e:
        _line(False, "target", str(e))
        return 1
    ok, detail = dsl_available(target)
    _line(ok, "cutlass-dsl", detail)
    _line(bool(versions()["tvm_ffi"]), "tvm-ffi", versions()["tvm_ffi"] or "not installed")
    failures += (not ok) + (not versions()["tvm_ffi"])

    if ok:
        failures += _self_check(target, gpu)
    # After the self-check, which may add its kernel (and the library linked from it): the count
    # then matches what `cache show` prints next.
    cache = CompiledKernelCache()
    entries = cache.entries()
    _line(True, "cache", f"{cache.root} ({len(entries)} entries, {sum(e.size for e in entries) / 1e6:.1f} MB)")
    print("doctor: all checks passed" if not failures else f"doctor: {failures} check(s) failed")
    return 1 if failures else 0


def _self_check(target: str, gpu: bool) -> int:
    """Compile (or load) one kernel; on a GPU also run it against PyTorch."""
    from . import ops
    from .errors import InductorCuteError
    from .kernels.norm.rmsnorm_config import rmsnorm_spec
    from .runtime import get_kernel, stats

    spec = rmsnorm_spec(4096, "bfloat16")
    start = time.perf_counter()
    try:
        get_kernel(spec, target)
    except InductorCuteError as e:
        _line(False, "compile", str(e))
        return 1
    how = "compiled" if stats["compiles"] else "loaded from cache"
    _line(True, "compile", f"{spec.name} for {target}: {how} in {time.perf_counter() - start:.2f} s")
    if not gpu or target != "sm_90a":
        return 0
    import torch
    import torch.nn.functional as F

    x = torch.randn(333, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    got = ops.rmsnorm(x, w, 1e-6).float()
    ref = F.rms_norm(x.double(), (4096,), w.double(), 1e-6).float()
    err = ((got - ref).norm() / ref.norm()).item()
    _line(err < 1e-2, "run", f"rmsnorm on the GPU, relative error {err:.2e}")
    return int(not err < 1e-2)
