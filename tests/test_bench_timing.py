"""Side-by-side timing interleaves the backends of a case (CPU: device timing is stubbed)."""

import pytest
import torch

from inductor_cute.bench import timing


def test_backends_are_interleaved_in_rotating_rounds_and_each_gets_its_median(monkeypatch):
    calls = []
    clock = {"a": iter(range(100)), "b": iter(range(1000, 1100)), "c": iter(range(5000, 5100))}

    def fake_runs(fn, reps, flush):
        key = fn()
        calls.append((key, reps))
        return [next(clock[key]) / 1e3 for _ in range(reps)]  # ms, distinct per backend

    monkeypatch.setattr(timing, "_device_times_ms", fake_runs)
    monkeypatch.setattr(timing, "_flush_buffer", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    fns = {k: (lambda k=k: k) for k in "abc"}
    times = timing.time_side_by_side(fns, reps=30, rounds=3, warmup=0)
    assert [k for k, _ in calls] == list("abc" "bca" "cab")  # each round starts one backend later
    assert all(reps == 10 for _, reps in calls)
    assert times == pytest.approx({"a": 15.0, "b": 1015.0, "c": 5015.0})  # median of each backend's own 30 runs, in us


def test_single_function_timing_is_one_round(monkeypatch):
    monkeypatch.setattr(timing, "_device_times_ms", lambda fn, reps, flush: [3e-3, 1e-3, 2e-3][:reps] * (reps // 3))
    monkeypatch.setattr(timing, "_flush_buffer", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert timing.time_us(lambda: None, reps=3, warmup=0) == 2.0
