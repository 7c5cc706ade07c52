"""Output code for our GEMM: the per-call-site launcher both the extern node and the template emit."""

from __future__ import annotations

import sympy

from . import runtime

RUNTIME = runtime.MODULE


def is_static(*exprs) -> bool:
    """Whether all these sizes, strides and offsets are numbers (no dynamic size among them)."""
    return all(not isinstance(e, sympy.Expr) or e.is_number for e in exprs)


def layout_exprs(node) -> list:
    """A buffer's (or view's) sizes, strides and offset."""
    layout = node.get_layout()
    return [*layout.size, *layout.stride, layout.offset]


def define_launcher(wrapper, op: str, config: tuple, static: bool = False, **scalars) -> str:
    """Define a GemmLauncher for one call site in the output code's header (with the import of our
    runtime, so a graph served from the FX cache works in a process that never lowered it) and
    return the name to call: its bound `launch`, which takes the tensors positionally, or for a
    call site whose tensors all have static layouts, `launch_static` (runtime.py says why that
    is safe)."""
    wrapper.add_import_once(f"import {RUNTIME}")
    name = f"icute_gemm_{wrapper.next_kernel_suffix()}"
    kwargs = "".join(f", {k}={v!r}" for k, v in scalars.items())
    method = "launch_static" if static else "launch"
    wrapper.define_kernel(name, f"{RUNTIME}.GemmLauncher(op={op!r}, config={tuple(config)!r}{kwargs}).{method}",
                          gpu=False)
    return name
