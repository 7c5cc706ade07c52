"""A kernel that faults loses the process's CUDA context: every later call fails alike. The
harness then keeps what it measured, says where and why the run ended, and writes the record;
and the grouped suite does not time Inductor's Triton template where it faulted that way."""

import types

import pytest
import torch

from inductor_cute.bench import harness
from inductor_cute.bench import record as rec
from inductor_cute.bench.case import Case, named
from inductor_cute.bench.suites import grouped_gemm


def fake_suite(built):
    def make(i):
        built.append(i)
        return Case(name=f"case {i}", params={}, flops=1e9, bytes=1e6,
                    runners={"inductor_cute": None, "triton": None, "aten": None})

    return types.SimpleNamespace(cases=lambda quick: [named(lambda i=i: make(i), f"case {i}") for i in (1, 2, 3)])


@pytest.fixture
def no_gpu_needed(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(harness, "measure_ceilings", lambda: {"copy_TBps": 4.0, "bf16_mm_TFLOPs": 700.0})
    return tmp_path


def run(monkeypatch, out_dir, faults):
    built = []
    monkeypatch.setitem(__import__("inductor_cute.bench.suites", fromlist=["SUITES"]).SUITES, "fake",
                        fake_suite(built))
    answers = iter(faults)
    monkeypatch.setattr(harness, "_sticky_cuda_error", lambda: next(answers))
    return harness.run_suite("fake", out_dir=str(out_dir)), built


def test_a_lost_context_ends_the_run_with_the_record_written(monkeypatch, no_gpu_needed, capsys):
    record, built = run(monkeypatch, no_gpu_needed, [None, "CUDA error: an illegal memory access was encountered"])
    assert built == [1, 2] and [c["name"] for c in record["cases"]] == ["case 1", "case 2"]
    assert record["env"]["aborted"].startswith("after case 2 of 3 (case 2): CUDA error: an illegal memory access")
    assert "Aborted after case 2 of 3" in rec.markdown(record)
    assert list(no_gpu_needed.glob("fake-*.json")), "no record written"


def test_a_fault_seen_while_timing_ends_the_run_with_the_record_written(monkeypatch, no_gpu_needed):
    calls = []

    def run_case(case, ceilings):
        calls.append(case.name)
        if case.name == "case 2":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"name": case.name, "params": {}, "flops": 1e9, "bytes": 1e6, "bound_us": 1.0,
                "times_us": {"inductor_cute": None, "triton": None, "aten": None}, "notes": ""}

    monkeypatch.setattr(harness, "run_case", run_case)
    record, built = run(monkeypatch, no_gpu_needed, [None, "CUDA error: an illegal memory access was encountered"])
    assert calls == ["case 1", "case 2"] and [c["name"] for c in record["cases"]] == ["case 1"]
    assert record["env"]["aborted"].startswith("during case 2 of 3 (case 2): CUDA error")
    assert list(no_gpu_needed.glob("fake-*.json"))


def test_a_harness_error_on_a_healthy_gpu_is_raised(monkeypatch, no_gpu_needed):
    def run_case(case, ceilings):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(harness, "run_case", run_case)
    with pytest.raises(KeyError):
        run(monkeypatch, no_gpu_needed, [None, None, None])


def test_a_healthy_run_is_not_marked_aborted(monkeypatch, no_gpu_needed):
    record, built = run(monkeypatch, no_gpu_needed, [None, None, None])
    assert built == [1, 2, 3] and "aborted" not in record["env"]
    assert "Aborted" not in rec.markdown(record)


def test_triton_is_omitted_where_its_grouped_template_faulted():
    # DeepSeek-V3 wgrad down at 4096 tokens: (E, M, N) = (256, 7168, 2048), 3.8e9 output elements
    a, b = torch.empty(7168, 32768, device="meta"), torch.empty(32768, 2048, device="meta")
    runner, note = grouped_gemm.triton_runner(a, b, torch.empty(256, dtype=torch.int32, device="meta"))
    assert runner is None and "faulted on outputs of 2^31 elements" in note and "3.76e+09" in note


