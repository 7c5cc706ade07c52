"""Autotuning's timings as a compiled model meets them (issue 11, item 1).

Inductor times a choice alone: a write flush of L2 (`zero_()` of an L2-sized buffer), then CUDA
events around one call, the minimum of up to 100. In the max-autotune profile of a Llama-3.1-8B
decode step on the H200 (benchmarks/results/profile-model-max-autotune-4layers-h200-20261204-s9.txt)
those timings read about twice what the same kernels took inside the step (flex decoding 133 us
timed, 64.6 us in the step; the 8x4096x4096 GEMM 27 us timed, 12 us in the step), and not by a
constant factor: the K projection's pick took 18-19 us in the step where the V projection's,
an equal GEMM, took 11.

With enable(), every choice `select_algorithm` benchmarks, every fusion the scheduler benchmarks
and every config a Triton kernel compares at its first call (`CachingAutotuner.bench`: run-time
tuning, coordinate descent) is timed the way a CUDA-graph step runs it instead: `calls` calls,
each after a read of a buffer twice the L2 size (so L2 holds clean lines and the call reads its
operands from memory, as in a model whose weights exceed L2), are
captured in one CUDA graph; a second graph holds the reads alone; a call's time is the difference
of the two replays' median times over `calls`. Replays launch once, so host cost, which a CUDA-graph
step does not pay, does not enter. A callable that cannot be captured (it synchronizes, its first
call raises, or a capture is already under way) is timed by Inductor's benchmarker as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import statistics
import threading

log = logging.getLogger(__name__)

TARGET_GRAPH_MS = 2.0  # per replay: enough calls that the flush's jitter divides out
MAX_CALLS = 32
ROUNDS = 7  # replays of each graph, alternating
counts = {"graph": 0, "stock": 0}  # how choices were timed in this process (logs, tests)


def graph_time_ms(fn, stock_benchmark_gpu) -> float:
    """Device time of one `fn()` inside a CUDA graph, its operands cold in L2 (see the module
    docstring), captured on the current stream, which must be the one `fn` launches on and not
    the default stream; `stock_benchmark_gpu(fn)` where `fn` cannot be captured."""
    import torch

    stream = torch.cuda.current_stream()
    if torch.cuda.is_current_stream_capturing() or stream == torch.cuda.default_stream():
        return _stock(fn, stock_benchmark_gpu, "no side stream to capture on")
    try:
        syncs = _synchronizes(fn)
    except Exception as e:  # noqa: BLE001 - the stock benchmarker's own handling (an invalid
        # Triton config is timed as inf there, not raised) decides what a failing call means
        torch.cuda.synchronize()
        return _stock(fn, stock_benchmark_gpu, f"its first call raised: {e}")
    if syncs:  # would fail the capture, and a failed capture upsets torch's RNG state
        return _stock(fn, stock_benchmark_gpu, "it synchronizes with the host")
    torch.cuda.synchronize()
    flush = torch.ones(2 * _l2_bytes() // 4, dtype=torch.float32, device="cuda")
    calls = max(1, min(MAX_CALLS, int(TARGET_GRAPH_MS / max(_event_time_ms(fn, flush), 1e-3))))
    try:
        with_fn, alone = _capture(fn, flush, calls), _capture(None, flush, calls)
    except Exception as e:  # noqa: BLE001 - anything capture refuses is timed the stock way
        torch.cuda.synchronize()
        # a failed capture leaves the CUDA generators "capturing" (torch raises at the next random
        # op); a capture that ends well resets them
        _capture(None, flush, 1)
        return _stock(fn, stock_benchmark_gpu, f"capture failed: {e}")
    if _node_count(with_fn) < _node_count(alone) + calls:  # fn launched elsewhere: it ran, uncaptured
        return _stock(fn, stock_benchmark_gpu, "fn's launches were not on the capturing stream")
    with_fn.instantiate()
    alone.instantiate()
    times = {id(with_fn): [], id(alone): []}
    for r in range(ROUNDS + 1):
        for g in (with_fn, alone) if r % 2 else (alone, with_fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            if r:  # round 0 warms the graphs up
                times[id(g)].append(start.elapsed_time(end))
    counts["graph"] += 1
    return max((statistics.median(times[id(with_fn)]) - statistics.median(times[id(alone)])) / calls, 1e-6)


def _stock(fn, stock_benchmark_gpu, why: str) -> float:
    log.info("inductor-cute: a choice timed by Inductor's benchmarker (%s)", why)
    counts["stock"] += 1
    return stock_benchmark_gpu(fn)


def _synchronizes(fn) -> bool:
    """Whether `fn()` (run once here: the warm-up, outside any capture) makes torch wait for the
    GPU, as `.item()` does."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


