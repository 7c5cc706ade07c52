"""Importing the CuTe DSL for an explicit target, and the versions that key compiled objects."""

from __future__ import annotations

import functools
import os
import sys
from importlib import metadata

from ..errors import DSLUnavailableError, first_line


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def versions() -> dict[str, str | None]:
    """Versions of everything that changes what a compiled object contains or how it loads."""
    from ..version import __version__

    cutlass_dsl = _dist_version("nvidia-cutlass-dsl")
    if cutlass_dsl is None and "cutlass" in sys.modules:  # staged without pip metadata
        cutlass_dsl = getattr(sys.modules["cutlass"], "__version__", None)
    return {
        "inductor_cute": __version__,
        "cutlass_dsl": cutlass_dsl,
        "tvm_ffi": _dist_version("apache-tvm-ffi"),
    }


def import_cute(arch: str):
    """Import `cutlass.cute` with the DSL pinned to `arch`; returns the `cutlass` module.

    The DSL reads its target from CUTE_DSL_ARCH when it first initialises, so the variable is set
    before the import; a process that already imported it for another target cannot switch.
    """
    current = os.environ.get("CUTE_DSL_ARCH")
    if "cutlass.cute" in sys.modules and current not in (None, arch):
        raise DSLUnavailableError(
            f"the CuTe DSL was already initialised for {current}; cannot compile for {arch} in this process"
        )
    os.environ["CUTE_DSL_ARCH"] = arch
    try:
        import cutlass
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except ImportError as e:
        raise DSLUnavailableError(
            f"the CuTe DSL is not usable ({e}); install it with: pip install 'nvidia-cutlass-dsl[cu13]>=4.8,<4.9' apache-tvm-ffi"
        ) from e
    except Exception as e:  # the DSL raises RuntimeError for broken or mismatched installs
        raise DSLUnavailableError(f"the CuTe DSL failed to initialise: {first_line(e)}") from e
    return cutlass


def dsl_available(arch: str) -> tuple[bool, str]:
    """(True, version) if the DSL and TVM-FFI import for `arch`, else (False, the reason in one line)."""
    try:
        import_cute(arch)
    except DSLUnavailableError as e:
        return False, str(e)
    return True, versions()["cutlass_dsl"] or "unknown"
