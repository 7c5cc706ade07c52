"""Cold and warm compile time of a `models` suite case, stock vs enabled, as a user meets them.

Issue 11's goal: each model's cold compile no slower than stock's, and warm (a second process
reusing the first one's caches) within 1.2x of stock's. For each runner, one process compiles
the case's step with empty caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
INDUCTOR_CUTE_CACHE_DIR all new; Inductor's caches at their defaults: FX graph cache and local
autotune cache on): the cold time is the first step's wall time (dynamo, lowering, autotuning,
kernel compiles, one run). A second process then does the same with those caches: the warm time.
The in-process `models` suite cannot time a warm compile: dynamo and Inductor keep state in the
process.

    python3 benchmarks/model_compile_cost.py [--case "llama3-8b decode B8 KV8192 cg"] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import fresh_process

CHILD = r'''
import json, sys, time
from unittest import mock
import torch
from torch._dynamo.utils import counters
from torch._inductor import list_mode_options
from torch._inductor.graph import GraphLowering
from inductor_cute.bench.suites import models
from inductor_cute.bench.suites.gemm_compiled import OUR_BACKENDS, STOCK_BACKENDS

model_name, phase, batch, tokens, mode_key, layers, ours = sys.argv[1:8]
batch, tokens, layers, ours = int(batch), int(tokens), int(layers), ours == "ours"
if ours:
    import inductor_cute
    inductor_cute.enable(**models.enable_kwargs(phase))
backends = OUR_BACKENDS if ours else STOCK_BACKENDS
model = models.build_model(models.MODELS[model_name], layers)
step = {"decode": models.DecodeStep, "prefill": models.PrefillStep}[phase](model, batch, tokens)
options = {**list_mode_options(models.MODES[mode_key]), "max_autotune_gemm_backends": backends}
forward = torch.compile(model.forward, options=options, dynamic=False)
codes = []
torch.cuda.synchronize()
with torch.no_grad(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
    start = time.perf_counter()
    step(forward)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
code = "\n".join(codes)
print("RESULT " + json.dumps({"seconds": seconds, "graphs_lowered": code.count("# AOT ID:"),
                              "our_call_sites": models.our_kernel_calls(code),
                              "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                              "fx_misses": counters["inductor"]["fxgraph_cache_miss"]}))
'''


def parse_case(name: str) -> list[str]:
    """'llama3-8b decode B8 KV8192 cg' -> [model, phase, batch, tokens, mode]."""
    model, phase, batch, size, mode = name.split()
    return [model, phase, batch.lstrip("B"), size.lstrip("KVx"), mode]


def run_child(case: list[str], layers: int, runner: str, root: str, timeout: int) -> dict:
    return fresh_process.run_child(CHILD, [*case, str(layers), runner], root, timeout)


def table(case: str, layers: int, rows: dict) -> str:
    lines = [f"{case}, {layers} decoder layers",
             "| runner | cold s | warm s | graphs lowered cold/warm | our call sites cold/warm | FX cache hits warm |",
             "|---|---|---|---|---|---|"]
    for runner, (cold, warm) in rows.items():
        if "error" in cold or "error" in warm:
            lines.append(f"| {runner} | {cold.get('error', cold.get('seconds'))} | "
                         f"{warm.get('error', warm.get('seconds'))} | | | |")
            continue
        lines.append(f"| {runner} | {cold['seconds']:.1f} | {warm['seconds']:.1f} | "
                     f"{cold['graphs_lowered']}/{warm['graphs_lowered']} | "
                     f"{cold['our_call_sites']}/{warm['our_call_sites']} | {warm['fx_hits']} |")
    if all("error" not in r for pair in rows.values() for r in pair) and {"stock", "ours"} <= rows.keys():
        (cs, ws), (co, wo) = ([r["seconds"] for r in rows[k]] for k in ("stock", "ours"))
        lines.append(f"ours / stock: cold {co / cs:.2f}x, warm {wo / ws:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="llama3-8b decode B8 KV8192 cg")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--timeout", type=int, default=400, help="seconds per process")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    case = parse_case(args.case)
    rows = {}
    for runner in ("stock", "ours"):
        with tempfile.TemporaryDirectory(prefix="model-compile-cost-") as root:
            cold = run_child(case, args.layers, runner, root, args.timeout)
            warm = run_child(case, args.layers, runner, root, args.timeout)
        rows[runner] = (cold, warm)
        print(f"{runner}: cold {cold}, warm {warm}", file=sys.stderr, flush=True)
    print(table(args.case, args.layers, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
