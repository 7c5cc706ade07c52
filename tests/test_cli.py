"""The command line as a user runs it, on a machine without a GPU."""

import os
import subprocess
import sys

import pytest


def run_cli(*args, cache_dir, timeout=600):
    env = {**os.environ, "INDUCTOR_CUTE_CACHE_DIR": str(cache_dir), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "inductor_cute", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


def test_demo_without_gpu_says_so_and_compiles_the_library(cli_cache):
    out = run_cli("demo", cache_dir=cli_cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("No CUDA GPU is visible")
    assert out.stdout.count("compiled ") == 14 and "0 failed" in out.stdout
    assert out.stdout.count("gemm_sm90(") == 4 and out.stdout.count("rmsnorm_sm90(") == 10
    again = run_cli("demo", cache_dir=cli_cache)
    assert again.stdout.count("cached ") == 14


def test_cache_show_list_and_clear(cli_cache):
    shown = run_cli("cache", cache_dir=cli_cache)
    assert f"location: {cli_cache}" in shown.stdout
    assert "entries:  14 (14 compiled objects, 0 linked libraries)" in shown.stdout
    listed = run_cli("cache", "list", cache_dir=cli_cache)
    assert listed.stdout.count("rmsnorm_sm90(") == 10 and listed.stdout.count("gemm_sm90(") == 4
    cleared = run_cli("cache", "clear", cache_dir=cli_cache)
    assert "removed 14 entries" in cleared.stdout
    assert "entries:  0" in run_cli("cache", cache_dir=cli_cache).stdout


def test_doctor_without_gpu_checks_compilation(tmp_path):
    out = run_cli("doctor", cache_dir=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA GPU visible" in out.stdout
    assert "for sm_90a: compiled in" in out.stdout
    assert "doctor: all checks passed" in out.stdout


def test_doctor_fails_when_the_dsl_is_missing(tmp_path):
    # A stand-in for an environment without the DSL: its modules cannot be found.
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('cutlass', 'nvidia_cutlass_dsl'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "INDUCTOR_CUTE_CACHE_DIR": str(tmp_path / "c"), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "inductor_cute", "doctor"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode != 0
    assert "[FAIL] cutlass-dsl" in out.stdout


def test_bench_needs_a_gpu(tmp_path):
    out = run_cli("bench", "rmsnorm", "--quick", "--out", str(tmp_path), cache_dir=tmp_path)
    assert out.returncode != 0
    assert "bench needs a CUDA GPU" in out.stderr
