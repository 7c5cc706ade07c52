"""Host cost of one GEMM call on each layer of our stack, and where it goes.

    python3 benchmarks/gemm_host_overhead.py          # H200: wall time per call, device times, a profile
    python3 benchmarks/gemm_host_overhead.py --cpu    # any machine: the Python cost alone

--cpu runs the same entry points on CPU tensors with the device checks passed and the kernel
replaced by a no-op, so each row is the Python host cost of the call (views, workspace allocation
and argument passing included; the CPU allocator stands in for CUDA's caching allocator):
(a) ops.mm's first call (every check), (b) ops.mm's fast path (a repeat), (c) runtime.gemm as
output code written before launchers called it (and autotuning still does), (d) the launcher that
output code now calls, (e) its remembered launch alone. Each number is the best of many short
runs: the machine's other load only ever adds time.
"""

from __future__ import annotations

import argparse
import time

import torch

from inductor_cute import ops
from inductor_cute.host import gemm as host_gemm
from inductor_cute.inductor.gemm import runtime
from inductor_cute.kernels.gemm.family import as_tuple

BF16 = torch.bfloat16


def best_us(fn, calls: int = 200, rounds: int = 60) -> float:
    """Least mean wall time per call of `fn()` over `rounds` runs of `calls` back-to-back calls."""
    for _ in range(calls):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def cases(device: str) -> dict:
    """name -> (op, inputs, out): decode GEMV, a mid-size mm, addmm with a bias row, bmm, baddbmm."""
    t = lambda *shape, dtype=BF16: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    w = t(2048, 512)
    wd = t(4096, 4096)
    return {
        "mm 333x2048x512": ("mm", (t(333, 512), w.t()), t(333, 2048)),
        "mm gemv 8x4096x4096": ("mm", (t(8, 4096), wd.t()), t(8, 4096)),
        "addmm row 333x2048x512": ("addmm", (t(2048), t(333, 512), w.t()), t(333, 2048)),
        "bmm 16x200x200x64": ("bmm", (t(16, 200, 64), t(16, 64, 200)), t(16, 200, 200)),
        "baddbmm 16x200x200x64": ("baddbmm", (t(16, 200, 200), t(16, 200, 64), t(16, 64, 200)), t(16, 200, 200)),
    }


def eager_args(op: str, inputs: tuple) -> tuple:
    """(ops function, a, b, keyword arguments) of the eager call that computes `op`."""
    fn = ops.bmm if op in runtime.BATCHED else ops.mm
    if op in runtime.WITH_INPUT:
        inp, a, b = inputs
        return fn, a, b, ({"bias": inp} if inp.dim() == 1 else {"c": inp})
    return fn, *inputs, {}


def cpu_rows() -> None:
    host_gemm.check_cuda = lambda *tensors: None  # CPU tensors stand in for CUDA ones
    host_gemm.sm_count = lambda index: 132
    host_gemm.get_kernel = lambda spec: (lambda *args: None)  # the launch itself costs nothing here
    print(f"Python host cost per call, us (CPU tensors, no-op kernel; torch {torch.__version__})")
    print(f"{'case':26} {'(a) first':>10} {'(b) fast':>9} {'(c) gemm()':>11} {'(d) launcher':>13} {'(e) launch':>11}")
    for name, (op, inputs, out) in cases("cpu").items():
        fn, a, b, kw = eager_args(op, inputs)
        config = as_tuple(ops.gemm_plan(a, b, out=out, **kw)[1])

        def first():
            host_gemm._FAST_PATHS.clear()
            fn(a, b, out=out, **kw)

        launch = runtime.GemmLauncher(op, config).launch
        launch(*inputs, out)
        remembered = next(iter(launch.__self__._plans.values()))
        sources = (*inputs, out)
        row = [best_us(first, calls=20, rounds=30),
               best_us(lambda: fn(a, b, out=out, **kw)),
               best_us(lambda: runtime.gemm(*inputs, out=out, op=op, config=config)),
               best_us(lambda: launch(*inputs, out)),
               best_us(lambda: remembered(sources))]
        print(f"{name:26} " + " ".join(f"{v:{w}.1f}" for v, w in zip(row, (10, 9, 11, 13, 11))))


def gpu_rows() -> None:
    import cProfile
    import io
    import pstats

    from inductor_cute.bench.timing import host_overhead_us, time_us
    from inductor_cute.runtime import precompile, stats

    print("wall time per call of back-to-back calls (host cost when above device time), us")
    for name, (op, inputs, out) in cases("cuda").items():
        fn, a, b, kw = eager_args(op, inputs)
        precompile([ops.gemm_spec_for(a, b, out=out, **kw)])
        config = as_tuple(ops.gemm_plan(a, b, out=out, **kw)[1])
        launcher = runtime.GemmLauncher(op, config)
        launch = launcher.launch
        launch(*inputs, out)
        remembered = next(iter(launcher._plans.values()))
        sources = (*inputs, out)
        kernel_args = remembered.arguments(sources)
        torch_fn = {"mm": torch.mm, "addmm": torch.addmm, "bmm": torch.bmm, "baddbmm": torch.baddbmm}[op]
        rows = {
            "torch (cuBLAS)": lambda: torch_fn(*inputs, out=out),
            "raw kernel (TVM-FFI)": lambda: remembered.kernel(*kernel_args),
            "ops fast path": lambda: fn(a, b, out=out, **kw),
            "runtime.gemm": lambda: runtime.gemm(*inputs, out=out, op=op, config=config),
            "launcher": lambda: launch(*inputs, out),
        }
        print(f"{name}: device time launcher {time_us(lambda: launch(*inputs, out)):.1f} us")
        for row, call in rows.items():
            print(f"  {row:24} host {host_overhead_us(call):7.1f} us/call")
    print("loader stats:", dict(stats))
    op, inputs, out = cases("cuda")["mm gemv 8x4096x4096"]
    launch = runtime.GemmLauncher(op, as_tuple(ops.gemm_plan(inputs[0], inputs[1], out=out)[1])).launch
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        launch(*inputs, out)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-3500:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="Python cost on CPU tensors with a no-op kernel")
    if parser.parse_args().cpu:
        cpu_rows()
    else:
        gpu_rows()


if __name__ == "__main__":
    main()
