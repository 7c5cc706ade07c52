"""Records, tables and plots from measured cases (synthetic numbers; no GPU)."""

import json

import pytest

from inductor_cute.bench import record as rec
from inductor_cute.bench.timing import bound_us

CEIL = {"copy_TBps": 4.0, "bf16_mm_TFLOPs": 800.0}


def make_record():
    r = {"suite": "rmsnorm", "created": "2026-12-02T10:00:00+00:00",
         "env": {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "cutlass_dsl": "4.8.1",
                 "inductor_cute": "0.1.0", "commit": "abc"}, "ceilings": CEIL, "cases": []}
    for name, ours, triton, aten in (("a", 10.0, 20.0, 15.0), ("b", 5.0, 5.0, None)):
        r["cases"].append({"name": name, "params": {}, "flops": 0, "bytes": 40e6 if name == "a" else 4e6,
                           "bound_us": bound_us(0, 40e6 if name == "a" else 4e6, CEIL),
                           "times_us": {"inductor_cute": ours, "triton": triton, "aten": aten}, "notes": ""})
    return r


def test_bound_is_the_larger_of_memory_and_matmul_time():
    assert bound_us(0, 4e6, CEIL) == pytest.approx(1.0)
    assert bound_us(8e8, 4e6, CEIL) == pytest.approx(1.0)
    assert bound_us(8e9, 4e6, CEIL) == pytest.approx(10.0)


def test_speedups_and_geomean_skip_missing_backends():
    r = make_record()
    assert rec.speedups(r, "triton") == [2.0, 1.0]
    assert rec.speedups(r, "aten") == [1.5, None]
    assert rec.geomean([2.0, 1.0]) == pytest.approx(2 ** 0.5)
    assert rec.geomean([None]) is None


def test_markdown_table_has_every_case_and_the_geomean():
    md = rec.markdown(make_record())
    assert "| a | 10.0 | 10.0 | 20.0 | 15.0 | 2.00x | 1.50x | 100% |" in md
    assert "| b | 1.0 | 5.0 | 5.0 | - | 1.00x | -x | 20% |" in md
    assert "Geomean speedup: 1.41x vs triton, 1.50x vs aten." in md


def test_write_names_files_by_suite_gpu_and_date(tmp_path):
    paths = rec.write(make_record(), tmp_path)
    assert paths[0].name == "rmsnorm-h200-20261202.json"
    assert json.loads(paths[0].read_text())["cases"][0]["times_us"]["triton"] == 20.0
    assert paths[1].read_text().startswith("# rmsnorm on NVIDIA H200")


def test_report_command_rewrites_table_and_plot(tmp_path):
    from inductor_cute.__main__ import main

    path = tmp_path / "rec.json"
    path.write_text(json.dumps(make_record()))
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "rmsnorm-h200-20261202.md").read_text().count("\n| ") == 3
