"""Online softmax over the rows of m64 WGMMA accumulators, in fp32 registers with exp2.

Scores arrive in log2 units (x = score * LOG2E from units.py, the scale folded into the same
multiply) and masked entries as -inf. Per row a thread keeps the running max m and its own part
of the running sum l (the four threads of a quad hold one row between them; `softmax_finalize`
adds the parts). Each new S tile becomes P = 2^(x - m) in place, and the O accumulator and l are
rescaled by 2^(m_old - m). At the end O / l is the row's output and m + log2(l) its logsumexp in
log2 units.

Works for any S and O tile widths (kernel blocks, head dims); the rows are the accumulator's two
per thread (accumulator.py), so a kernel with more rows per warp group keeps one state per
m64 tile.
"""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .accumulator import row_half
from ..common.units import NEG_INF

# 2^f on f in [-0.5, 0.5]: c0 + c1 f + c2 f^2 + c3 f^3, fitted for relative error (7.5e-5 at most
# in fp32 Horner; P is packed to bf16/fp16, 2^-9 / 2^-12 relative)
EXP2_POLY = (0.9999280571937561, 0.6932609677314758, 0.2426111400127411, 0.0551716685295105)
ROUNDING_MAGIC = 12582912.0  # 1.5 * 2^23: x + it, rounded to nearest, holds round(x) in its low mantissa bits
# 2^x below it is 0, -inf included (MUFU.EX2 flushes one binade lower, from 2^-126; at x = -125 the
# result is still normal: p(0) < 1)
EXP2_FLUSH_BELOW = -125.0


