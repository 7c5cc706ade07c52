"""Compile CuTe DSL kernels for an explicit target, cache them on disk, load and launch them.

Knows nothing of what the kernels compute.
"""

from .arch import ArchInfo, device_arch, target_arch
from .cache import CompiledKernelCache, default_cache_dir
from .loader import get_kernel, stats
from .pool import precompile
from .spec import KernelSpec

__all__ = ["ArchInfo", "CompiledKernelCache", "KernelSpec", "default_cache_dir", "device_arch",
           "get_kernel", "precompile", "stats", "target_arch"]
