"""`python -m inductor_cute demo`: what inductor-cute does on this machine, in one command.

With a Hopper GPU it times our kernels against PyTorch eager and torch.compile on a model-sized
input and prints the speedup. Without one it says so and compiles the kernel library for sm_90a.
"""

from __future__ import annotations

import time


def run_demo() -> int:
    import torch

    from .errors import InductorCuteError
    from .runtime import arch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible: nothing can run here. Compiling the kernel library for sm_90a instead.")
        return _compile_library()
    try:
        arch.device_arch()
    except InductorCuteError as e:
        print(f"{e}. Compiling the kernel library for sm_90a instead.")
        return _compile_library()
    return _gpu_demo()


def _compile_library() -> int:
    from .kernels import library_specs
    from .runtime import CompiledKernelCache, precompile
    from .runtime.host_limits import worker_limit

    specs = library_specs()
    cache = CompiledKernelCache()
    print(f"{len(specs)} kernels, up to {worker_limit()} worker processes, cache {cache.root}")
    start = time.perf_counter()
    results = precompile(specs, arch="sm_90a", cache=cache)
    for r in results:
        detail = f"{r.seconds:5.2f} s" if r.status == "compiled" else ""
        print(f"  {r.status:8} {detail:8} {r.spec.name}" + (f": {r.error}" if r.error else ""))
    failed = sum(r.status == "failed" for r in results)
    compiled = sum(r.status == "compiled" for r in results)
    elapsed = time.perf_counter() - start
    if failed:
        print(f"done in {elapsed:.1f} s; {failed} failed, {compiled} compiled.")
    elif compiled:
        print(f"done in {elapsed:.1f} s; {compiled} compiled, 0 failed. Run it again: every kernel is now cached.")
    else:
        print(f"all {len(results)} kernels were already cached ({elapsed:.1f} s); 0 failed, nothing compiled.")
    return 1 if failed else 0


def _gpu_demo() -> int:
    import torch
    import torch.nn.functional as F

    from . import ops
    from .bench.timing import time_us

    tokens, hidden = 8192, 4096
    print(f"RMSNorm over {tokens} tokens x {hidden} hidden (bf16), as in a Llama-3-8B prefill chunk")
    print("(the GEMM backend for torch.compile is not in this release yet; this shows the kernel path)")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    ours = ops.rmsnorm(x, w)
    torch.cuda.synchronize()
    print(f"first call (compile or cache load): {time.perf_counter() - start:.2f} s")
    ref = F.rms_norm(x.float(), (hidden,), w.float(), 1e-6)
    err = ((ours.float() - ref).norm() / ref.norm()).item()
    compiled = torch.compile(lambda a, b: F.rms_norm(a, (hidden,), b, 1e-6))
    compiled(x, w)
    t_ours = time_us(lambda: ops.rmsnorm(x, w))
    t_eager = time_us(lambda: F.rms_norm(x, (hidden,), w, 1e-6))
    t_compiled = time_us(lambda: compiled(x, w))
    gbytes = 2 * x.numel() * x.element_size() / 1e9
    for label, t in (("inductor-cute", t_ours), ("torch.compile", t_compiled), ("eager", t_eager)):
        print(f"  {label:14} {t:8.1f} us  {gbytes / t * 1e3:6.2f} TB/s")
    print(f"speedup: {t_compiled / t_ours:.2f}x over torch.compile, {t_eager / t_ours:.2f}x over eager "
          f"(relative error {err:.1e})")
    return 0 if err < 1e-2 else 1
