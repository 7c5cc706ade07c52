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

from .accumulator import row_half
from ..common.units import NEG_INF


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
                          count: cutlass.Constexpr = None):
    """`online_softmax` without touching O, for a kernel whose P V WGMMA still accumulates into O:
    acc_s becomes P and correction[h] = 2^(m_old - m) is left for `rescale_rows` once that WGMMA
    is done; `add_row_sums` then updates the row sums. With `scale_log2` (> 0), acc_s holds raw
    scores s (masked ones -inf) and x = s * scale_log2 is formed inside the exponent, one FFMA per
    element: max(x) = scale_log2 * max(s) for a positive scale. row_max is in x units either way.
    With `count`, only the first `count` values of each row become P; `exponentiate_rest` does the
    others."""
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
        _exponentiate(acc_s, row_half(n_s, h)[:count], base, scale_log2)


@cute.jit
def exponentiate_rest(acc_s: cute.Tensor, row_max: cute.Tensor, count: cutlass.Constexpr, scale_log2=None):
    """The values of each row past the first `count` become P, as `online_softmax_scores` (with
    `count`) made the others: against the row max it left in row_max."""
    n_s = cute.size(acc_s)
    for h in cutlass.range_constexpr(2):
        base = row_max[h]
        if base == NEG_INF:
            base = Float32(0.0)
        _exponentiate(acc_s, row_half(n_s, h)[count:], base, scale_log2)


def _exponentiate(acc_s: cute.Tensor, values: list, base, scale_log2):
    for v in values:
        if const_expr(scale_log2 is None):
            acc_s[v] = cute.math.exp2(acc_s[v] - base, fastmath=True)
        else:
            acc_s[v] = cute.math.exp2(acc_s[v] * scale_log2 - base, fastmath=True)


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
