"""A child Python process with its own compile caches under one root folder (Inductor's, Triton's
and ours), whose last `RESULT <json>` line is its result: how autotune_cost.py and
model_compile_cost.py time cold compiles (an empty root) and warm ones (the same root again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_child(code: str, args: list[str], root: str, timeout: int) -> dict:
    """Run `python -c code *args` with its caches under `root` (Inductor's FX-graph and local
    autotune caches on, as by default); the dict of its RESULT line, or {"error": why}."""
    env = {key: v for key, v in os.environ.items() if key != "TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"), TRITON_CACHE_DIR=os.path.join(root, "triton"),
               INDUCTOR_CUTE_CACHE_DIR=os.path.join(root, "cute"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOTUNE_LOCAL_CACHE="1")
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
