"""Autotuning's graph timing on the H200 (inductor/choice_timing.py): it agrees with event timing
where both are exact (a long copy), falls back to Inductor's benchmarker for what a graph cannot
capture, and a max-autotune compile with enable() times its GEMM choices that way and computes the
right product."""

import pytest
import torch

import inductor_cute
from inductor_cute.inductor import choice_timing

pytestmark = pytest.mark.gpu


def event_time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def on_side_stream(fn, stock):
    """graph_time_ms as autotuning calls it: on a non-default stream."""
    with torch.cuda.stream(torch.cuda.Stream()):
        return choice_timing.graph_time_ms(fn, stock)


def test_a_long_kernel_times_as_events_time_it():
    src = torch.randn(128 << 20, device="cuda")  # 512 MB: L2 and launch gaps are noise here
    dst = torch.empty_like(src)
    expected = event_time_ms(lambda: torch.mul(src, 2.0, out=dst))  # a kernel (a copy_ graphs as a memcpy)
    got = on_side_stream(lambda: torch.mul(src, 2.0, out=dst), lambda fn: pytest.fail("fell back"))
    assert got == pytest.approx(expected, rel=0.1)


def test_a_small_kernel_is_timed_below_the_write_flushed_benchmarker():
    from torch._inductor.runtime.benchmarking import benchmarker

    a = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    got = on_side_stream(lambda: a @ w.t(), lambda fn: pytest.fail("fell back"))
    assert 0.001 < got < benchmarker.benchmark_gpu(lambda: a @ w.t())


def test_what_a_graph_cannot_capture_is_timed_by_the_stock_benchmarker(monkeypatch):
    x = torch.randn(1024, device="cuda")

    def syncs():
        (x * 2).sum().item()  # a host sync: illegal while capturing

    assert on_side_stream(syncs, lambda fn: 42.0) == 42.0
    # a capture that fails after all (the sync check passed it) leaves torch usable, RNG included
    monkeypatch.setattr(choice_timing, "_synchronizes", lambda fn: False)
    assert on_side_stream(syncs, lambda fn: 43.0) == 43.0
    assert not torch.cuda.is_current_stream_capturing()
    y = torch.randn(1024, device="cuda")
    assert (x + y).sum().item() == pytest.approx((x.double() + y.double()).sum().item(), rel=1e-3)


def test_on_the_default_stream_or_for_a_call_on_another_stream_it_falls_back():
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    assert choice_timing.graph_time_ms(lambda: dst.copy_(src), lambda fn: 42.0) == 42.0  # default stream
    other = torch.cuda.Stream()

    def elsewhere():  # launches outside the capture, as a runner bound to another stream would
        with torch.cuda.stream(other):
            dst.copy_(src)

    assert on_side_stream(elsewhere, lambda fn: 42.0) == 42.0


def test_max_autotune_with_enable_times_choices_in_graphs_and_is_right(monkeypatch):
    timed = []
    real = choice_timing.graph_time_ms

    def counting(fn, stock):
        timed.append(fn)
        return real(fn, stock)

    monkeypatch.setattr(choice_timing, "graph_time_ms", counting)
    stock_before = choice_timing.counts["stock"]
    torch._dynamo.reset()
    a = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)

    def f(a, w):
        return a @ w.t()

    with inductor_cute.enable(), torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False):
        out = torch.compile(f, mode="max-autotune-no-cudagraphs")(a, w)
    ref = a.double() @ w.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-1)
    assert len(timed) >= 2  # every choice, ours and stock
    assert choice_timing.counts["stock"] == stock_before  # Triton's, cuBLAS's and ours all captured
