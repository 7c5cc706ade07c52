"""One launch of one of our attention kernels inside a profiler range, for Nsight Compute: where the
prefill's and the backward's time goes when the timings alone do not say (the vit d64 prefill's
per-tile cost, the dq_reduce backward's loss to the plain schedule).

    ncu --clock-control none --profile-from-start off --section ... python3 benchmarks/ncu_kernels.py CASE
    bash benchmarks/gpu_checks.sh ncu       (every case; one report per case in $OUT/ncu-<case>.txt)

Each case builds its inputs, runs the kernel twice outside the range (compile, warm caches), then
once between cudaProfilerStart and cudaProfilerStop: ncu (--profile-from-start off) profiles the
launches in the range only, and the memsets and copies a host call makes there are few and short.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from inductor_cute.host.flex_backward import flex_attention_backward
from inductor_cute.host.flex_prefill import flex_prefill
from inductor_cute.kernels.attention import flex_backward_config as fbc

from flex_backward_speed import CAUSAL, LISTS, causal_block_mask  # (benchmarks/ is the script's path)


def _inputs(b, hq, hkv, s, d, dv):
    q, k = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv))
    return q, k, torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16)


def _causal_kwargs(s, backward=False):
    return causal_block_mask(s, LISTS if backward else LISTS[:4])[1]


def prefill(b, hq, hkv, s, dims, causal):
    q, k, v = _inputs(b, hq, hkv, s, *dims)
    kwargs = _causal_kwargs(s) if causal else {}
    return lambda: flex_prefill(q, k, v, **kwargs)


def backward(b, hq, hkv, s, dims, causal, dq_reduce):
    q, k, v = _inputs(b, hq, hkv, s, *dims)
    kwargs = _causal_kwargs(s, backward=True) if causal else {}
    forward = {n: a for n, a in kwargs.items() if not n.startswith(("q_", "full_q_"))}
    out, lse = flex_prefill(q, k, v, return_lse=True, **forward)
    problem = fbc.FlexBackwardProblem(dims[0], dims[1], "bfloat16", CAUSAL if causal else "", (), 128 if causal else 0)
    config = fbc.default_config(problem, dq_reduce=dq_reduce)
    grad_out = torch.randn_like(out)
    print(f"backward config: {dataclasses.asdict(config)}", flush=True)
    return lambda: flex_attention_backward(q, k, v, out, lse, grad_out, config=config, **kwargs)


CASES = {
    "prefill_vit": lambda: prefill(32, 16, 16, 1024, (64, 64), False),  # issue 13's d64 case
    "prefill_llama": lambda: prefill(4, 32, 8, 4096, (128, 128), True),
    "prefill_mla": lambda: prefill(1, 128, 128, 4096, (192, 128), True),
    "backward_plain": lambda: backward(1, 16, 16, 8192, (128, 128), False, False),
    "backward_dq_reduce": lambda: backward(1, 16, 16, 8192, (128, 128), False, True),
}


def main():
    case = sys.argv[1] if len(sys.argv) > 1 else ""
    if case not in CASES:
        raise SystemExit(f"usage: ncu_kernels.py {{{','.join(CASES)}}}")
    fn = CASES[case]()
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{case}: profiled one call", flush=True)


if __name__ == "__main__":
    main()
