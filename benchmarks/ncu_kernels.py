"""One launch of one of our kernels inside a profiler range, for Nsight Compute: where the time goes
when the timings alone do not say (the vit d64 prefill's per-tile cost, the dq_reduce backward's
loss to the plain schedule; the MoE block's grouped GEMMs: L2 reads, the epilogue or the tensor
cores, docs/perf-notes.md, twenty-eighth session).

    ncu --clock-control none --profile-from-start off --section ... python3 benchmarks/ncu_kernels.py CASE
    bash benchmarks/gpu_checks.sh ncu       (every attention case; one report per case in $OUT/ncu-<case>.txt)
    bash benchmarks/gpu_checks.sh ncu_grouped   (the grouped GEMM cases)

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


def _moe_block_offsets():
    """The MoE block's routing at 4096 tokens (Qwen3-30B-A3B shapes): offsets and routed rows."""
    from inductor_cute.bench.suites import moe_block

    block, x = moe_block.make_inputs(4096, False)
    sizes = moe_block.rows_per_expert(block, x)
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32), 4096 * block.model.topk, len(sizes)


def grouped_wgrad(config):
    """The up projection's weight gradient, autograd's layout: (1536, rows) x (rows, 2048) per expert."""
    from inductor_cute.host.grouped_gemm import grouped_mm

    offs, rows, groups = _moe_block_offsets()
    grad = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(groups, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    return lambda: grouped_mm(grad.t(), x, offs, out, config=config)


def grouped_up(config):
    """The up projection's forward: (rows, 2048) x (experts, 2048, 1536), the weight K-major."""
    from inductor_cute.host.grouped_gemm import grouped_mm

    offs, rows, groups = _moe_block_offsets()
    a = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, 1536, device="cuda", dtype=torch.bfloat16)
    return lambda: grouped_mm(a, w.transpose(1, 2), offs, out, config=config)


def _grouped(tm, tn, stages, cm=1, cn=1, **kw):
    from inductor_cute.kernels.gemm.grouped_config import GroupedConfig

    return GroupedConfig(tm, tn, 64, stages, 2, cm, cn, **kw)


CASES = {
    "prefill_vit": lambda: prefill(32, 16, 16, 1024, (64, 64), False),  # issue 13's d64 case
    "prefill_llama": lambda: prefill(4, 32, 8, 4096, (128, 128), True),
    "prefill_mla": lambda: prefill(1, 128, 128, 4096, (192, 128), True),
    "backward_plain": lambda: backward(1, 16, 16, 8192, (128, 128), False, False),
    "backward_dq_reduce": lambda: backward(1, 16, 16, 8192, (128, 128), False, True),
    "wgrad_pingpong": lambda: grouped_wgrad(_grouped(128, 128, 6, pingpong=True)),
    "wgrad_pingpong_2x2": lambda: grouped_wgrad(_grouped(128, 128, 6, 2, 2, pingpong=True)),
    "wgrad_128x256": lambda: grouped_wgrad(_grouped(128, 256, 4)),
    "up_1x2_half": lambda: grouped_up(_grouped(128, 256, 4, 1, 2, overlap_last=True, staged_partial=True,
                                               half_tiles=True)),
    "up_2x2_half": lambda: grouped_up(_grouped(128, 256, 4, 2, 2, overlap_last=True, staged_partial=True,
                                               half_tiles=True)),
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
