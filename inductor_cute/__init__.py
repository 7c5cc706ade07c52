"""inductor-cute: CuTe DSL kernels for TorchInductor on NVIDIA Hopper.

Importing the package is cheap: the CuTe DSL is imported when a kernel is first compiled or loaded.
"""

__version__ = "0.1.0"

from .errors import CompileError, DSLUnavailableError, InductorCuteError, UnsupportedError  # noqa: E402

__all__ = ["CompileError", "DSLUnavailableError", "InductorCuteError", "UnsupportedError", "__version__"]