def _f32(x: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


# round(x) and the fraction by the magic-number addition (FADDs, no conversion unit), the fraction's
# polynomial by Horner (FFMAs), round(x) added to the result's exponent field (one IMAD), the
# flush, and a NaN-propagating max with x (exact otherwise: the result is >= 0 >= x, or ~1 where
# rounding left x a hair above 0) so that a NaN score stays NaN, as with MUFU.EX2
_EXP2_FMA_PTX = "\n\t".join([
    "{", ".reg .f32 t, j, f, p;", ".reg .b32 tb, pb;", ".reg .pred flush;",
    f"add.rn.f32 t, $1, {_f32(ROUNDING_MAGIC)};", f"sub.rn.f32 j, t, {_f32(ROUNDING_MAGIC)};",
    "sub.rn.f32 f, $1, j;",
    f"fma.rn.f32 p, f, {_f32(EXP2_POLY[3])}, {_f32(EXP2_POLY[2])};",
    f"fma.rn.f32 p, p, f, {_f32(EXP2_POLY[1])};", f"fma.rn.f32 p, p, f, {_f32(EXP2_POLY[0])};",
    "mov.b32 tb, t;", "mov.b32 pb, p;", "shl.b32 tb, tb, 23;", "add.s32 pb, pb, tb;",
    f"setp.lt.f32 flush, $1, {_f32(EXP2_FLUSH_BELOW)};", "selp.b32 pb, 0, pb, flush;", "max.NaN.f32 $0, pb, $1;",
    "}"])


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 0 (-inf gives 0, NaN NaN) without the MUFU unit: ten SASS instructions (three
    FADD, three FFMA and an IMAD on the FMA pipe, FSETP, SEL and FMNMX) in place of one MUFU.EX2,
    whose 16 results per cycle per SM a d64 softmax nearly fills beside the tensor cores
    (docs/perf-notes.md). 7.5e-5 relative error at most."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(x).ir_value(loc=loc, ip=ip)], _EXP2_FMA_PTX,
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


def poly_positions(per_row: int, poly: int) -> frozenset:
    """Which of a row's `per_row` values (positions in row_half order) `exp2_fma` makes when `poly`
    of them do: spread evenly, so that the MUFU and FMA work interleave."""
    return frozenset(i for i in range(per_row) if (i * poly) // per_row != ((i + 1) * poly) // per_row)


def softmax_state():
    """(row_max, row_sum) of one thread's two rows in registers, before any score: (-inf, 0).
    Kept by the kernel as two local tensors: a run-time loop cannot carry a Python object holding them."""
    row_max = cute.make_rmem_tensor((2,), Float32)
    row_sum = cute.make_rmem_tensor((2,), Float32)
    softmax_reset(row_max, row_sum)
    return row_max, row_sum


def softmax_reset(row_max: cute.Tensor, row_sum: cute.Tensor):
    """Back to the state before any score (a kernel's next tile)."""
    row_max.fill(NEG_INF)
    row_sum.fill(0.0)


@cute.jit
def online_softmax(acc_s: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor):
    """acc_s (already x = s * scale * log2(e), masked) becomes P = 2^(x - m) with m the running
    row max; acc_o and the per-thread partial row sums are rescaled by 2^(m_old - m)."""
    n_s, n_o = cute.size(acc_s), cute.size(acc_o)
    for h in cutlass.range_constexpr(2):
        m = row_max[h]
        for v in row_half(n_s, h):
            m = cute.arch.fmax(m, acc_s[v])
        # the 4 threads of a quad hold one row between them
        m = cute.arch.warp_reduction(m, cute.arch.fmax, threads_in_group=4)
        # a row with nothing unmasked yet keeps m = -inf; 0 avoids (-inf) - (-inf)
        base = m
        if m == NEG_INF:
            base = Float32(0.0)
        correction = cute.math.exp2(row_max[h] - base, fastmath=True)
        row_max[h] = m
        part = row_sum[h] * correction
        for v in row_half(n_s, h):
            p = cute.math.exp2(acc_s[v] - base, fastmath=True)
            acc_s[v] = p
            part += p
        row_sum[h] = part
        for v in row_half(n_o, h):
            acc_o[v] = acc_o[v] * correction


@cute.jit
def softmax_finalize(row_max: cute.Tensor, row_sum: cute.Tensor, h):
    """(1 / l, m + log2(l)) of row half h: the factor that normalises the row's O and its
    logsumexp in log2 units; a row with nothing to attend to (l = 0) gives (0, -inf)."""
    total = cute.arch.warp_reduction(row_sum[h], operator.add, threads_in_group=4)
    inv = Float32(0.0)
    lse2 = Float32(NEG_INF)
    if total != 0.0:  # NaN too: it reaches the lse
        inv = 1.0 / total
        lse2 = row_max[h] + cute.math.log2(total, fastmath=True)
    return inv, lse2


@cute.jit
def online_softmax_scores(acc_s: cute.Tensor, row_max: cute.Tensor, correction: cute.Tensor, scale_log2=None,
                          count: cutlass.Constexpr = None, poly: cutlass.Constexpr = 0):
    """`online_softmax` without touching O, for a kernel whose P V WGMMA still accumulates into O:
    acc_s becomes P and correction[h] = 2^(m_old - m) is left for `rescale_rows` once that WGMMA
    is done; `add_row_sums` then updates the row sums. With `scale_log2` (> 0), acc_s holds raw
    scores s (masked ones -inf) and x = s * scale_log2 is formed inside the exponent, one FFMA per
    element: max(x) = scale_log2 * max(s) for a positive scale. row_max is in x units either way.
    With `count`, only the first `count` values of each row become P; `exponentiate_rest` does the
    others. `poly` of each row's values are made by `exp2_fma` (poly_positions), the rest by MUFU."""
    n_s = cute.size(acc_s)
    for h in cutlass.range_constexpr(2):
        m = Float32(NEG_INF)
        if const_expr(scale_log2 is None):
            m = row_max[h]
        for v in row_half(n_s, h):
            m = cute.arch.fmax(m, acc_s[v])
        m = cute.arch.warp_reduction(m, cute.arch.fmax, threads_in_group=4)
        if const_expr(scale_log2 is not None):
            m = cute.arch.fmax(m * scale_log2, row_max[h])  # -inf stays -inf: the scale is positive
        base = m
        if m == NEG_INF:
            base = Float32(0.0)
        correction[h] = cute.math.exp2(row_max[h] - base, fastmath=True)
        row_max[h] = m
        row = row_half(n_s, h)
        _exponentiate(acc_s, row, 0, len(row) if count is None else count, base, scale_log2, poly)


@cute.jit
def exponentiate_rest(acc_s: cute.Tensor, row_max: cute.Tensor, count: cutlass.Constexpr, scale_log2=None,
                      poly: cutlass.Constexpr = 0):
    """The values of each row past the first `count` become P, as `online_softmax_scores` (with
    `count`) made the others: against the row max it left in row_max."""
    n_s = cute.size(acc_s)
    for h in cutlass.range_constexpr(2):
        base = row_max[h]
        if base == NEG_INF:
            base = Float32(0.0)
        row = row_half(n_s, h)
        _exponentiate(acc_s, row, count, len(row), base, scale_log2, poly)


def _exponentiate(acc_s: cute.Tensor, row: list, start: int, stop: int, base, scale_log2, poly: int):
    """Row positions start..stop-1 of `row` (accumulator indices) become 2^(x - base)."""
    by_fma = poly_positions(len(row), poly)
    for i in range(start, stop):
        v = row[i]
        x = acc_s[v] - base if const_expr(scale_log2 is None) else acc_s[v] * scale_log2 - base
        acc_s[v] = exp2_fma(x) if const_expr(i in by_fma) else cute.math.exp2(x, fastmath=True)


@cute.jit
def add_row_sums(acc_s: cute.Tensor, row_sum: cute.Tensor, correction=None, first: cutlass.Constexpr = 0,
                 count: cutlass.Constexpr = None):
    """row_sum[h] = row_sum[h] * correction[h] (without `correction`: row_sum[h]) + the row's P
    (acc_s; with `first` / `count`, only those of each row's values). Apart from the exponentials
    and called after the WGMMA wait: summed as they were made, the compiler computed each P twice
    in a tile loop or at d256 (once for the sum, again for the registers P V reads later)."""
    n_s = cute.size(acc_s)
    for h in cutlass.range_constexpr(2):
        part = row_sum[h]
        if const_expr(correction is not None):
            part = part * correction[h]
        values = row_half(n_s, h)[first:]
        for v in values[:count]:
            part += acc_s[v]
        row_sum[h] = part


@cute.jit
def rescale_rows(acc_o: cute.Tensor, correction: cute.Tensor):
    """acc_o's rows times correction[h] (from `online_softmax_scores`)."""
    for h in cutlass.range_constexpr(2):
        for v in row_half(cute.size(acc_o), h):
            acc_o[v] = acc_o[v] * correction[h]
