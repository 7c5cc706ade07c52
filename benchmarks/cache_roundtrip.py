"""Compile once, start warm elsewhere (issue 16), measured on a GPU machine.

Three fresh processes compile the same model (an MLP block, max-autotune-no-cudagraphs, inductor-cute
enabled) and time their first call:
  cold       empty Inductor and inductor-cute caches; saves torch's cache artifacts afterwards
  artifacts  empty caches again, then torch.compiler.load_cache_artifacts(what cold saved)
  local      the cold process's own cache directories (a second run on the same machine)
Each prints its first-call seconds, how many of our kernels it compiled and how many it found on
disk, and whether its output matches the cold run's. Usage: python3 benchmarks/cache_roundtrip.py
"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import torch
import inductor_cute
from inductor_cute.runtime import stats

mode, artifacts = sys.argv[1], sys.argv[2]
if mode == "artifacts":
    info = torch.compiler.load_cache_artifacts(open(artifacts, "rb").read())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False), torch.nn.SiLU(),
                            torch.nn.Linear(14336, 4096, bias=False)).cuda().to(torch.bfloat16).eval()
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
inductor_cute.enable()
compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")
start = time.perf_counter()
with torch.no_grad():
    out = compiled(x)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
if mode == "cold":
    data, info = torch.compiler.save_cache_artifacts()
    open(artifacts, "wb").write(data)
torch.save(out.cpu(), artifacts + f".{mode}.pt")
print(json.dumps({"mode": mode, "first_call_s": round(seconds, 2), "our_stats": dict(stats)}))
"""


def run(mode: str, artifacts: str, caches: dict) -> dict:
    env = {**os.environ, **caches}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, artifacts], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    root = tempfile.mkdtemp(prefix="icute-roundtrip-")
    artifacts = os.path.join(root, "artifacts.bin")

    def caches(name):
        return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, name, "inductor"),
                "INDUCTOR_CUTE_CACHE_DIR": os.path.join(root, name, "icute")}

    results = [run("cold", artifacts, caches("a")), run("artifacts", artifacts, caches("b")),
               run("local", artifacts, caches("a"))]
    ref = torch.load(artifacts + ".cold.pt")
    for r in results:
        r["matches_cold"] = bool(torch.equal(torch.load(artifacts + f".{r['mode']}.pt"), ref))
        print(json.dumps(r))
    print(f"artifacts bundle {os.path.getsize(artifacts) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
