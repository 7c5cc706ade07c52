"""Compile workers: our own entry point (never the user's __main__), kept for the process,
restarted when they die, stopped when a compile hangs; worker counts bounded by cores and memory."""

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import CompiledKernelCache, KernelSpec, host_limits, precompile
from inductor_cute.runtime.loader import kernel_key

PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])

UNGUARDED_SCRIPT = """
print("top-level line of the user's script", flush=True)
import json
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import precompile
results = precompile([rmsnorm_spec(n, "bfloat16") for n in (128, 640)])
print(json.dumps([r.status for r in results]))
"""


def test_a_script_without_main_guard_runs_its_top_level_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "PYTHONPATH": PACKAGE_PARENT, "CUTE_DSL_ARCH": "sm_90a", "INDUCTOR_CUTE_ARCH": "sm_90a",
           "INDUCTOR_CUTE_CACHE_DIR": str(tmp_path / "cache"),
           "INDUCTOR_CUTE_COMPILE_SLOTS_DIR": str(tmp_path / "slots")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines.count("top-level line of the user's script") == 1, done.stdout
    assert json.loads(lines[-1]) == ["compiled", "compiled"]
    cache = CompiledKernelCache(tmp_path / "cache")
    assert all(cache.read(kernel_key(rmsnorm_spec(n, "bfloat16"), "sm_90a")) for n in (128, 640))


def test_the_shared_pool_outlives_one_precompile_and_replaces_dead_workers(tmp_path):
    from inductor_cute.runtime import pool

    cache = CompiledKernelCache(tmp_path / "shared-pool-cache")
    first = precompile([rmsnorm_spec(512, "bfloat16")], arch="sm_90a", cache=cache)
    workers = pool.shared_pool("sm_90a").pids()
    second = precompile([rmsnorm_spec(1024, "bfloat16")], arch="sm_90a", cache=cache)
    assert [r.status for r in first + second] == ["compiled", "compiled"]
    assert workers and pool.shared_pool("sm_90a").pids() == workers  # the same processes: no second start
    for pid in workers:  # a worker runs our entry point, not a copy of this process
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"inductor_cute.runtime.worker" in cmdline
    # A worker that dies while idle (the OOM killer, say) is replaced when there is work again.
    for w in pool.shared_pool("sm_90a").workers:
        w.process.kill()
        w.process.wait()
    third = precompile([rmsnorm_spec(1536, "float32")], arch="sm_90a", cache=cache)
    assert third[0].status == "compiled", third[0].error
    assert not set(pool.shared_pool("sm_90a").pids()) & set(workers)


FAKE_BUILDER = """
import os, time

def build(mode):
    if mode == "crash":
        os._exit(3)
    time.sleep(3600)
"""


def test_a_dead_or_hung_worker_fails_its_kernel_only_and_frees_its_slot(tmp_path, monkeypatch):
    module = "fake_builder_for_worker_tests"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(FAKE_BUILDER))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("INDUCTOR_CUTE_COMPILE_TIMEOUT", "3")
    monkeypatch.setenv("INDUCTOR_CUTE_COMPILE_SLOTS", "2")
    monkeypatch.setenv("INDUCTOR_CUTE_COMPILE_SLOTS_DIR", str(tmp_path / "slots"))
    cache = CompiledKernelCache(tmp_path / "cache")
    specs = [KernelSpec.make(module, mode="hang"), KernelSpec.make(module, mode="crash"), rmsnorm_spec(384, "float16")]
    results = precompile(specs, arch="sm_90a", cache=cache, workers=2)
    assert [r.status for r in results] == ["failed", "failed", "compiled"], [r.error for r in results]
    assert "took over 3 s" in results[0].error
    assert "exited with code 3" in results[1].error
    assert cache.read(kernel_key(specs[2], "sm_90a")) is not None
    # The killed workers held a slot and a per-kernel lock each: both went with them.
    for path in [*(tmp_path / "slots").glob("slot-*.lock"), *(tmp_path / "cache" / "locks").glob("*.lock")]:
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_worker_count_is_bounded_by_cores_request_and_memory(monkeypatch):
    monkeypatch.delenv(host_limits.WORKERS_ENV, raising=False)
    monkeypatch.setattr(host_limits, "usable_cores", lambda: 64)
    monkeypatch.setattr(host_limits, "available_memory_bytes", lambda: 10 * (1 << 30) + 123)
    assert host_limits.worker_limit() == 10  # 10 GiB free, 1 GiB per worker
    assert host_limits.worker_limit(4) == 4
    monkeypatch.setattr(host_limits, "available_memory_bytes", lambda: 300 << 20)
    assert host_limits.worker_limit(4) == 1  # never zero: a compile must be able to run
    monkeypatch.setattr(host_limits, "available_memory_bytes", lambda: None)
    monkeypatch.setattr(host_limits, "usable_cores", lambda: 3)
    assert host_limits.worker_limit() == 3
    monkeypatch.setenv(host_limits.WORKERS_ENV, "2")
    assert host_limits.worker_limit() == 2


def test_memavailable_is_read_from_proc():
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo")
    available = host_limits.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
