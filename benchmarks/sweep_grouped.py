"""Time every grouped GEMM config (clusters included) side by side with eager torch._grouped_mm on
the forward cases of the grouped_gemm suite (H200): which configs the autotuner should be offered,
and whether the 2-CTA clusters (multicast of the weight or token tile) pay off.

    python3 benchmarks/sweep_grouped.py [quick|all]

One line per (case, config): device time (L2 flushed, runs interleaved with eager's), TFLOP/s,
time over the matmul bound at this run's ceiling, and the largest error against eager relative
to its largest value. See docs/perf-notes.md (grouped GEMM clusters).
"""

import sys

import torch

from inductor_cute.bench.suites.grouped_gemm import MODELS, Grouped, cost, group_sizes, make_inputs
from inductor_cute.bench.timing import bound_us, measure_ceilings, time_side_by_side
from inductor_cute.host.grouped_gemm import grouped_mm
from inductor_cute.kernels.gemm.grouped_config import GroupedProblem, candidates, spec
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


def configs_of(case, sizes):
    n, k = case.n_k
    return candidates(PROBLEM, case.rows, n, k, len(sizes), torch.cuda.get_device_properties(0).multi_processor_count,
                      clusters=True)


def main(which: str) -> None:
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
        times = time_side_by_side(fns, reps=60, rounds=6)
        bound = bound_us(flops, n_bytes, ceil)
        print(f"{case.name} | eager {times['eager']:.1f} us ({flops / times['eager'] / 1e6:.0f} TFLOP/s) | "
              f"bound {bound:.1f} us", flush=True)
        for c, err in errors.items():
            t = times[c]
            print(f"    {c.describe():40} {t:9.1f} us {flops / t / 1e6:5.0f} TFLOP/s  x{t / bound:4.2f} bound  "
                  f"eager/ours {times['eager'] / t:5.3f}  relerr {err:.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "quick")