def _event_time_ms(fn, flush) -> float:
    """One call's event-timed run after a flush: sizes the graphs."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.sum()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _capture(fn, flush, calls: int):
    """`calls` x (flush read, fn()) in one graph, on the current stream. Not `torch.cuda.graph`:
    it empties the allocator's cache at every capture, which autotuning's many would pay."""
    import torch

    graph = torch.cuda.CUDAGraph(keep_graph=True)  # its nodes are counted before it is instantiated
    pool = torch.cuda.graph_pool_handle()
    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        for _ in range(calls):
            flush.sum()
            if fn is not None:
                fn()
    finally:
        try:
            graph.capture_end()
        except BaseException:
            _release_failed_capture(pool)
            raise
    return graph


def _release_failed_capture(pool) -> None:
    """A capture that fails in `capture_end` leaves its pool registered as allocating for a capture
    under way (torch ends that registration only after a good end): every later capture, CUDA-graph
    trees' included, would consult it. End and release it as torch would have."""
    import torch

    end, release = (getattr(torch._C, name, None) for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"))
    try:
        if end is not None:
            end(torch.cuda.current_device(), pool)
        if release is not None:
            release(torch.cuda.current_device(), pool)
    except Exception as e:  # noqa: BLE001 - best effort: the stock timing follows either way
        log.warning("inductor-cute: releasing a failed capture's memory pool: %s", e)


def _node_count(graph) -> int:
    from cuda.bindings import runtime  # the CuTe DSL's dependency: there wherever our kernels run

    err, _, count = runtime.cudaGraphGetNodes(runtime.cudaGraph_t(init_value=graph.raw_cuda_graph()))
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphGetNodes: {err}")
    return count


@functools.cache
def _l2_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size or (64 << 20)


# ----------------------------------------------------------------- the hook's replacement

def timed_in_graphs(stock_benchmark_choice, *, in_process: bool = False):
    """A benchmarking method as its class holds it (`AlgorithmSelectorCache.benchmark_choice`, a
    classmethod in torch 2.11-2.13; the scheduler's fusion benchmarks), wrapped so that Inductor's
    GPU benchmarker times in graphs while it runs. `in_process`: every candidate the method
    compares is timed in this process, whatever `autotune_in_subproc` says."""
    kind = type(stock_benchmark_choice)
    func = getattr(stock_benchmark_choice, "__func__", stock_benchmark_choice)

    @functools.wraps(func)
    def benchmark_choice(*args, **kwargs):
        with _timing_in_graphs(in_process):
            return func(*args, **kwargs)

    return kind(benchmark_choice) if kind in (classmethod, staticmethod) else benchmark_choice


def run_time_tuning_in_graphs(stock_bench):
    """`CachingAutotuner.bench`: a Triton kernel's run-time config pick (several configs, coordinate
    descent) at its first call, always in the user's process."""
    return timed_in_graphs(stock_bench, in_process=True)


@contextlib.contextmanager
def _timing_in_graphs(in_process: bool = False):
    from torch._inductor import config
    from torch._inductor.runtime.benchmarking import benchmarker

    # nested, or someone else's replacement: leave it. With autotune_in_subproc the Triton choices
    # are timed in a subprocess, the stock way: ours and ATen's must be timed the same way
    if "benchmark_gpu" in vars(benchmarker) or (config.autotune_in_subproc and not in_process):
        yield
        return
    stock = benchmarker.benchmark_gpu
    owner = threading.get_ident()  # the benchmarker is process-wide: other threads keep the stock timing

    def benchmark_gpu(_callable, **kwargs):
        if threading.get_ident() != owner or kwargs.get("return_mode", "min") != "min" or config.deterministic:
            return stock(_callable, **kwargs)  # every timing asked for, or only vetted benchmarking
        return graph_time_ms(_callable, lambda f: stock(f, **kwargs))

    benchmarker.benchmark_gpu = benchmark_gpu
    try:
        with _side_stream():
            yield
    finally:
        del benchmarker.benchmark_gpu


@contextlib.contextmanager
def _side_stream():
    """A non-default stream for a choice's whole benchmarking: Inductor binds a Triton choice's
    launches to the stream current when it builds the choice's runner, and a graph captures only
    what launches on the capturing stream (the default stream cannot capture)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        yield
        return
    caller = torch.cuda.current_stream()
    side = _side_stream_of(caller.device_index)
    side.wait_stream(caller)  # the benchmark inputs were made on the caller's stream
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        caller.wait_stream(side)


@functools.cache
def _side_stream_of(device_index: int):
    """One per device: the flush buffer and the workspaces a choice allocates on it are cached by
    the allocator per stream, so a fresh stream per choice would keep a copy of each per stream."""
    import torch

    return torch.cuda.Stream(device=device_index)
