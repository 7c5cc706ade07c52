"""Stopping a kernel on input it must not read past: `trap` ends the launch with an error (CUDA
reported "unspecified launch failure" on the H100, and the context is unusable after it), as
torch's device-side index asserts do, instead of reading or writing out of bounds and returning a
wrong answer."""

from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)
