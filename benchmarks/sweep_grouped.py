"""Time every grouped GEMM config (clusters included) side by side with eager torch._grouped_mm on
the forward cases of the grouped_gemm suite (H200): which configs the autotuner should be offered,
and whether the 2-CTA clusters (multicast of the weight or token tile) pay off.

    python3 benchmarks/sweep_grouped.py [quick|all|gated]

One line per (case, config): device time (L2 flushed, runs interleaved with eager's), TFLOP/s,
time over the roofline bound at this run's ceilings, and the largest error against eager relative
to its largest value. See docs/perf-notes.md (grouped GEMM clusters).

`gated`: the MoE up projections (fused gate_up weight) as the gated kernel (ops.grouped_mm_gated,
silu(gate) * up in the epilogue) in each config, against the unfused step as a compiled model
runs it: the grouped GEMM (eager torch._grouped_mm, or ours in its default config) and then
silu(gate) * up as one compiled pointwise kernel.
"""

import dataclasses
import sys

import torch

from inductor_cute.bench.suites.grouped_gemm import MODELS, Grouped, cost, group_sizes, make_inputs
from inductor_cute.bench.timing import bound_us, measure_ceilings, time_side_by_side
from inductor_cute.host.grouped_gemm import grouped_mm, grouped_mm_gated
from inductor_cute.kernels.gemm import grouped_config
from inductor_cute.kernels.gemm.grouped_config import GroupedProblem, candidates, default_config, spec
from inductor_cute.runtime import precompile

MODEL = {m.name: m for m in MODELS}
QUICK = [Grouped(MODEL["DeepSeek-V3"], "up", 16384, "balanced"),
         Grouped(MODEL["Qwen3-30B-A3B"], "up", 16384, "skewed"),
         Grouped(MODEL["Mixtral-8x7B"], "up", 4096, "balanced"),
         Grouped(MODEL["Qwen3-30B-A3B"], "down", 16384, "balanced")]
ALL = QUICK + [Grouped(MODEL["DeepSeek-V3"], "down", 16384, "skewed"),
               Grouped(MODEL["gpt-oss-120b"], "up", 4096, "skewed"),
               Grouped(MODEL["Qwen3-235B-A22B"], "up", 16384, "balanced")]
PROBLEM = GroupedProblem("bfloat16", "bfloat16", "k", "k")  # the suite's weights: transposed views


GATED = GroupedProblem("bfloat16", "bfloat16", "k", "k", "silu")
GATED_CASES = [Grouped(MODEL[name], "up", tokens, routing) for name, tokens, routing in (
    ("Qwen3-30B-A3B", 16384, "skewed"), ("Qwen3-30B-A3B", 4096, "balanced"), ("DeepSeek-V3", 16384, "balanced"),
    ("Mixtral-8x7B", 4096, "balanced"), ("gpt-oss-120b", 16384, "skewed"))]


PREFETCH = 8  # k-steps of the weight the producer asks L2 for ahead (GroupedConfig.prefetch)


def configs_of(case, sizes, problem=PROBLEM):
    """Every candidate (clusters too), and the default and the first 2x1 cluster config again
    with the weight prefetched into L2 PREFETCH k-steps ahead."""
    n, k = case.n_k
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = candidates(problem, case.rows, n, k, len(sizes), sms, clusters=True)
    # (2x2 clusters lost on the MoE routing, grouped_config.CLUSTERS_2X2_OFFERED: leave them out)
    configs = [c for c in configs if c.cluster_size <= 2 or grouped_config.CLUSTERS_2X2_OFFERED]
    pairs = [c for c in configs if c.cluster_m == 2][:1]
    return configs + [dataclasses.replace(c, prefetch=PREFETCH) for c in configs[:1] + pairs]


def batched_twin(a, b, sizes) -> dict:
    """For equal groups: the same products as one dense batched GEMM (ours 1x1 and 2x1, cuBLAS),
    whose raster visits the tiles in the grouped order without the grouped code: if it is as slow
    as the grouped kernel, the case's memory behaviour is the bound, not our grouped code."""
    from inductor_cute import ops
    from inductor_cute.kernels.gemm.config import GemmConfig

    if len(set(sizes)) != 1 or sizes[0] % 128:
        return {}
    a3 = a.view(len(sizes), sizes[0], a.shape[1])
    return {"dense bmm 1x1": lambda: ops.bmm(a3, b, config=GemmConfig(128, 256, 64, 1, 1, 4, 2, True, False)),
            "dense bmm 2x1": lambda: ops.bmm(a3, b, config=GemmConfig(128, 256, 64, 2, 1, 4, 2, True, False)),
            "torch.bmm": lambda: torch.bmm(a3, b)}


