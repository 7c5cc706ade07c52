"""inductor-cute: CuTe DSL kernels for TorchInductor on NVIDIA Hopper.

Importing the package is cheap: the CuTe DSL is imported when a kernel is first compiled or loaded.
"""

from .version import __version__

from .errors import CompileError, DSLUnavailableError, InductorCuteError, UnsupportedError  # noqa: E402
from .runtime.artifacts import register_when_torch_loads as _register_when_torch_loads  # noqa: E402

# Our kernels travel in torch.compiler.save_cache_artifacts(); load_cache_artifacts() must know
# their type in any process that imported us, whichever of torch and us came first.
_register_when_torch_loads()


def enable(fuse_epilogues: bool = False, flex_decode: bool = True, flex_prefill: bool = False,
           flex_backward: bool = False, group_gemv: bool | None = None, pdl: bool = False,
           keep_m1_mm: bool = False, trace_block_masks: bool = True, fuse_moe_gate: bool | None = None,
           fuse_moe_gather: bool | None = None, moe_routing: bool | None = None, moe_scatters: bool | None = None):
    """Let torch.compile's max-autotune pick our GEMM kernels where they measure faster; returns a
    context manager that undoes it. See inductor_cute.inductor."""
    from .inductor import enable as _enable

    return _enable(fuse_epilogues, flex_decode, flex_prefill, flex_backward, group_gemv, pdl, keep_m1_mm,
                   trace_block_masks, fuse_moe_gate, fuse_moe_gather, moe_routing, moe_scatters)


def disable() -> None:
    """Undo enable()."""
    from .inductor import disable as _disable

    _disable()


__all__ = ["CompileError", "DSLUnavailableError", "InductorCuteError", "UnsupportedError", "__version__", "disable",
           "enable"]
