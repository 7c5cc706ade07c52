"""Device time per call by kernel, from torch.profiler: what a wall-time benchmark cannot tell
apart (a host-bound call's wall time is the host's, not the kernels')."""

from __future__ import annotations

import torch


def kernel_times(fn, calls: int = 5) -> dict[str, list[float]]:
    """{kernel name: [device microseconds of each launch]} over `calls` calls of fn() (warm)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    return kernels


def device_us_per_call(kernels: dict[str, list[float]], calls: int) -> float:
    return sum(sum(times) for times in kernels.values()) / calls


def top_kernels(kernels: dict[str, list[float]], calls: int, n: int = 25) -> list[tuple[float, float, str]]:
    """The n kernels with the most device time: (us per call of fn, launches per call, name)."""
    rows = [(sum(t) / calls, len(t) / calls, name) for name, t in kernels.items()]
    return sorted(rows, reverse=True)[:n]
