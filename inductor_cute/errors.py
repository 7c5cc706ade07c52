"""Errors raised by inductor-cute's public API: one line that says what is wrong."""


class InductorCuteError(RuntimeError):
    """Base class of every error inductor-cute raises on purpose."""


class UnsupportedError(InductorCuteError, ValueError):
    """The input or the machine is outside what a kernel supports (dtype, size, layout, GPU)."""


class DSLUnavailableError(InductorCuteError, ImportError):
    """The CuTe DSL or TVM-FFI is missing or unusable."""


class CompileError(InductorCuteError):
    """The CuTe DSL failed to compile a kernel."""
