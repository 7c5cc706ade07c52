"""What torch.compile(mode="max-autotune") costs per GEMM shape, stock vs with inductor-cute.

For each shape, each variant compiles `F.linear(a, w)` (bf16, w an (N, K) weight) in a fresh
process with empty caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, INDUCTOR_CUTE_CACHE_DIR all
new): the cold cost, lowering + autotuning + kernel compiles + one run. A second process then
compiles the same thing reusing those caches: the warm cost (FX-graph cache on, as by default).
Variants: stock = ATEN,TRITON; ours = ATEN,ICUTE (inductor_cute.enable()); --with-triton adds
ours+triton = ATEN,TRITON,ICUTE. "ours s" is the time spent in our code during the compile:
precompiling our candidate kernels and loading them into the process.
Goals (issue 4): cold ours no slower than cold stock; warm ours < 1 s in our code.

    python3 benchmarks/autotune_cost.py [--shapes 4096x14336x4096,16x4096x4096] [--with-triton] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import fresh_process

SHAPES = [(4096, 14336, 4096), (128, 14336, 4096), (16, 4096, 4096)]
VARIANTS = {"stock": "ATEN,TRITON", "ours": "ATEN,ICUTE"}
OUR_CALL = "inductor_cute.inductor.gemm.runtime.gemm("

CHILD = r'''
import json, sys, time
from unittest import mock
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.graph import GraphLowering

m, n, k, backends = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ours = "ICUTE" in backends
timers = {"precompile": 0.0, "load": 0.0}
kernels_before = None
if ours:
    import inductor_cute
    from inductor_cute.inductor.gemm import specs
    from inductor_cute.runtime import CompiledKernelCache, loader

    def timed(module, name, key):
        fn = getattr(module, name, None)
        if fn is None:
            return
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[key] += time.perf_counter() - start
        setattr(module, name, wrapper)

    timed(specs, "precompile_choices", "precompile")
    timed(loader, "_load_or_recompile", "load")
    kernels_before = len(CompiledKernelCache().entries())
    inductor_cute.enable()
torch._inductor.config.max_autotune_gemm_backends = backends
torch.manual_seed(0)
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
torch.cuda.synchronize()
codes = []

def linear(a, w):
    return F.linear(a, w)

fn = torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False)
with torch.no_grad(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
    start = time.perf_counter()
    out = fn(a, w)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
ref = F.linear(a.float(), w.float())
code = "\n".join(codes)
if not code:
    winner = "cached graph"
elif "inductor_cute.inductor.gemm.runtime.gemm(" in code:
    winner = "ours"
elif "extern_kernels." in code:
    winner = "aten"
else:
    winner = "triton"
result = {"seconds": seconds, "winner": winner, "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
          "err": ((out.float() - ref).norm() / ref.norm()).item(),
          "ours_s": timers["precompile"] + timers["load"] if ours else None,
          "precompile_s": timers["precompile"] if ours else None, "load_s": timers["load"] if ours else None}
if ours:
    result["kernels_compiled"] = len(CompiledKernelCache().entries()) - kernels_before
print("RESULT " + json.dumps(result))
'''


def run_child(m: int, n: int, k: int, backends: str, root: str, timeout: int) -> dict:
    return fresh_process.run_child(CHILD, [str(m), str(n), str(k), backends], root, timeout)


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| shape (MxNxK) | variant | cold s | warm s | warm ours s | cold ours s | winner | kernels compiled cold/warm | rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        if "error" in cold or "error" in warm:
            lines.append(f"| {r['shape']} | {r['variant']} | {cold.get('error', _s(cold.get('seconds')))} | "
                         f"{warm.get('error', _s(warm.get('seconds')))} | | | | | |")
            continue
        kernels = (f"{cold['kernels_compiled']}/{warm['kernels_compiled']}" if cold.get("kernels_compiled") is not None
                   else "-")
        lines.append(f"| {r['shape']} | {r['variant']} | {_s(cold['seconds'])} | {_s(warm['seconds'])} | "
                     f"{_s(warm['ours_s'])} | {_s(cold['ours_s'])} | {cold['winner']} | {kernels} | {cold['err']:.1e} |")
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="comma-separated MxNxK")
    p.add_argument("--with-triton", action="store_true", help="also time ours+triton (ATEN,TRITON,ICUTE)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per process")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    variants = dict(VARIANTS, **({"ours+triton": "ATEN,TRITON,ICUTE"} if args.with_triton else {}))
    rows = []
    for m, n, k in args.shapes:
        for variant, backends in variants.items():
            with tempfile.TemporaryDirectory(prefix="autotune-cost-") as root:
                cold = run_child(m, n, k, backends, root, args.timeout)
                warm = run_child(m, n, k, backends, root, args.timeout)
            rows.append({"shape": f"{m}x{n}x{k}", "variant": variant, "backends": backends, "cold": cold, "warm": warm})
            print(f"{m}x{n}x{k} {variant}: cold {cold.get('seconds', cold.get('error'))}, "
                  f"warm {warm.get('seconds', warm.get('error'))}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
