"""Output code for our GEMM: the per-call-site launcher both the extern node and the template emit."""

from __future__ import annotations

from . import runtime

RUNTIME = runtime.MODULE


def define_launcher(wrapper, op: str, config: tuple, **scalars) -> str:
    """Define a GemmLauncher for one call site in the output code's header (with the import of our
    runtime, so a graph served from the FX cache works in a process that never lowered it) and
    return the name to call: its bound `launch`, which takes the tensors positionally."""
    wrapper.add_import_once(f"import {RUNTIME}")
    name = f"icute_gemm_{wrapper.next_kernel_suffix()}"
    kwargs = "".join(f", {k}={v!r}" for k, v in scalars.items())
    wrapper.define_kernel(name, f"{RUNTIME}.GemmLauncher(op={op!r}, config={tuple(config)!r}{kwargs}).launch",
                          gpu=False)
    return name
