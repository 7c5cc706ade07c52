"""Host cost of one flex decode call on each layer of our stack, and where it goes.

    python3 benchmarks/flex_host_overhead.py          # H200: wall time per call, device times, a profile
    python3 benchmarks/flex_host_overhead.py --cpu    # any machine: the Python cost alone

--cpu runs the same entry points on CPU tensors with the device checks passed and the kernel
replaced by a no-op, so each row is the Python host cost of the call (views, conversions, the
partials' and outputs' allocation and argument passing included; the CPU allocator stands in for
CUDA's caching allocator): (a) the checked path (ops.flex_decode: every check, program
canonicalisation, block-mask conversion, planning, the kernel lookup), what every compiled call
paid before launchers; (b) runtime.flex_decode, what the custom op's body runs (launcher
lookup, layout key, remembered launch); (c) one call site's launcher; (d) its remembered launch
alone; (e) the op through the dispatcher (what output code called before call sites); (f) what
output code's call cost before launchers: (a) behind a torch.library.custom_op (--cpu only);
(g) what output code calls now: the call site's own launcher, static layouts (no layout key).
Each number is the best of many short runs: the machine's other load only ever adds time.
"""

from __future__ import annotations

import argparse
import time

import torch

from inductor_cute import ops
from inductor_cute.host import flex as host_flex
from inductor_cute.inductor.flex import lowering, runtime
from inductor_cute.kernels.common.programs import score as sp

BF16 = torch.bfloat16
SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = sp.dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
                  ["o", "add", "score", "bias"]])
WINDOW = sp.dumps([["d", "sub", "q", "kv"], ["near", "lt", "d", 1024], ["after", "ge", "d", 0],
                   ["o", "and", "near", "after"]])


def best_us(fn, calls: int = 200, rounds: int = 40) -> float:
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
    """name -> the custom op's arguments: Llama-8B-like decode steps (32 query heads over 8 KV
    heads, head dim 128, an 8K cache), plain, with a score_mod, and with a sliding-window block mask."""
    t = lambda *shape: torch.randn(*shape, device=device, dtype=BF16)  # noqa: E731
    q, k, v = t(4, 32, 1, 128), t(4, 8, 8192, 128), t(4, 8, 8192, 128)
    blocks = 8192 // 128
    idx = torch.arange(blocks - 9, blocks, dtype=torch.int32, device=device).expand(4, 1, 1, -1).contiguous()
    num = torch.full((4, 1, 1), 1, dtype=torch.int32, device=device)
    full_num = torch.full((4, 1, 1), 8, dtype=torch.int32, device=device)
    scale = 128 ** -0.5
    return {
        "plain GQA": (q, k, v, scale, "", [], "", [], None, None, None, None, 0, 0),
        "softcap": (q, k, v, scale, SOFTCAP, [], "", [], None, None, None, None, 0, 0),
        "alibi (1 tensor)": (q, k, v, scale, ALIBI, [torch.rand(32, device=device)], "", [], None, None, None,
                             None, 0, 0),
        "window + block mask": (q, k, v, scale, "", [], WINDOW, [], num, idx[..., :1].contiguous(), full_num,
                                idx[..., 1:].contiguous(), 128, 128),
    }


def checked_call(args):
    """ops.flex_decode as the custom op called it before launchers (k and v streamable here)."""
    q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, *block, kv_block, q_block = args
    return lambda: ops.flex_decode(q, k, v, scale=scale, return_lse=True, score_mod=score_mod or None,
                                   score_tensors=tuple(score_tensors), mask_mod=mask_mod or None,
                                   mask_tensors=tuple(mask_tensors), kv_num_blocks=block[0], kv_indices=block[1],
                                   full_kv_num_blocks=block[2], full_kv_indices=block[3], kv_block_size=kv_block,
                                   q_block_size=q_block)


