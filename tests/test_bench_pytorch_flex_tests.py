"""benchmarks/pytorch_flex_tests.py: the driver compares junit outcomes and counts the lowering's
decisions; its plugin records each flex_attention call's decision inside a pytest run (on the CPU
every call is declined for its device, which is still a recorded decision)."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("pytorch_flex_tests", ROOT / "benchmarks" / "pytorch_flex_tests.py")
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)

JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="t.A" name="ok"/><testcase classname="t.A" name="bad"><failure message="x"/></testcase>
<testcase classname="t.A" name="skip"><skipped message="y"/></testcase>
<testcase classname="t.A" name="err"><error message="z"/></testcase></testsuite></testsuites>"""


def test_outcomes_and_summary_name_regressions_and_count_half_precision_calls(tmp_path):
    (tmp_path / "r.xml").write_text(JUNIT)
    enabled = driver._outcomes(str(tmp_path / "r.xml"))
    assert enabled == {"t.A::ok": "passed", "t.A::bad": "failed", "t.A::skip": "skipped", "t.A::err": "failed"}
    stock = dict(enabled, **{"t.A::bad": "passed"})
    decisions = [{"test": "a", "kernel": "decode", "dtype": "torch.bfloat16", "reason": None},
                 {"test": "a", "kernel": "decode", "dtype": "torch.float16", "reason": "why"},
                 {"test": "b", "kernel": "prefill", "dtype": "torch.bfloat16", "reason": "why"},
                 {"test": "c", "kernel": "decode", "dtype": "torch.float32", "reason": "fp32"}]
    text = driver.summary("f", stock, enabled, decisions)
    assert "pass stock but not enabled: 1\n  - t.A::bad" in text
    assert "seen: 4; bf16/fp16: 3, taken 1 (33%)" in text.replace("calls our lowering saw", "seen")
    assert "- 2 x why" in text and "fp32" not in text.split("Declined")[1]


def test_plugin_records_each_flex_call_and_runs_tests_without_grad(tmp_path):
    test = tmp_path / "test_one.py"
    test.write_text(textwrap.dedent("""
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        def test_flex():
            assert not torch.is_grad_enabled()
            q = torch.randn(1, 2, 8, 16)
            out = torch.compile(flex_attention)(q, q, q)
            assert out.shape == q.shape
    """))
    env = dict(os.environ, ICUTE_PT_MODE="enabled", ICUTE_PT_DECISIONS=str(tmp_path / "d.jsonl"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    run = subprocess.run([sys.executable, "-m", "pytest", str(test), "-p", "pytorch_flex_tests", "-q",
                          "-p", "no:cacheprovider"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:]
    log = tmp_path / "d.jsonl"  # one file for every worker
    (row,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert row["test"].endswith("test_one.py::test_flex") and row["dtype"] == "torch.float32"
    assert row["reason"].startswith("device cpu")


def test_with_backward_the_tests_run_as_written_with_our_backward_offered(tmp_path):
    test = tmp_path / "test_two.py"
    test.write_text(textwrap.dedent("""
        import torch
        from torch._inductor.virtualized import V

        def test_settings():
            assert torch.is_grad_enabled()
            assert V.choices.settings.flex_backward and V.choices.settings.flex_decode
    """))
    env = dict(os.environ, ICUTE_PT_MODE="enabled", ICUTE_PT_DECISIONS=str(tmp_path / "d.jsonl"), ICUTE_PT_GRAD="1",
               ICUTE_PT_BACKWARD="1", PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    run = subprocess.run([sys.executable, "-m", "pytest", str(test), "-p", "pytorch_flex_tests", "-q",
                          "-p", "no:cacheprovider"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:]


def test_a_run_cut_off_or_not_made_reads_as_no_results_and_a_cut_line_is_dropped(tmp_path):
    assert driver._outcomes(str(tmp_path / "missing.xml")) == {}
    (tmp_path / "f-decisions.jsonl").write_text('{"test": "a", "kernel": "decode", "dtype": "torch.bfloat16", '
                                                '"reason": null}\n{"test": "b", "ker')
    decisions = driver._decisions(str(tmp_path), "f")
    assert [d["test"] for d in decisions] == ["a"]
    text = driver.summary("f", {}, {"t::x": "passed"}, decisions)
    assert "- stock: no results (not run, or cut off)" in text and "- enabled: 1 passed" in text
