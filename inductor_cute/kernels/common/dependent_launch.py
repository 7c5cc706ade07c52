"""Programmatic dependent launch (PDL, sm_90): a kernel launched with `use_pdl=True` may be
scheduled while the kernel before it in the stream is still running, once that kernel has let its
dependents launch (`griddepcontrol.launch_dependents`, which Inductor's Triton kernels issue after
their loads when `triton.enable_pdl` is on). Its prologue (descriptor prefetch, shared memory
and barrier setup) then overlaps the previous kernel's tail instead of following it.

The rule every kernel here keeps: wait for the previous grid (`griddepcontrol.wait`: all its
blocks finished and their writes visible) before the first global memory access, and only then
let the next kernel launch. Releasing only after waiting keeps completion transitive: when this
kernel's dependents start, everything before this kernel has finished. Launched without the PDL
attribute, or after a kernel that never releases, both instructions cost nothing and ordering is
the ordinary stream order.
"""

import cutlass.cute as cute

LAUNCH = {"use_pdl": True}  # keyword arguments of `.launch(...)`


@cute.jit
def wait_then_release():
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