def layers(args) -> dict:
    """row name -> a call of that layer on the case's arguments."""
    q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, *block, kv_block, q_block = args
    launcher = runtime.launcher(scale, score_mod, mask_mod, kv_block, q_block)
    launch = launcher.launch
    launch(q, k, v, score_tensors, mask_tensors, *block)
    remembered = next(iter(launcher._plans.values()))
    sources = host_flex.sources(q, k, v, None, score_tensors, mask_tensors, block)
    op = torch.ops.inductor_cute.flex_decode.default
    site = runtime.FlexDecodeLauncher(scale, score_mod, mask_mod, kv_block, q_block)
    site.call_static(*args)  # output code's call site (static layouts): remembers its first launch
    return {
        "(a) checked": checked_call(args),
        "(b) runtime.flex_decode": lambda: runtime.flex_decode(*args),
        "(c) launcher": lambda: launch(q, k, v, score_tensors, mask_tensors, *block),
        "(d) launch": lambda: remembered(sources),
        "(e) custom op": lambda: op(*args),
        "(g) call site": lambda: site.call_static(*args),
    }


def before_op():
    """The op as it was: torch.library.custom_op running the checked path each call (on CPU)."""
    @torch.library.custom_op("inductor_cute_bench::flex_decode_before", mutates_args=(), device_types="cpu")
    def before(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, score_mod: str,
               score_tensors: list[torch.Tensor], mask_mod: str, mask_tensors: list[torch.Tensor],
               kv_num_blocks: torch.Tensor | None, kv_indices: torch.Tensor | None,
               full_kv_num_blocks: torch.Tensor | None, full_kv_indices: torch.Tensor | None,
               kv_block_size: int, q_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return checked_call((q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks,
                             kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size))()

    return torch.ops.inductor_cute_bench.flex_decode_before.default


def cpu_rows() -> None:
    host_flex.check_cuda = lambda *tensors: None  # CPU tensors stand in for CUDA ones
    host_flex.sm_count = lambda index: 132
    host_flex.get_kernel = lambda spec: (lambda *args: None)  # the launch itself costs nothing here
    lowering.register_kernel("cpu", lowering.flex_decode_op)  # (e) on CPU tensors
    print(f"Python host cost per call, us (CPU tensors, no-op kernel; torch {torch.__version__})")
    before = before_op()
    names = [*layers(next(iter(cases("cpu").values()))), "(f) before: custom_op"]
    print(f"{'case':20} " + " ".join(f"{n:>{len(n) + 1}}" for n in names))
    with torch.no_grad():
        for name, args in cases("cpu").items():
            calls = {**layers(args), names[-1]: lambda: before(*args)}
            row = [best_us(call, calls=50 if n[1] in "af" else 200) for n, call in calls.items()]
            print(f"{name:20} " + " ".join(f"{v:{len(n) + 1}.1f}" for v, n in zip(row, names)))


def gpu_rows() -> None:
    import cProfile
    import io
    import pstats

    from inductor_cute.bench.timing import host_overhead_us, time_us

    print("wall time per call of back-to-back calls (host cost when above device time), us")
    with torch.no_grad():
        for name, args in cases("cuda").items():
            calls = layers(args)
            launcher = runtime.launcher(*args[3:5], args[6], *args[12:])
            remembered = next(iter(launcher._plans.values()))
            q, k, v, _, _, score_tensors, _, mask_tensors, *block, _, _ = args
            kernel_args = remembered.arguments(host_flex.sources(q, k, v, None, score_tensors, mask_tensors, block))
            print(f"{name}: device time {time_us(calls['(c) launcher']):.1f} us, "
                  f"{remembered.num_splits} splits")
            rows = {"raw kernel (TVM-FFI)": lambda: remembered.kernel(*kernel_args), **calls}
            for row, call in rows.items():
                print(f"  {row:26} host {host_overhead_us(call):7.1f} us/call")
        op = torch.ops.inductor_cute.flex_decode.default
        args = cases("cuda")["window + block mask"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            op(*args)
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
