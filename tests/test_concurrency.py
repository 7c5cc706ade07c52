"""Processes sharing one cache: one compile per kernel, no torn entries; parallel precompile; many
processes on one host (torchrun ranks) compile each kernel once and share the host's compile slots."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


FLEET_RANK = r"""
import json, os, sys, time
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import pool, precompile, stats
rank = int(sys.argv[2])
specs = [rmsnorm_spec(n, "bfloat16") for n in (192, 320, 448)]
specs = specs[rank % 3:] + specs[:rank % 3]  # every kernel is some rank's first: all start at once
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
results = precompile(specs, arch="sm_90a")
print(json.dumps({"stats": dict(stats), "statuses": [r.status for r in results],
                  "errors": [r.error for r in results if r.error],
                  "workers": len(pool.shared_pool("sm_90a").pids())}))
"""


def test_fleet_of_8_processes_compiles_each_kernel_once_within_the_host_slots(tmp_path):
    slots = 2
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "INDUCTOR_CUTE_CACHE_DIR": str(tmp_path / "cache"), "INDUCTOR_CUTE_ARCH": "sm_90a",
           "INDUCTOR_CUTE_COMPILE_SLOTS": str(slots), "INDUCTOR_CUTE_COMPILE_SLOTS_DIR": str(tmp_path / "slots"),
           "INDUCTOR_CUTE_COMPILE_WORKERS": "2"}
    go = tmp_path / "go"
    fleet = [subprocess.Popen([sys.executable, "-c", FLEET_RANK, str(go), str(rank)], env=env, stdout=subprocess.PIPE,
                              text=True) for rank in range(8)]
    for p in fleet:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    reports = []
    for p in fleet:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["statuses"] and "failed" not in r["statuses"] for r in reports), [r["errors"] for r in reports]
    assert sum(r["stats"].get("worker_compiled", 0) for r in reports) == 3  # each kernel once, host-wide
    assert sum(r["stats"].get("compiles", 0) for r in reports) == 0  # the ranks themselves only load
    assert all(0 < r["workers"] <= 2 for r in reports)
    headers = [e.header for e in CompiledKernelCache(tmp_path / "cache").entries()]
    assert len(headers) == 3 and all(h["compile_slot"] in range(slots) for h in headers)
    # No more compiles at once than slots: count overlaps of the recorded compile intervals.
    events = sorted([(h["compiled_between"][0], 1) for h in headers]
                    + [(h["compiled_between"][1], -1) for h in headers])
    running = peak = 0
    for _, step in events:  # at equal times the end (-1) sorts first
        running += step
        peak = max(peak, running)
    assert 1 <= peak <= slots
