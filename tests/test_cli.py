"""The command line as a user runs it, on a machine without a GPU."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run_cli(*args, cache_dir, timeout=600):
    env = {**os.environ, "INDUCTOR_CUTE_CACHE_DIR": str(cache_dir), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "inductor_cute", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _gemm_lines(text: str) -> int:
    return len(re.findall(r"\bsm90\(", text))  # kernels/gemm/sm90.py's kernels (not rmsnorm_sm90)


@pytest.fixture(scope="module")
def cli_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


def test_demo_without_gpu_says_so_and_compiles_the_library(cli_cache):
    out = run_cli("demo", cache_dir=cli_cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("No CUDA GPU is visible")
    assert out.stdout.count("compiled ") == 14 and "0 failed" in out.stdout
    assert _gemm_lines(out.stdout) == 4 and out.stdout.count("rmsnorm_sm90(") == 10
    assert "Run it again: every kernel is now cached" in out.stdout
    again = run_cli("demo", cache_dir=cli_cache)
    assert again.stdout.count("  cached ") == 14
    assert "all 14 kernels were already cached" in again.stdout and "Run it again" not in again.stdout


def test_cache_show_list_and_clear(cli_cache):
    shown = run_cli("cache", cache_dir=cli_cache)
    assert f"location: {cli_cache}" in shown.stdout
    assert "entries:  14 (14 compiled objects, 0 linked libraries)" in shown.stdout
    listed = run_cli("cache", "list", cache_dir=cli_cache)
    assert listed.stdout.count("rmsnorm_sm90(") == 10 and _gemm_lines(listed.stdout) == 4
    cleared = run_cli("cache", "clear", cache_dir=cli_cache)
    assert "removed 14 entries" in cleared.stdout
    assert "entries:  0" in run_cli("cache", cache_dir=cli_cache).stdout


def test_doctor_without_gpu_checks_compilation(tmp_path):
    out = run_cli("doctor", cache_dir=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA GPU visible" in out.stdout
    assert "for sm_90a: compiled in" in out.stdout
    assert "doctor: all checks passed" in out.stdout
    # The cache doctor reports includes what its self-check added: `cache show` agrees.
    n_doctor = re.search(r"\] cache +\S+ \((\d+) entries", out.stdout).group(1)
    n_show = re.search(r"entries: +(\d+)", run_cli("cache", cache_dir=tmp_path).stdout).group(1)
    assert int(n_doctor) == int(n_show) >= 1


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


def test_help_answers_without_importing_torch(tmp_path):
    code = ("import sys\nfrom inductor_cute.__main__ import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'cutlass' in sys.modules)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False False")
    assert "usage: python -m inductor_cute" in out.stdout
    assert time.perf_counter() - start < 3  # torch alone takes seconds to import


def test_bench_suites_listed_without_import_are_the_suites():
    from inductor_cute.__main__ import _suite_names
    from inductor_cute.bench.suites import SUITES

    assert _suite_names() == sorted(SUITES)


def test_console_script_names_itself_in_usage(tmp_path):
    script = Path(sys.executable).parent / "inductor-cute"
    if not script.exists():
        pytest.skip("the inductor-cute console script is not installed in this environment")
    out = subprocess.run([str(script), "cache", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: inductor-cute cache")


def test_commands_are_quiet_on_stderr(tmp_path):
    out = run_cli("cache", cache_dir=tmp_path)  # imports torch's pieces the cache needs
    assert out.returncode == 0 and out.stderr == ""


def _record(tmp_path, record):
    path = tmp_path / "rec.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read"),
    ("not json", "is not JSON"),
    ({"cases": []}, "is not a benchmark record: no 'suite' field"),
    ({"suite": "gemm", "created": "2026-12-02", "env": {}, "ceilings": {}, "cases": []},
     "is not a benchmark record: 'env' lacks 'gpu'"),
])
def test_report_errors_are_one_line(tmp_path, content, expected):
    path = tmp_path / "missing.json" if content is None else _record(tmp_path, content)
    out = run_cli("report", str(path), cache_dir=tmp_path)
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and expected in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_report_says_when_and_why_the_plot_is_skipped(tmp_path, monkeypatch, capsys):
    from inductor_cute.__main__ import main

    record = {"suite": "rmsnorm", "created": "2026-12-02T10:00:00+00:00",
              "env": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "cutlass_dsl": "4.8.1",
                      "inductor_cute": "0.1.0", "commit": "abc"},
              "ceilings": {"copy_TBps": 4.0, "bf16_mm_TFLOPs": 800.0},
              "cases": [{"name": "a", "bound_us": 1.0, "times_us": {"inductor_cute": 2.0, "triton": 3.0}}]}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    path = _record(tmp_path, record)
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert "skipped the PNG plot: matplotlib is not installed" in out.err
    assert out.out.count("wrote ") == 2