def gated(ceil: dict) -> None:
    """The gated kernel per config against the unfused step (see the module docstring)."""
    import torch.nn.functional as F

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [(case, group_sizes(case)) for case in GATED_CASES]
    precompile([spec(p, c, sms) for case, sizes in plans for p in (GATED, PROBLEM) for c in configs_of(case, sizes, p)])
    for case, sizes in plans:
        a, b, offs = make_inputs(case, sizes)
        half = b.shape[-1] // 2
        pointwise = torch.compile(lambda h: F.silu(h[:, :half]) * h[:, half:])
        ref = pointwise(torch._grouped_mm(a, b, offs))
        scale = ref.float().abs().max().item()
        flops, n_bytes = cost(case, sizes)
        n_bytes -= a.shape[0] * half * 2  # the output is half as wide
        fns = {"eager grouped_mm + compiled pointwise": lambda: pointwise(torch._grouped_mm(a, b, offs)),
               "ours (default) + compiled pointwise": lambda: pointwise(grouped_mm(a, b, offs))}
        errors = {}
        for c in configs_of(case, sizes, GATED):
            errors[c] = (grouped_mm_gated(a, b, offs, config=c).float() - ref.float()).abs().max().item() / scale
            fns[c] = (lambda c=c: grouped_mm_gated(a, b, offs, config=c))
        times = time_side_by_side(fns, reps=60, rounds=6)
        default = default_config(GATED, case.rows, *case.n_k, len(sizes), sms)
        print(f"{case.name} gated | bound {bound_us(flops, n_bytes, ceil):.1f} us | default {default.describe()}",
              flush=True)
        for key, t in times.items():
            name = key if isinstance(key, str) else "gated " + key.describe()
            err = f"  relerr {errors[key]:.1e}" if key in errors else ""
            print(f"    {name:52} {t:9.1f} us {flops / t / 1e6:5.0f} TFLOP/s{err}", flush=True)


def main(which: str) -> None:
    if which == "gated":
        ceil = measure_ceilings()
        print(f"ceilings {ceil}", flush=True)
        return gated(ceil)
    cases = ALL if which == "all" else QUICK
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [(case, group_sizes(case)) for case in cases]
    precompile([spec(PROBLEM, c, sms) for case, sizes in plans for c in configs_of(case, sizes)])
    ceil = measure_ceilings()
    print(f"ceilings {ceil}", flush=True)
    for case, sizes in plans:
        a, b, offs = make_inputs(case, sizes)
        flops, n_bytes = cost(case, sizes)
        ref = torch._grouped_mm(a, b, offs)
        scale = ref.float().abs().max().item()
        fns = {"eager": lambda: torch._grouped_mm(a, b, offs)}
        errors = {}
        for c in configs_of(case, sizes):
            try:
                err = (grouped_mm(a, b, offs, config=c).float() - ref.float()).abs().max().item() / scale
            except Exception as e:  # a config that fails here is reported, not timed
                print(f"{case.name} | {c.describe()} | FAILED {str(e).splitlines()[0][:120]}", flush=True)
                continue
            errors[c] = err
            fns[c] = (lambda c=c: grouped_mm(a, b, offs, config=c))
        fns.update(batched_twin(a, b, sizes))
        times = time_side_by_side(fns, reps=60, rounds=6)
        bound = bound_us(flops, n_bytes, ceil)
        print(f"{case.name} | eager {times['eager']:.1f} us ({flops / times['eager'] / 1e6:.0f} TFLOP/s) | "
              f"bound {bound:.1f} us", flush=True)
        for c, err in errors.items():
            t = times[c]
            print(f"    {c.describe():52} {t:9.1f} us {flops / t / 1e6:5.0f} TFLOP/s  x{t / bound:4.2f} bound  "
                  f"eager/ours {times['eager'] / t:5.3f}  relerr {err:.1e}", flush=True)
        for name in ("dense bmm 1x1", "dense bmm 2x1", "torch.bmm"):
            if name in times:
                print(f"    {name:52} {times[name]:9.1f} us {flops / times[name] / 1e6:5.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "quick")
