"""Which GPU architecture we compile for, and the facts about it we need without a driver."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UnsupportedError

ARCH_ENV = "INDUCTOR_CUTE_ARCH"


@dataclass(frozen=True)
class ArchInfo:
    name: str  # the DSL's target name, e.g. "sm_90a"
    capability: tuple[int, int]
    sm_count: int  # of the flagship part, used when no GPU is visible
    smem_per_block: int  # bytes of shared memory one CTA may opt into


# Architectures we have kernels for. Add an entry here, and kernels for it, to support a new one.
SUPPORTED = {
    (9, 0): ArchInfo("sm_90a", (9, 0), sm_count=132, smem_per_block=227 * 1024),
}
BY_NAME = {info.name: info for info in SUPPORTED.values()}


def arch_info(name: str) -> ArchInfo:
    try:
        return BY_NAME[name]
    except KeyError:
        known = ", ".join(sorted(BY_NAME))
        raise UnsupportedError(f"no inductor-cute kernels for target {name!r} (supported: {known})") from None


def device_arch(device=None) -> ArchInfo:
    """The arch of a visible CUDA device; raises UnsupportedError for one we have no kernels for."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedError("inductor-cute needs a CUDA GPU and none is visible")
    cap = torch.cuda.get_device_capability(device)
    if cap not in SUPPORTED:
        name = torch.cuda.get_device_name(device)
        raise UnsupportedError(
            f"inductor-cute needs an NVIDIA Hopper GPU (sm_90); found {name} (sm_{cap[0]}{cap[1]})"
        )
    return SUPPORTED[cap]


def target_arch() -> ArchInfo:
    """The arch this process compiles for: $INDUCTOR_CUTE_ARCH, else the current GPU's, else sm_90a.

    Never left to the DSL, which silently picks sm_100a when it cannot see a GPU.
    """
    forced = os.environ.get(ARCH_ENV)
    if forced:
        return arch_info(forced)
    try:
        import torch

        if torch.cuda.is_available():
            return device_arch()
    except UnsupportedError:
        raise
    except Exception:  # no usable driver: compile for the default target
        pass
    return SUPPORTED[(9, 0)]


def sm_count(info: ArchInfo, device=None) -> int:
    """SMs of the GPU we will run on: read from torch when a GPU is there, else the arch's table value."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return info.sm_count
