"""Does fusing the MoE permute's row gather into the grouped GEMM's A loads pay? The MoE block's up
projection (Qwen3-30B-A3B: tokens x (T, 2048), each token's 8 routed rows sorted by expert, weights
(128, 2048, 1536) gate | up), at the block's own seeded routing, timed side by side:

  aten gather + mm         torch._grouped_mm(x[rows], w, offs)            (what stock runs: two kernels)
  ours gather + mm <cfg>   x[rows], then our grouped GEMM
  ours gathered <cfg>      our grouped GEMM reading x's rows through `rows` (no (T*8, 2048) copy)

and the same three for the gated form (silu(gate) * up in the epilogue; aten: the unfused
computation). The floor of what the fusion saves: the gather writes and reads back T*8*2048*2
bytes (134 MB at T=4096: ~40 us each way at ~3.4 TB/s on the H200).

    python3 benchmarks/grouped_gather.py
"""

import dataclasses

import torch
import torch.nn.functional as F

from inductor_cute.bench.suites import moe_block
from inductor_cute.bench.timing import time_side_by_side
from inductor_cute.host.grouped_gemm import grouped_mm, grouped_mm_gated
from inductor_cute.kernels.gemm.grouped_config import GroupedProblem, candidates, spec
from inductor_cute.runtime import precompile


def configs(problem: GroupedProblem, rows: int, n: int, k: int, sms: int) -> list:
    """Every candidate shape plain and with overlap_last + staged_partial (whatever the flags offer)."""
    base = list(dict.fromkeys(dataclasses.replace(c, overlap_last=False, staged_partial=False)
                              for c in candidates(problem, rows, n, k, 128, sms)))
    return base + [dataclasses.replace(c, overlap_last=True, staged_partial=True) for c in base]


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0))
    for tokens in (4096, 16384):
        block, x = moe_block.make_inputs(tokens, False)
        with torch.no_grad():
            _, experts = block.route(x)
            flat = experts.flatten()
            order = torch.argsort(flat, stable=True)
            offs = moe_block.expert_offsets(flat, block.model.experts)
        rows = order // block.top_k  # int64, as the block computes it
        b = block.w_gate_up.detach().transpose(1, 2)
        n_rows, k, n = rows.numel(), b.shape[1], b.shape[2]
        for gated in (False, True):
            problem = GroupedProblem("bfloat16", "bfloat16", "k", "k", "silu" if gated else "")
            gathered = dataclasses.replace(problem, rows="int64")
            plain_cfgs, gathered_cfgs = configs(problem, n_rows, n, k, sms), configs(gathered, n_rows, n, k, sms)
            precompile([spec(problem, c, sms) for c in plain_cfgs] + [spec(gathered, c, sms) for c in gathered_cfgs])
            out = torch.empty(n_rows, n // 2 if gated else n, device="cuda", dtype=torch.bfloat16)
            if gated:
                def aten():
                    g, u = torch._grouped_mm(x[rows], b, offs=offs).chunk(2, dim=-1)
                    return F.silu(g) * u
                fns = {"aten gather + mm + gate": aten}
                for c in plain_cfgs:
                    fns[f"ours gather + mm {c.describe()}"] = (
                        lambda c=c: grouped_mm_gated(x[rows], b, offs, "silu", out, config=c))
                for c in gathered_cfgs:
                    fns[f"ours gathered {c.describe()}"] = (
                        lambda c=c: grouped_mm_gated(x, b, offs, "silu", out, config=c, rows=rows))
            else:
                fns = {"aten gather + mm": lambda: torch._grouped_mm(x[rows], b, offs=offs)}
                for c in plain_cfgs:
                    fns[f"ours gather + mm {c.describe()}"] = (
                        lambda c=c: grouped_mm(x[rows], b, offs, out, config=c))
                for c in gathered_cfgs:
                    fns[f"ours gathered {c.describe()}"] = (lambda c=c: grouped_mm(x, b, offs, out, config=c, rows=rows))
            times = time_side_by_side(fns, reps=50)
            base = next(iter(fns))
            print(f"T{tokens} up{' gated' if gated else ''} ({n_rows} rows; {moe_block.routing_note(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())}):")
            for key, us in sorted(times.items(), key=lambda kv: kv[1]):
                print(f"    {us:9.1f} us  {times[base] / us:5.2f}x aten  {key}")
        gather_only = time_side_by_side({"x[rows]": lambda: x[rows]}, reps=50)["x[rows]"]
        print(f"T{tokens} the gather alone: {gather_only:.1f} us")


if __name__ == "__main__":
    main()
