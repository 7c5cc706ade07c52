"""Our decode attention at the `models` suite's Llama-3.1-8B decode shapes, KV split count swept,
beside stock flex_attention as a model calls it (H200).

    python3 benchmarks/sweep_flex_splits.py [--shapes B1:32768,B8:8192,B32:4096]

Hq 32, Hkv 8, d128, bf16, one query token per sequence. Each line is one runner: ops.flex_decode
with `num_splits` (the run-time heuristic's pick marked), then stock flex_attention compiled with
the causal-cache BlockMask a transformers model passes (the flex_decode suite's `triton` runner:
the faster of default and max-autotune-no-cudagraphs). Two timings per runner, us per call:
  graph  calls after an L2 read flush inside a CUDA graph, less the flushes alone (how autotuning
         times a choice with enable(); within 12% of the time inside a model step on the H200)
  events the benchmark harness's device time (CUDA events, cold L2)
and the HBM floor (K + V bytes at the copy bandwidth measured in this run). Issue 11: stock's
attention in the compiled model took 49 us (B1 KV32768), 95 (B8 KV8192) and 185 (B32 KV4096)
per layer; this says what ours takes there and which split count gets it.
"""

from __future__ import annotations

import argparse
import functools

import torch

from inductor_cute import ops
from inductor_cute.bench.suites import flex_decode as suite
from inductor_cute.bench.timing import measure_ceilings, time_us
from inductor_cute.kernels.attention import flex_decode_config as fdc

HQ, HKV, D = 32, 8, 128
SPLITS = (1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128)


def graph_us(fn) -> float:
    from inductor_cute.inductor.choice_timing import graph_time_ms

    with torch.cuda.stream(torch.cuda.Stream()):  # as autotuning calls it, on a side stream
        return graph_time_ms(fn, lambda f: float("nan")) * 1e3


def sweep(batch: int, kv: int, tbps: float) -> list[str]:
    shape = suite.Shape(batch, HQ, HKV, D, D, kv)
    q, k, v = suite.make_inputs(shape)
    scale = D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_block = fdc.HEAD_DIMS[(D, D)][0]
    blocks = -(-kv // kv_block)
    pick = fdc.num_splits(batch, HKV, fdc.m_tiles(HQ // HKV, 1), kv, kv_block, sms)
    floor = 2 * batch * HKV * kv * D * q.element_size() / (tbps * 1e6)
    lines = [f"-- {shape.label} (floor {floor:.1f} us at {tbps:.2f} TB/s; {blocks} KV blocks, "
             f"{batch * HKV} (batch, KV head) pairs, {sms} SMs)", f"{'graph':>8} {'events':>8}  runner"]
    ref = suite.aten_runner(shape, "plain", q, k, v, scale)().float()
    for s in sorted({pick, *(s for s in SPLITS if s <= blocks)}):
        fn = functools.partial(ops.flex_decode, q, k, v, scale=scale, num_splits=s)
        try:
            err = (fn().float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a split count the kernel refuses is reported, not fatal
            lines.append(f"{'-':>8} {'-':>8}  ours, {s} splits: {e}")
            continue
        mark = "  heuristic" if s == pick else ""
        lines.append(f"{graph_us(fn):8.1f} {time_us(fn):8.1f}  ours, {s} splits ({batch * HKV * s} CTAs), "
                     f"max err {err:.1e}{mark}")
    torch._dynamo.reset()
    stock, notes = suite.stock_runners(q, k, v, scale, suite.flex_mods(shape, "plain", model_mask=True), None)
    fn = stock["triton"]
    lines.append(f"{graph_us(fn):8.1f} {time_us(fn):8.1f}  stock flex_attention with the model's BlockMask "
                 f"({notes[0]})")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B1:32768,B8:8192,B32:4096", help="B<batch>:<KV length>, comma-separated")
    args = p.parse_args()
    tbps = measure_ceilings()["copy_TBps"]
    for item in args.shapes.split(","):
        b, kv = item.split(":")
        print("\n".join(sweep(int(b.lstrip("B")), int(kv), tbps)), flush=True)


if __name__ == "__main__":
    main()
