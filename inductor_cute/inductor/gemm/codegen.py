"""Output code for our GEMMs (dense and grouped): the per-call-site launchers that the extern nodes
and the template emit."""

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


def define_call_site(wrapper, prefix: str, module: str, launcher: str) -> str:
    """Define `<prefix>_<n> = <module>.<launcher>` for one call site in the output code's header,
    with the import of `module` (so a graph served from the FX cache works in a process that
    never lowered it), and return the name to call."""
    wrapper.add_import_once(f"import {module}")
    name = f"{prefix}_{wrapper.next_kernel_suffix()}"
    wrapper.define_kernel(name, f"{module}.{launcher}", gpu=False)
    return name


def define_launcher(wrapper, op: str, config: tuple, static: bool = False, **scalars) -> str:
    """Define a GemmLauncher for one call site (define_call_site) and return the name to call: its
    bound `launch`, which takes the tensors positionally, or for a call site whose tensors all have
    static layouts, `launch_static` (runtime.py says why that is safe)."""
    kwargs = "".join(f", {k}={v!r}" for k, v in scalars.items())
    method = "launch_static" if static else "launch"
    return define_call_site(wrapper, "icute_gemm", RUNTIME,
                            f"GemmLauncher(op={op!r}, config={tuple(config)!r}{kwargs}).{method}")
