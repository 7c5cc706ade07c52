"""Autotuning's graph timing on the H200 (inductor/choice_timing.py): a kernel is timed in graphs;
what a graph cannot capture (a host sync, the default stream, launches on another stream) falls
back to Inductor's benchmarker and leaves torch usable (RNG, later captures); a max-autotune compile
with enable() times every GEMM choice in graphs and computes the right product. How close the
timing comes to a model step's is measured by benchmarks/autotune_timing.py, not asserted here."""

import pytest
import torch

import inductor_cute
from inductor_cute.inductor import choice_timing

pytestmark = pytest.mark.gpu


def on_side_stream(fn, stock):
    """graph_time_ms as autotuning calls it: on a non-default stream."""
    with torch.cuda.stream(torch.cuda.Stream()):
        return choice_timing.graph_time_ms(fn, stock)


@pytest.fixture
def graph_timed(monkeypatch):
    """Every callable graph_time_ms times from now on (it still times them)."""
    timed = []
    real = choice_timing.graph_time_ms

    def counting(fn, stock):
        timed.append(fn)
        return real(fn, stock)

    monkeypatch.setattr(choice_timing, "graph_time_ms", counting)
    return timed


def test_a_kernel_is_timed_in_graphs():
    # how close the graph timing comes to a model's step is measured by benchmarks/autotune_timing.py
    src = torch.randn(16 << 20, device="cuda")
    dst = torch.empty_like(src)
    before = choice_timing.counts["graph"]
    got = on_side_stream(lambda: torch.mul(src, 2.0, out=dst), lambda fn: pytest.fail("fell back"))
    assert 0.0 < got < float("inf") and choice_timing.counts["graph"] == before + 1


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
    # and later captures (CUDA-graph trees') still work: the failed capture's pool was released
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        z = x * 3.0 + 1.0
    x.copy_(y)
    graph.replay()
    torch.testing.assert_close(z, y * 3.0 + 1.0)


def test_on_the_default_stream_or_for_a_call_on_another_stream_it_falls_back():
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    assert choice_timing.graph_time_ms(lambda: dst.copy_(src), lambda fn: 42.0) == 42.0  # default stream
    other = torch.cuda.Stream()

    def elsewhere():  # launches outside the capture, as a runner bound to another stream would
        with torch.cuda.stream(other):
            dst.copy_(src)

    assert on_side_stream(elsewhere, lambda fn: 42.0) == 42.0


def test_max_autotune_with_enable_times_choices_in_graphs_and_is_right(graph_timed):
    timed = graph_timed
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


def test_a_triton_kernels_run_time_config_pick_is_timed_in_graphs(graph_timed):
    # an 8 x 4096 RMSNorm-like reduction: several configs and coordinate descent, tuned at its
    # first call (CachingAutotuner.bench), in the user's process on the default stream
    timed = graph_timed
    torch._dynamo.reset()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    graph_before, stock_before = choice_timing.counts["graph"], choice_timing.counts["stock"]

    def rms_norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    settings = dict(fx_graph_cache=False, coordinate_descent_tuning=True, max_autotune_pointwise=True)
    with inductor_cute.enable(), torch._inductor.config.patch(**settings):
        out = torch.compile(rms_norm)(x, w)
        assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the side stream was left
    torch.testing.assert_close(out.float(), rms_norm(x.double(), w.double()).float(), rtol=2e-2, atol=2e-2)
    assert timed and choice_timing.counts["graph"] > graph_before  # the configs were timed in graphs,
    assert choice_timing.counts["stock"] == stock_before  # none fell back to the stock timing