def test_our_tuned_grouped_runner_is_omitted_with_its_reason_where_it_does_not_compile_to_ours(monkeypatch):
    from inductor_cute.bench.suites import gemm_compiled

    class Compiled:  # what compile_now returns when autotuning picked a stock choice
        code, seconds = "extern_kernels._grouped_mm(buf0, arg1_1, arg2_1)", 1.0

        def run(self):
            pass

    calls = []

    def compile_now(fn, args, **kw):
        calls.append(kw)
        return Compiled()

    monkeypatch.setattr(gemm_compiled, "compile_now", compile_now)
    runner, note = grouped_gemm.tuned_runner(None, None, None)
    assert runner is None and "holds no call of ours" in note
    assert calls == [{"mode": "max-autotune-no-cudagraphs", "ours": True, "backends": "ICUTE"}]
    Compiled.code = f"x = {grouped_gemm.GROUPED_CALL}...)"
    runner, note = grouped_gemm.tuned_runner(None, None, None)
    assert runner is not None and "autotuned under torch.compile" in note

    def failing(fn, args, **kw):
        raise RuntimeError("no valid choice\nmore")

    monkeypatch.setattr(gemm_compiled, "compile_now", failing)
    assert grouped_gemm.tuned_runner(None, None, None) == (None, "inductor_cute tuned omitted: no valid choice")


def test_each_runner_is_checked_on_its_own_output_not_on_a_reused_buffer(monkeypatch):
    """A CUDA-graph replay returns a tensor in the graphs' shared pool; the next runner's replay
    may overwrite it. The harness checks a copy taken when each runner returned."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    pool = torch.empty(4)

    def replay(value):
        pool.fill_(value)
        return pool

    ref = torch.full((4,), 2.0)
    runners = {"aten": lambda: ref.clone(), "inductor_cute": lambda: replay(2.0),
               "triton": lambda: replay(float("nan"))}
    case = Case(name="aliased", params={}, flops=1e9, bytes=1e6, runners=runners,
                atol=float("inf"), rtol=float("inf"), wall_times_us={"inductor_cute": 1.0, "triton": 1.0})
    result = harness.run_case(case, {"copy_TBps": 4.0, "bf16_mm_TFLOPs": 700.0})
    assert "MISMATCH: triton output has non-finite values" in result["notes"]
    assert "inductor_cute output" not in result["notes"]
    assert result["times_us"]["inductor_cute"] == 1.0 and result["times_us"]["triton"] is None


def test_a_run_killed_between_cases_leaves_its_record_so_far(monkeypatch, no_gpu_needed, capsys):
    """A time limit kills the process, not an exception: after each case the record so far is on
    disk, marked unfinished (with the case notes in the log); the finished run drops the mark."""
    seen = []

    def run_case(case, ceilings):
        if case.name == "case 3":  # what a kill at this point leaves on disk
            seen.append(__import__("json").loads(next(no_gpu_needed.glob("fake-*.json")).read_text()))
        return {"name": case.name, "params": {}, "flops": 1e9, "bytes": 1e6, "bound_us": 1.0,
                "times_us": {"inductor_cute": 1.0, "triton": 2.0, "aten": None}, "notes": f"{case.name} note"}

    monkeypatch.setattr(harness, "run_case", run_case)
    record, _ = run(monkeypatch, no_gpu_needed, [None, None, None])
    (partial,) = seen
    assert [c["name"] for c in partial["cases"]] == ["case 1", "case 2"]
    assert partial["env"]["unfinished"] == "written after case 2 of 3"
    assert "unfinished" not in record["env"]
    assert "unfinished" not in __import__("json").loads(next(no_gpu_needed.glob("fake-*.json")).read_text())["env"]
    log = capsys.readouterr()
    assert "notes: case 2 note" in log.err + log.out
    assert "Unfinished: written after case 2 of 3" in rec.markdown(partial)
