"""Processes sharing one cache: one compile per kernel, no torn entries; parallel precompile."""

import json
import os
import subprocess
import sys
import time

from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import CompiledKernelCache, KernelSpec, precompile
from inductor_cute.runtime.loader import kernel_key

WORKER = r"""
import json, os, sys, time
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import get_kernel, stats
from inductor_cute.runtime.dsl import import_cute
import_cute("sm_90a")  # pay the DSL import before the start line, so compiles overlap
spec = rmsnorm_spec(1536, "bfloat16")
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
get_kernel(spec, "sm_90a")
print(json.dumps(dict(stats)))
"""


def test_four_processes_compile_one_kernel_once(tmp_path):
    env = {**os.environ, "INDUCTOR_CUTE_CACHE_DIR": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(go)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r.get("compiles", 0) for r in results) == 1
    assert sum(r.get("disk_hits", 0) for r in results) == 3
    cache = CompiledKernelCache(tmp_path / "cache")
    kinds = sorted(e.kind for e in cache.entries())
    assert kinds == ["library", "object"]  # complete and checksummed: no "damaged"
    assert not list((tmp_path / "cache" / "objects").glob("*/.tmp-*"))


def test_precompile_runs_in_worker_processes_then_hits(tmp_path):
    cache = CompiledKernelCache(tmp_path / "pool-cache")
    specs = [rmsnorm_spec(n, "float16") for n in (256, 3072)]
    bad = KernelSpec(specs[0].module, tuple((k, "int7" if k == "dtype_name" else v) for k, v in specs[0].params))
    first = precompile(specs + [bad], arch="sm_90a", cache=cache, workers=2)
    assert [r.status for r in first] == ["compiled", "compiled", "failed"]
    assert "int7" in first[2].error or "failed" in first[2].error
    assert all(cache.read(kernel_key(s, "sm_90a")) for s in specs)
    start = time.perf_counter()
    second = precompile(specs, arch="sm_90a", cache=cache)
    assert [r.status for r in second] == ["cached", "cached"]
    assert time.perf_counter() - start < 1.0


def test_the_shared_pool_outlives_one_precompile(tmp_path):
    from inductor_cute.runtime import pool

    cache = CompiledKernelCache(tmp_path / "shared-pool-cache")
    first = precompile([rmsnorm_spec(512, "bfloat16")], arch="sm_90a", cache=cache)
    shared = pool._shared_pool
    second = precompile([rmsnorm_spec(1024, "bfloat16")], arch="sm_90a", cache=cache)
    assert [r.status for r in first + second] == ["compiled", "compiled"]
    assert shared is not None and pool._shared_pool is shared  # no second spawn
