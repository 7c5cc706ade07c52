"""With enable(), select_algorithm's choice benchmarking times in CUDA graphs (choice_timing.py).
What runs without a GPU: the hook's wrapping and restoring, and which calls take which timing. The
timing itself is checked against event timing on the H200 (tests/gpu/test_choice_timing_gpu.py)."""

import pytest
from torch._inductor import config as inductor_config
from torch._inductor.runtime.benchmarking import benchmarker
from torch._inductor.select_algorithm import AlgorithmSelectorCache

import inductor_cute
from inductor_cute.inductor import choice_timing, install


@pytest.fixture
def graph_calls(monkeypatch):
    """graph_time_ms replaced by a recorder that answers 7.0 ms."""
    calls = []

    def fake(fn, stock):
        calls.append(fn)
        return 7.0

    monkeypatch.setattr(choice_timing, "graph_time_ms", fake)
    return calls


def test_inside_the_context_the_benchmarker_times_in_graphs_and_is_restored_after(graph_calls):
    def work():
        pass

    with choice_timing._timing_in_graphs():
        assert benchmarker.benchmark_gpu(work) == 7.0
        assert benchmarker.benchmark_gpu(work, warmup=5, rep=20) == 7.0  # the `benchmark` dispatch's keywords
    assert graph_calls == [work, work]
    assert "benchmark_gpu" not in vars(benchmarker)


def test_all_timings_and_deterministic_mode_keep_inductors_benchmarker(graph_calls, monkeypatch):
    seen = []
    monkeypatch.setattr(type(benchmarker), "benchmark_gpu", lambda self, fn, **kw: seen.append(kw) or [1.0, 2.0])
    with choice_timing._timing_in_graphs():
        assert benchmarker.benchmark_gpu(lambda: None, return_mode="all") == [1.0, 2.0]
        with inductor_config.patch(deterministic=True):
            assert benchmarker.benchmark_gpu(lambda: None) == [1.0, 2.0]
    assert graph_calls == [] and seen == [{"return_mode": "all"}, {}]


def test_an_error_in_the_timed_code_restores_the_benchmarker(graph_calls):
    with pytest.raises(ZeroDivisionError):
        with choice_timing._timing_in_graphs():
            1 / 0
    assert "benchmark_gpu" not in vars(benchmarker)


def test_a_replacement_found_in_place_is_left_alone(graph_calls):
    def theirs(fn, **kw):
        return 3.0

    benchmarker.benchmark_gpu = theirs
    try:
        with choice_timing._timing_in_graphs():
            assert benchmarker.benchmark_gpu(lambda: None) == 3.0
        assert vars(benchmarker)["benchmark_gpu"] is theirs
    finally:
        del benchmarker.benchmark_gpu
    assert graph_calls == []


def test_the_wrapped_classmethod_times_its_choice_in_graphs(graph_calls):
    class Selector:
        @classmethod
        def benchmark_choice(cls, choice, autotune_args):
            return cls, benchmarker.benchmark_gpu(choice)

    def choice():
        pass

    Selector.benchmark_choice = choice_timing.timed_in_graphs(vars(Selector)["benchmark_choice"])
    assert Selector.benchmark_choice(choice, None) == (Selector, 7.0)
    assert graph_calls == [choice] and "benchmark_gpu" not in vars(benchmarker)


def test_enable_wraps_select_algorithms_benchmark_choice_and_disable_puts_it_back():
    stock = vars(AlgorithmSelectorCache)["benchmark_choice"]
    with inductor_cute.enable():
        ours = vars(AlgorithmSelectorCache)["benchmark_choice"]
        assert ours is not stock and isinstance(ours, classmethod) and install.hook("choice_timing").installed()
        assert ours.__func__.__wrapped__ is stock.__func__
    assert vars(AlgorithmSelectorCache)["benchmark_choice"] is stock


def test_with_subprocess_autotuning_every_choice_keeps_inductors_timing(graph_calls):
    with inductor_config.patch(autotune_in_subproc=True), choice_timing._timing_in_graphs():
        assert "benchmark_gpu" not in vars(benchmarker)  # Triton's are timed in the subprocess, stock
    assert graph_calls == []


def test_other_threads_keep_inductors_timing_while_a_choice_is_timed(graph_calls, monkeypatch):
    import threading

    monkeypatch.setattr(type(benchmarker), "benchmark_gpu", lambda self, fn, **kw: 5.0)
    seen = []
    with choice_timing._timing_in_graphs():
        worker = threading.Thread(target=lambda: seen.append(benchmarker.benchmark_gpu(lambda: None)))
        worker.start()
        worker.join()
        assert benchmarker.benchmark_gpu(lambda: None) == 7.0
    assert seen == [5.0] and len(graph_calls) == 1


def test_enable_wraps_the_schedulers_fusion_benchmarks():
    from torch._inductor.scheduler import Scheduler

    stock = {name: vars(Scheduler)[name] for name in ("benchmark_fused_nodes", "benchmark_codegened_module")}
    with inductor_cute.enable():
        for name, fn in stock.items():
            assert vars(Scheduler)[name] is not fn and vars(Scheduler)[name].__wrapped__ is fn
    assert all(vars(Scheduler)[name] is fn for name, fn in stock.items())


def test_enable_wraps_the_run_time_config_benchmark_of_triton_kernels(graph_calls):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    stock = vars(CachingAutotuner)["bench"]
    seen = []

    def bench(self, launcher, *args, **kwargs):  # what the stock bench ends in: the benchmarker's timing
        seen.append(launcher)
        return benchmarker.benchmark_gpu(lambda: None, rep=40, is_vetted_benchmarking=True)

    try:
        CachingAutotuner.bench = bench
        with inductor_cute.enable():
            wrapped = vars(CachingAutotuner)["bench"]
            assert wrapped is not bench and wrapped.__wrapped__ is bench
            assert CachingAutotuner.bench(object(), "launcher") == 7.0
        assert vars(CachingAutotuner)["bench"] is bench
        # run-time tuning compares configs timed in this process: subprocess autotuning (which
        # keeps select_algorithm's choices on the stock timing) does not change that
        with inductor_config.patch(autotune_in_subproc=True), inductor_cute.enable():
            assert CachingAutotuner.bench(object(), "launcher") == 7.0
    finally:
        CachingAutotuner.bench = stock
    assert seen == ["launcher", "launcher"] and len(graph_calls) == 2
