"""Where a thread's values sit in an m64 WGMMA accumulator, what the softmax, the masks and the
P V product of an attention kernel rely on.

Each thread holds two rows of a 64-row tile (rows r and r + 8 of its warp's 16): value v belongs to
row half (v // 2) % 2 and column v % 2 + 8 * (v // 4). `check_acc_layout` asserts it at trace time.
"""

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def row_half(n_values: int, h: int) -> list[int]:
    """Indices of the accumulator values on a thread's row h (0: row r, 1: row r + 8); unrolled
    at trace time."""
    return [v for v in range(n_values) if (v // 2) % 2 == h]


def check_acc_layout(mma: cute.TiledMma, tile):
    # Trace time, on thread 0's static coordinates: value v of an accumulator sits on row
    # 8 * ((v // 2) % 2) and column v % 2 + 8 * (v // 4), what the softmax row halves and
    # acc_as_operand_a rely on.
    coords = mma.get_slice(0).partition_C(cute.make_identity_tensor(tile))
    for v in range(cute.size(coords)):
        assert tuple(coords[v]) == (8 * ((v // 2) % 2), v % 2 + 8 * (v // 4)), "unexpected WGMMA accumulator layout"


def acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """The S accumulator ((2, 2, N/8), 1, 1) seen as P, the A operand of a k16 WGMMA:
    ((2, 2, 2), 1, N/16). A k-block's 8 values are two neighbouring 8-column groups of the
    accumulator, in the order WGMMA's register fragment expects."""
    v = acc_layout.shape[0][2]
    assert cute.size(acc_layout) == 4 * v and v % 2 == 0
    return cute.make_layout(((2, 2, 2), 1, v // 2), stride=((1, 2, 4), 0, 8))


@dsl_user_op
def _pinned(x, *, loc=None, ip=None):
    return Int32(llvm.inline_asm(Int32.mlir_type, [Int32(x).ir_value(loc=loc, ip=ip)], "", "=r,0",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def fence_operand(t: cute.Tensor) -> None:
    """Pass each 32-bit register of register tensor `t` through an empty volatile asm (what
    CUTLASS's warpgroup_fence_operand does): `t` is materialised here, so the compiler cannot sink
    the code that computes it past the WGMMAs that follow. Without it, in the persistent prefill
    loop NVVM moved P's bf16 pack below the next block's S WGMMAs; P then stayed live in fp32 beside
    S and O, over the consumers' registers, and ptxas serialized every WGMMA (C7512)."""
    words = cute.recast_tensor(t, Int32)
    for i in range(cute.size(words)):
        words[i] = _pinned(words[i])


@dsl_user_op
def wait_after(a, b, *, loc=None, ip=None) -> None:
    """ptxas issues the next `wgmma.wait_group` only after a and b are computed. It treats the
    wait as a free instruction and issues it at the first stall it finds, so in the prefill loop
    it waited for P V before every exponential of the block, however the PTX ordered them. A
    never-taken branch on a and b (a NaN test around a nanosleep, a block ptxas cannot delete)
    ends its scheduling region there."""
    llvm.inline_asm(None, [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                    "{\n\t.reg .pred nan;\n\tsetp.nan.f32 nan, $0, $1;\n\t@nan nanosleep.u32 0;\n\t}", "f,f",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def wait_after_all(t: cute.Tensor) -> None:
    """`wait_after` every value of register tensor `t` (fp32): their sum, a tree of adds, is what
    the hold tests."""
    values = [t[i] for i in range(cute.size(t))]
    while len(values) > 2:
        values = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)] + values[len(values) // 2 * 2:]
    wait_after(values[0], values[-1])
