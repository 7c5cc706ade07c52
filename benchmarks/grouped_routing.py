"""Does a grouped GEMM config's time under Inductor's autotuning offsets (an even split: every
group the same, a multiple of 8 rows) predict its time under the routing a model produces? The MoE
block's two grouped GEMMs (Qwen3-30B-A3B: up (T*8, 2048) x (128, 2048, 1536), down (T*8, 768) x
(128, 768, 2048)), each config of ours and eager torch._grouped_mm, timed side by side on:

  even      what torch's create_offsets gives autotuning (mm_grouped.py)
  spread    group sizes drawn from a seeded uniform multinomial (a balanced router's spread)
  block     the MoE block's own seeded router (moe_block.py), as its models-suite case runs

    python3 benchmarks/grouped_routing.py

Every config shape is timed as it was and with overlap_last (a group's last row tile moved back to
end at the group's last row and stored whole by TMA, instead of per-element predicated stores) and
staged_partial (the partial tiles left through the staging buffer in 16-byte pieces); the default
shape also with each of the two alone.
Device time in us per (case, offsets, config); see docs/perf-notes.md (MoE block).
"""

import dataclasses

import torch

from inductor_cute.bench.suites import moe_block
from inductor_cute.bench.timing import time_side_by_side
from inductor_cute.host.grouped_gemm import grouped_mm
from inductor_cute.kernels.gemm.grouped_config import GroupedProblem, candidates, spec
from inductor_cute.runtime import precompile

PROBLEM = GroupedProblem("bfloat16", "bfloat16", "k", "k")  # nn.Linear-held weights, transposed views


def offsets_of(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)


def even_sizes(rows: int, groups: int) -> list[int]:
    ends = [round(rows * (g + 1) / groups / 8) * 8 for g in range(groups - 1)] + [rows]
    return [e - s for s, e in zip([0, *ends], ends)]


def spread_sizes(rows: int, groups: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(groups, (rows,), generator=gen)
    return torch.bincount(picks, minlength=groups).tolist()


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0))
    for tokens in (1024, 4096, 16384):  # 1024: 64 rows per group, every tile partial (staged_partial's case)
        block, x = moe_block.make_inputs(tokens, False)
        routing = {"even": even_sizes(tokens * 8, 128), "spread": spread_sizes(tokens * 8, 128),
                   "block": moe_block.rows_per_expert(block, x)}
        for form, k, n, weight in (("up", 2048, 1536, block.w_gate_up), ("down", 768, 2048, block.w_down)):
            b = weight.detach().transpose(1, 2)
            a = torch.randn(tokens * 8, k, device="cuda", dtype=torch.bfloat16)
            # every shape as it was, and with overlap_last + staged_partial; the first (the default)
            # also with each alone, whatever the GPU_CHECKED flags offer
            base = list(dict.fromkeys(dataclasses.replace(c, overlap_last=False, staged_partial=False)
                                      for c in candidates(PROBLEM, tokens * 8, n, k, 128, sms)))
            both = [dataclasses.replace(c, overlap_last=True, staged_partial=True) for c in base]
            alone = [dataclasses.replace(base[0], overlap_last=True), dataclasses.replace(base[0], staged_partial=True)]
            configs = base + both + alone
            precompile([spec(PROBLEM, c, sms) for c in configs])
            for name, sizes in routing.items():
                offs = offsets_of(sizes)
                out = torch.empty(tokens * 8, n, device="cuda", dtype=torch.bfloat16)
                fns = {"aten": lambda: torch._grouped_mm(a, b, offs=offs)}
                for c in configs:
                    fns[c.describe()] = (lambda c=c: grouped_mm(a, b, offs, out, config=c))
                times = time_side_by_side(fns, reps=50)
                print(f"T{tokens} {form} {name} (rows min {min(sizes)} max {max(sizes)}):")
                for key, us in sorted(times.items(), key=lambda kv: kv[1]):
                    print(f"    {us:9.1f} us  {times['aten'] / us:5.2f}x aten  {key}")


if __name__ == "__main__":
    main()
