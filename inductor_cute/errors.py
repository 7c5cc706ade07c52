"""Errors raised by inductor-cute's public API: one line that says what is wrong."""


def first_line(e: BaseException | None) -> str:
    """The first non-empty line of an exception's message, or its type name: for one-line reports."""
    text = str(e).strip() if e is not None else ""
    return text.splitlines()[0] if text else type(e).__name__


class InductorCuteError(RuntimeError):
    """Base class of every error inductor-cute raises on purpose."""


class UnsupportedError(InductorCuteError, ValueError):
    """The input or the machine is outside what a kernel supports (dtype, size, layout, GPU)."""


class DSLUnavailableError(InductorCuteError, ImportError):
    """The CuTe DSL or TVM-FFI is missing or unusable."""


class CompileError(InductorCuteError):
    """The CuTe DSL failed to compile a kernel."""
