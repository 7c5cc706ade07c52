"""What the attention kernels' `build` functions compile against: the dtype tables and fake
(symbolic) tensors for torch-order operands, compact outputs and workspaces, the programs'
captured tensors and a BlockMask's four tensors. One symbol per extent is shared by every tensor
that has it (callers pass the same symbol), so the FFI checks at launch that they agree."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from ..common.programs.score import MAX_TENSORS

CUTE_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
SCORE_TENSOR_DTYPES = {"float32": Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "int32": Int32}


def strided(dtype, shape: tuple):
    """An operand in torch order: last dim contiguous, the other strides free multiples of 8
    elements, 16-byte aligned."""
    strides = tuple(cute.sym_int64(divisibility=8) for _ in shape[:-1]) + (1,)
    return make_fake_tensor(dtype, shape, stride=strides, assumed_align=16)


def compact(dtype, shape: tuple, aligned: bool = False):
    """A contiguous tensor (row-major), 16-byte aligned if `aligned`."""
    order = tuple(range(len(shape) - 1, -1, -1))
    if aligned:
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)
    return make_fake_compact_tensor(dtype, shape, stride_order=order)


def captured(dtypes: tuple) -> list:
    """A program's captured tensors (contiguous 1-D) t0, t1, ..., None past their count."""
    return [compact(SCORE_TENSOR_DTYPES[d], (cute.sym_int(),)) for d in dtypes] + [None] * (MAX_TENSORS - len(dtypes))


def block_mask(present: bool) -> list:
    """A BlockMask's (num_blocks, indices, full_num_blocks, full_indices), int32 (Z, H, R[, C]),
    or four Nones."""
    if not present:
        return [None] * 4
    z, h, rows, cols, full_cols = (cute.sym_int() for _ in range(5))
    return [compact(Int32, (z, h, rows)), compact(Int32, (z, h, rows, cols)), compact(Int32, (z, h, rows)),
            compact(Int32, (z, h, rows, full_cols))]
