"""Is our grouped GEMM behind Inductor's Triton template on routed groups because of its cluster
shapes' work rounds? The MoE block's three products Triton wins in its training step (Qwen3-30B-A3B
at 4096 tokens, the block's own router): both forward projections and both input gradients
(their weights N-major), and its two weight gradients (ours with and without the whole-tile
store). Side by side in one process, on the same offsets: eager
torch._grouped_mm, Inductor's Triton template (compiled and autotuned now, stock), and ours in
1x1, 1x2, 2x1 and 2x2 clusters (128x256 and 128x128 tiles, overlap_last + staged_partial, with and
without half_tiles), each with
its count of work units and of rounds over the SMs: a 2x1 cluster whose group has an odd number
of row tiles leaves its second CTA computing rows past the group (docs/perf-notes.md, twenty-fifth
session).

    python3 benchmarks/grouped_rounds.py [tokens] [--wgrad] [--ring] [--gate-grad]

--gate-grad: the down projection's input gradient with SwiGLU's backward fused (every config),
against the unfused pair as a compiled training step runs it (our best down input gradient config
and eager's, then Inductor's pointwise kernel of the backward). --wgrad: the weight gradients alone.
--ring: the weight gradients alone at every ring depth
(ping-pong 128x128 and cooperative 128x256), each with its ring's bytes and its time per unit an
SM: if a unit's time is its operand bytes over (ring bytes / a fixed latency), as the twenty-ninth
session's notes propose, time per unit falls in proportion to the ring's bytes.
"""

import dataclasses
import math
import sys

import torch
import torch.nn.functional as F

from inductor_cute.bench.suites import moe_block
from inductor_cute.bench.suites.grouped_gemm import triton_runner
from inductor_cute.bench.timing import time_side_by_side
from inductor_cute.host.grouped_gemm import grouped_mm
from inductor_cute.kernels.common.tile_scheduler import TileScheduler
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates, spec, \
    unsupported_reason
from inductor_cute.runtime import precompile

SHAPES = [(128, 256, 4), (128, 128, 6)]  # (tile_m, tile_n, stages)
CLUSTERS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def work(sizes: list[int], n: int, cfg: GroupedConfig, sms: int) -> tuple[int, int]:
    """(work units, rounds): cluster blocks of tiles per group, dealt to the clusters of one wave."""
    col_blocks = math.ceil(math.ceil(n / cfg.tile_n) / cfg.cluster_n)
    units = sum(math.ceil(math.ceil(rows / cfg.tile_m) / cfg.cluster_m) * col_blocks for rows in sizes if rows)
    return units, math.ceil(units / TileScheduler.max_clusters(True, sms, cfg.cluster_size))


def add_checked(fns: dict, configs: list[GroupedConfig], run, want: torch.Tensor) -> None:
    """A runner per config into `fns` (keyed by its description), each checked once against `want`
    before it is timed: the new options have not all run on a GPU, so a wrong one is named and
    left out instead of stopping the script."""
    for c in configs:
        try:
            torch.testing.assert_close(run(c), want, atol=5e-2, rtol=2e-2)
        except AssertionError as err:
            print(f"    WRONG {c.describe()}: {str(err).splitlines()[0]}")
            continue
        fns[c.describe()] = lambda c=c: run(c)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tokens = int(args[0]) if args else 4096
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), f"T{tokens}")
    block, x = moe_block.make_inputs(tokens, False)
    sizes = moe_block.rows_per_expert(block, x)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    rows = tokens * block.model.topk
    w_up, w_down = block.w_gate_up.detach(), block.w_down.detach()  # (E, 2F, hidden), (E, hidden, F)
    # (name, a's width, the weight as torch._grouped_mm takes it, b_major)
    forms = [("up fwd", w_up.shape[2], w_up.transpose(1, 2), "k"),
             ("up dgrad", w_up.shape[1], w_up, "n"),
             ("down fwd", w_down.shape[2], w_down.transpose(1, 2), "k"),
             ("down dgrad", w_down.shape[1], w_down, "n")]
    print(f"rows per expert: min {min(sizes)} mean {sum(sizes) / len(sizes):.0f} max {max(sizes)}")
    if "--gate-grad" in sys.argv:
        gate_gradient(w_down, offs, rows, sms)
        return
    for name, k, b, b_major in ([] if "--wgrad" in sys.argv or "--ring" in sys.argv else forms):
        n = b.shape[2]
        problem = GroupedProblem("bfloat16", "bfloat16", "k", b_major)
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        configs = [GroupedConfig(tm, tn, 64, stages, 2, cm, cn, overlap_last=True, staged_partial=True, half_tiles=half)
                   for tm, tn, stages in SHAPES for cm, cn in CLUSTERS for half in (False, True)]
        configs = [c for c in configs if unsupported_reason(problem, c, n=n, k=k, groups=len(sizes)) is None]
        precompile([spec(problem, c, sms) for c in configs])
        fns = {"aten": lambda: torch._grouped_mm(a, b, offs=offs)}
        triton, note = triton_runner(a, b, offs)
        if triton is not None:
            fns["triton"] = triton
        add_checked(fns, configs, lambda c: grouped_mm(a, b, offs, out, config=c), fns["aten"]())
        times = time_side_by_side(fns, reps=50)
        print(f"{name}: ({rows}, {k}) x ({len(sizes)}, {k}, {n}), b {b_major}-major; {note}")
        full = dataclasses.replace(configs[0], cluster_m=1, cluster_n=1)
        tiles, triton_rounds = work(sizes, n, dataclasses.replace(full, tile_n=256), sms)
        print(f"    (128x256 tiles: {tiles}, {triton_rounds} rounds of {sms})")
        for key, us in sorted(times.items(), key=lambda kv: kv[1]):
            c = next((c for c in configs if c.describe() == key), None)
            count = "" if c is None else "  units {} rounds {}".format(*work(sizes, n, c, sms))
            print(f"    {us:9.1f} us  {times['aten'] / us:5.2f}x aten{count}  {key}")
    weight_gradients(block, sizes, offs, rows, sms)


