"""Where a model step's device time goes, stock torch.compile vs enabled: the `models` suite's model
and step, each compiled once, then torch.profiler over back-to-back steps; per runner the kernels
by total device time, the device time and wall time per step, and the output code.

    python3 benchmarks/profile_model.py [--model llama3-8b] [--layers 4] [--phase decode]
        [--batch 8] [--tokens 8192] [--mode default] [--steps 20] [--out DIR] [--runners stock,enabled]
    python3 benchmarks/profile_model.py --model moe-block --phase fwd --tokens 4096 --mode max-autotune-no-cudagraphs

--model moe-block: the models suite's MoE block (moe_block.py) at --tokens tokens, --phase fwd or train.

--mode default skips autotuning (fast to compile; our GEMMs take part only in max-autotune modes).
The enabled runner gets the models suite's enable() switches (INDUCTOR_CUTE_MODEL_ENABLE adds opt-in ones).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from inductor_cute.bench.profile import (boundary_gaps, busy_us, device_us_per_call, idle_and_overlap_us,
                                         kernel_timeline, split_gaps, times_by_kernel, top_kernels)


def profile(step, forward, steps: int):
    for _ in range(3):
        step(forward)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(forward)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e6
    return wall, kernel_timeline(lambda: step(forward), steps)


def report(name: str, wall: float, timeline: list, steps: int) -> str:
    kernels = times_by_kernel(timeline)
    lines = [f"== {name}: wall {wall:.1f} us/step, device {busy_us(timeline) / steps:.1f} us/step covered by kernels "
             f"({device_us_per_call(kernels, steps):.1f} summed; more where PDL launches overlap)",
             f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel"]
    for per_step, launches, kname in top_kernels(kernels, steps, n=40):
        lines.append(f"{per_step:9.1f} {launches:10.1f} {per_step / launches:8.1f}  {kname[:110]}")
    idle, overlap = idle_and_overlap_us(timeline)
    lines.append(f"-- between kernels: {idle / steps:.1f} us/step idle, {overlap / steps:.1f} overlapped (early PDL "
                 f"starts)\n{'idle us':>9} {'overlap us':>10} {'gaps':>6}  boundary (per step)")
    by_boundary = {pair: (*split_gaps(g), len(g)) for pair, g in boundary_gaps(timeline).items()}
    for (before, after), (b_idle, b_overlap, n) in sorted(by_boundary.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{b_idle / steps:9.1f} {b_overlap / steps:10.1f} {n / steps:6.1f}  {before} -> {after}")
    return "\n".join(lines)


def main() -> None:
    import inductor_cute
    from inductor_cute.bench.suites import models
    from inductor_cute.bench.suites.gemm_compiled import COLD, _fresh_cache, capture
    from torch._inductor import config

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--phase", default="decode")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--mode", default="default")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=".")
    p.add_argument("--runners", default="stock,enabled", help="which of stock,enabled to profile")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.model == "moe-block":
        return profile_moe_block(args)
    model = models.build_model(models.MODELS[args.model], args.layers)
    step = (models.DecodeStep if args.phase == "decode" else models.PrefillStep)(model, args.batch, args.tokens)
    text = [f"{args.model} {args.phase} B{args.batch} tokens {args.tokens}, {args.layers} layers, mode {args.mode}"]
    for name, ours in (("stock", False), ("enabled", True)):
        if name not in args.runners.split(","):
            continue
        codes: list[str] = []
        torch._dynamo.reset()
        enabled = inductor_cute.enable(**models.enable_kwargs(args.phase)) if ours else contextlib.nullcontext()
        with enabled, config.patch(**COLD), _fresh_cache(), capture(codes, []), torch.no_grad():
            forward = torch.compile(model.forward, mode=args.mode, dynamic=False)
            start = time.perf_counter()
            step(forward)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            wall, timeline = profile(step, forward, args.steps)
        with open(os.path.join(args.out, f"profile-{name}-code.py"), "w") as f:
            f.write("\n\n# ---- next graph ----\n\n".join(codes))
        from inductor_cute.inductor.choice_timing import counts

        text.append(f"(compile {compile_s:.1f} s, our call sites {models.our_kernel_calls(chr(10).join(codes))}, "
                    f"autotuning choices timed so far in graphs / by Inductor's benchmarker: "
                    f"{counts['graph']} / {counts['stock']})")
        text.append(report(name, wall, timeline, args.steps))
    out = "\n\n".join(text)
    print(out)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write(out + "\n")


def profile_moe_block(args) -> None:
    """The MoE block's step, compiled as the models suite compiles it (moe_block.make_runner)."""
    from inductor_cute.bench.suites import models, moe_block

    if args.phase not in ("fwd", "train"):
        raise SystemExit(f"--model moe-block takes --phase fwd or train, not {args.phase}")
    train = args.phase == "train"
    block, x = moe_block.make_inputs(args.tokens, train)
    text = [f"moe-block {args.phase} T{args.tokens}, mode {args.mode}, "
            f"enable({models.enable_kwargs('train' if train else 'prefill')})"]
    for name, backend in (("stock", "triton"), ("enabled", "inductor_cute")):
        if name not in args.runners.split(","):
            continue
        torch._dynamo.reset()
        runner = moe_block.make_runner(args.phase, block, x, args.mode, backend,
                                       models.enable_kwargs("train" if train else "prefill"))
        with open(os.path.join(args.out, f"profile-{name}-code.py"), "w") as f:
            f.write(runner.code)
        wall, timeline = profile(lambda run: run(), runner.run, args.steps)
        text.append(f"(compile {runner.seconds:.1f} s, our call sites {models.our_kernel_calls(runner.code)})")
        text.append(report(name, wall, timeline, args.steps))
    out = "\n\n".join(text)
    print(out)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write(out + "\n")


if __name__ == "__main__":
    main()
