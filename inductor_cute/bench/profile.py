"""Device time per call by kernel, from torch.profiler: what a wall-time benchmark cannot tell
apart (a host-bound call's wall time is the host's, not the kernels').

Kernels launched with programmatic dependent launch (PDL) start before the previous kernel ends
and wait inside; their durations then overlap, so a step's device time is the time covered by at
least one kernel (`busy_us`), not the sum of durations, and the boundaries between kernels
(`boundary_gaps`) are what is left of the step."""

from __future__ import annotations

from collections import namedtuple

import torch

Launch = namedtuple("Launch", "name start end")  # microseconds on the device's clock


def _profiled_events(fn, calls: int, activity: str):
    """torch.profiler's events of `calls` calls of fn() (warm: one call first), and the sync that
    ends them; `activity` "CUDA" (kernels) or "CPU" (host operators and runtime calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.events()


def kernel_timeline(fn, calls: int = 5) -> list[Launch]:
    """Every kernel of `calls` calls of fn() (warm), in start order."""
    launches = [Launch(e.name, e.time_range.start, e.time_range.end) for e in _profiled_events(fn, calls, "CUDA")
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(launches, key=lambda k: (k.start, k.end))


def kernel_times(fn, calls: int = 5) -> dict[str, list[float]]:
    """{kernel name: [device microseconds of each launch]} over `calls` calls of fn() (warm)."""
    return times_by_kernel(kernel_timeline(fn, calls))


def times_by_kernel(timeline: list[Launch]) -> dict[str, list[float]]:
    kernels: dict[str, list[float]] = {}
    for k in timeline:
        kernels.setdefault(k.name, []).append(k.end - k.start)
    return kernels


def busy_us(timeline: list[Launch]) -> float:
    """Time covered by at least one kernel: overlapping launches (PDL) count once."""
    total, reach = 0.0, float("-inf")
    for k in timeline:  # in start order
        if k.end > reach:
            total += k.end - max(k.start, reach)
            reach = k.end
    return total


def family(name: str) -> str:
    """Who wrote a kernel, from its name: CuTe DSL ("cute": ours in our runs, FlashAttention-4's in
    the FLASH column), cuBLAS (its nvjet and CUTLASS-template kernels), Triton, or other."""
    if name.startswith("kernel_cutlass") or "inductor_cute" in name:
        return "cute"
    if name.startswith(("nvjet", "cutlass", "void cutlass", "sm90_xmma")) or "cublas" in name.lower():
        return "cublas"
    if name.startswith("triton"):
        return "triton"
    return "other"


def idle_and_overlap_us(timeline: list[Launch]) -> tuple[float, float]:
    """Idle time at kernel boundaries (positive gaps) and overlap of early starts (negative gaps,
    PDL), apart: summed together, one would cancel the other."""
    return split_gaps([g for gs in boundary_gaps(timeline).values() for g in gs])


def split_gaps(gaps: list[float]) -> tuple[float, float]:
    """(idle, overlap) of some boundary gaps: the positive ones summed, the negative ones' size."""
    return sum(g for g in gaps if g > 0), -sum(g for g in gaps if g < 0)


def _gaps(timeline: list[Launch]):
    """(kernel before, kernel after, microseconds) at each boundary: from the end of the kernels so
    far (the one reaching furthest is "before") to the next kernel's start, negative where it
    started early (PDL)."""
    reach, before = None, None
    for k in timeline:
        if reach is not None:
            yield before, k.name, k.start - reach
        if reach is None or k.end >= reach:
            reach, before = k.end, k.name


def boundary_gaps(timeline: list[Launch], max_gap_us: float = 50.0) -> dict[tuple[str, str], list[float]]:
    """{(family before, family after): [idle microseconds between them]} (see _gaps). Gaps longer
    than `max_gap_us` (between calls: the host's) are left out."""
    gaps: dict[tuple[str, str], list[float]] = {}
    for before, after, gap in _gaps(timeline):
        if gap <= max_gap_us:
            gaps.setdefault((family(before), family(after)), []).append(gap)
    return gaps


def host_gaps_us(timeline: list[Launch], max_gap_us: float = 50.0) -> float:
    """The idle time boundary_gaps leaves out: gaps longer than `max_gap_us`, where the device
    waited for the host between calls (e.g. after a sync, the next call's first launch)."""
    return sum(gap for _, _, gap in _gaps(timeline) if gap > max_gap_us)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def count_syncs(names) -> int:
    """How many of these profiler event names make the host wait for the device (a sync, or
    `.item()`'s aten::_local_scalar_dense, which syncs inside)."""
    return sum(1 for name in names if name in SYNC_EVENTS)


def host_syncs_per_call(fn, calls: int = 5) -> float:
    """Host waits for the device per fn() call (count_syncs over a CPU profile of `calls` warm
    calls, less the one synchronize that ends the profile)."""
    return (count_syncs(e.name for e in _profiled_events(fn, calls, "CPU")) - 1) / calls


def device_us_per_call(kernels: dict[str, list[float]], calls: int) -> float:
    """Sum of kernel durations per call (overlapping PDL launches count twice: see busy_us)."""
    return sum(sum(times) for times in kernels.values()) / calls


def top_kernels(kernels: dict[str, list[float]], calls: int, n: int = 25) -> list[tuple[float, float, str]]:
    """The n kernels with the most device time: (us per call of fn, launches per call, name)."""
    rows = [(sum(t) / calls, len(t) / calls, name) for name, t in kernels.items()]
    return sorted(rows, reverse=True)[:n]