def gate_gradient(w_down: torch.Tensor, offs: torch.Tensor, rows: int, sms: int) -> None:
    """The fused op (ops.grouped_mm_gate_grad, every config) against the unfused pair: the product
    (eager's or our 128x256 2x1 config, the down input gradient's best in the twenty-ninth session)
    then Inductor's kernel of SiLU-and-mul's backward, on the same offsets and saved gate and up."""
    from inductor_cute.host.grouped_gemm import grouped_mm_gate_grad

    hidden, ffn = w_down.shape[1], w_down.shape[2]
    grad = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)

    @torch.compile(mode="max-autotune-no-cudagraphs")
    def pointwise(y, gate, up):  # what a training step's backward fuses the SiLU-and-mul gradient into
        return torch.cat([torch.ops.aten.silu_backward(y * up, gate), y * F.silu(gate)], dim=1)

    best = GroupedConfig(128, 256, 64, 4, 2, 2, 1, overlap_last=True, staged_partial=True)
    y_ours = torch.empty(rows, ffn, device="cuda", dtype=torch.bfloat16)
    want = pointwise(torch._grouped_mm(grad, w_down, offs=offs), gate, up)
    problem = GroupedProblem("bfloat16", "bfloat16", "k", "n", gate_grad="silu")
    configs = candidates(problem, rows, ffn, hidden, len(offs), sms, exhaustive=True)
    precompile([spec(problem, c, sms) for c in configs])
    out = torch.empty(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    fns = {"unfused (eager product)": lambda: pointwise(torch._grouped_mm(grad, w_down, offs=offs), gate, up),
           "unfused (ours 2x1 product)": lambda: pointwise(grouped_mm(grad, w_down, offs, y_ours, config=best), gate,
                                                           up),
           "product alone (ours 2x1)": lambda: grouped_mm(grad, w_down, offs, y_ours, config=best)}
    add_checked(fns, configs, lambda c: grouped_mm_gate_grad(grad, w_down, offs, gate, up, out=out, config=c), want)
    times = time_side_by_side(fns, reps=50)
    print(f"gate grad: ({rows}, {hidden}) x ({len(offs)}, {hidden}, {ffn}) -> ({rows}, {2 * ffn})")
    for key, us in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"    {us:9.1f} us  {key}")


def weight_gradients(block, sizes: list[int], offs: torch.Tensor, rows: int, sms: int) -> None:
    """The block's two weight gradients (autograd's layout: grad.t() M-major, x N-major), every
    candidate of ours (clusters, the whole-tile store and ping-pong, also in clusters, included)
    against eager's CUTLASS, on the same offsets: a unit reduces ~256 tokens, so its epilogue and its
    operand loads weigh against its MMAs."""
    from inductor_cute.kernels.gemm import grouped_wgrad_config as wg

    problem = wg.WgradProblem()
    hidden, ffn = block.w_down.shape[1], block.w_down.shape[2]
    for name, m, n in (("up wgrad", 2 * ffn, hidden), ("down wgrad", hidden, ffn)):
        grad = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        a = grad.t()
        out = torch.empty(len(sizes), m, n, device="cuda", dtype=torch.bfloat16)
        # what autotuning weighs, and ping-pong in clusters (not yet offered) beside it
        if "--ring" in sys.argv:  # every depth of the two forms (stages of 32 KB and 48 KB)
            configs = [GroupedConfig(128, 128, 64, st, 2, pingpong=True) for st in range(2, 7)]
            configs += [GroupedConfig(128, 256, 64, st, 2) for st in range(2, 5)]
            configs = [c for c in configs if wg.unsupported_reason(problem, c) is None]
        else:
            configs = wg.candidates(problem, m, n, rows, groups=len(sizes), num_sms=sms, pingpong=True)
            configs += [c for c in wg.candidates(problem, m, n, rows, groups=len(sizes), num_sms=sms, clusters=True,
                                                 pingpong=True) if c.pingpong and c not in configs]
        precompile([wg.spec(problem, c, sms) for c in configs])
        fns = {"aten": lambda: torch._grouped_mm(a, x, offs=offs)}
        add_checked(fns, configs, lambda c: grouped_mm(a, x, offs, out, config=c), fns["aten"]())
        times = time_side_by_side(fns, reps=50)
        units = wg.work_units(m, n, len(sizes), 128, 256)
        print(f"{name}: ({m}, {rows}) x ({rows}, {n}) -> ({len(sizes)}, {m}, {n}); 128x256 units {units}")
        for key, us in sorted(times.items(), key=lambda kv: kv[1]):
            c = next((c for c in configs if c.describe() == key), None)
            per_unit = ""
            if c is not None:  # ring bytes, and us a unit on each SM (units dealt evenly)
                ring_kb = (c.tile_m + c.tile_n) * c.tile_k * 2 * c.stages // 1024
                per_sm = wg.work_units(m, n, len(sizes), c.tile_m, c.tile_n) / sms
                per_unit = f"  ring {ring_kb} KB, {us / per_sm:.2f} us a unit"
            print(f"    {us:9.1f} us  {times['aten'] / us:5.2f}x aten  {key}{per_unit}")


if __name__ == "__main__":
    main()
