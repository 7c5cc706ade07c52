"""flex_attention's score_mod and mask_mod, and the sequence end, applied to an S tile.

The mods are score programs (kernels/common/programs/score.py) compiled by make_score_fn into
callables of (score, b, h, q, kv, tensors) and (b, h, q, kv, tensors). An element's indices come
from the tile's coordinate tensor tScS (its (row, column) in the tile): its query head and
position from its packed row (pack_gqa.py; group 1 for unpacked rows), its key from the column
plus the KV block's start. Elements are visited per row half (accumulator.py), unrolled at trace
time.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.programs.score import make_score_fn
from ..common.programs.score_grad import tangent
from .accumulator import row_half
from .pack_gqa import PackGQA
from ..common.units import LOG2E, NEG_INF


class ScoreMods:
    """The score program ("" for none) and mask program ("" for none) of one kernel, over tiles of
    kv_block keys whose rows are packed by `rows`."""

    def __init__(self, score_program: str, score_dtypes: tuple, mask_program: str, mask_dtypes: tuple,
                 kv_block: int, rows: PackGQA):
        self.score_fn = make_score_fn(score_program, score_dtypes) if score_program else None
        self.mask_fn = make_score_fn(mask_program, mask_dtypes, mask=True) if mask_program else None
        self.kvb = kv_block
        self.rows = rows

    @cute.jit
    def apply(self, acc_s: cute.Tensor, tScS: cute.Tensor, scale_log2: Float32, scale: Float32, b: Int32,
              kv_head: Int32, row0: Int32, n_rows: Int32, blk: Int32, partial, score_tensors: tuple,
              mask_tensors: tuple, scale_later: cutlass.Constexpr = False):
        """S (raw scores of KV block `blk`, tile rows from row0) becomes x in log2 units: s * scale_log2,
        or score_mod(s * scale, ...) * log2(e); then -inf where mask_mod is False, in partial blocks
        only (full blocks are known unmasked: torch skips their mask_mod too). With `scale_later`
        and no score program, S stays raw: the caller folds scale_log2 (> 0) into the softmax."""
        # scale (or score_mod) before masking: a negative scale would turn a masked -inf into +inf
        # score_mod and mask_mod only on a thread's real rows: a decode tile's 64 rows are
        # mostly padding (8 real with 8 query heads per KV head), and the mods are per-element
        # work (a softcap: 4 MUFU ops) that the padding would multiply
        if const_expr(self.score_fn is None):
            if const_expr(not scale_later):
                acc_s.store(acc_s.load() * scale_log2)
        else:
            for h in cutlass.range_constexpr(2):
                if row0 + tScS[0][0] + 8 * h < n_rows:
                    self.score_mod(acc_s, tScS, scale, b, kv_head, row0, blk, score_tensors, h)
        if const_expr(self.mask_fn is not None):
            if partial:
                for h in cutlass.range_constexpr(2):
                    if row0 + tScS[0][0] + 8 * h < n_rows:
                        self.mask_mod(acc_s, tScS, b, kv_head, row0, blk, mask_tensors, h)

    def score_mod(self, acc_s: cute.Tensor, tScS: cute.Tensor, scale: Float32, b: Int32, kv_head: Int32,
                  row0: Int32, blk: Int32, tensors: tuple, half: int):
        """x = score_mod(s * scale, b, h, q, kv) * log2(e) per element of the thread's row `half`.
        Padding columns get scores too, never used; padding rows are skipped by the caller and
        keep raw scores, never stored."""
        tensors = [t for t in tensors if t is not None]
        for v in row_half(cute.size(acc_s), half):
            head, pos = self.rows.unpack(row0 + tScS[v][0], kv_head)
            x = self.score_fn(acc_s[v] * scale, b, head, pos, blk * self.kvb + tScS[v][1], tensors)
            acc_s[v] = x * LOG2E

    def mask_mod(self, acc_s: cute.Tensor, tScS: cute.Tensor, b: Int32, kv_head: Int32, row0: Int32,
                 blk: Int32, tensors: tuple, half: int):
        """x = -inf where mask_mod(b, h, q, kv) is False, per element of the thread's row `half`."""
        tensors = [t for t in tensors if t is not None]
        for v in row_half(cute.size(acc_s), half):
            head, pos = self.rows.unpack(row0 + tScS[v][0], kv_head)
            keep = self.mask_fn(b, head, pos, blk * self.kvb + tScS[v][1], tensors)
            acc_s[v] = Float32(cutlass.select_(keep, acc_s[v], Float32(NEG_INF)))

    @cute.jit
    def mask_transposed(self, acc_t: cute.Tensor, tTcT: cute.Tensor, b: Int32, head: Int32, key0: Int32,
                        kv_len: Int32, q0: Int32, q_len: Int32, tensors: tuple):
        """A transposed tile (rows keys from key0, columns queries from q0, as a backward's S^T)
        at -inf where mask_mod(b, head, q, kv) is False; elements past either length are left
        alone (the caller's padding keeps them out) and never index the captured tensors."""
        for v in cutlass.range_constexpr(cute.size(acc_t)):
            kv, q = key0 + tTcT[v][0], q0 + tTcT[v][1]
            if kv < kv_len and q < q_len:
                self._mask_element(acc_t, v, b, head, q, kv, tensors)

    def _mask_element(self, acc: cute.Tensor, v: int, b: Int32, head: Int32, q: Int32, kv: Int32, tensors: tuple):
        keep = self.mask_fn(b, head, q, kv, [t for t in tensors if t is not None])
        acc[v] = Float32(cutlass.select_(keep, acc[v], Float32(NEG_INF)))


class ScoreGrad:
    """A score program and its derivative with respect to the score (score_grad.tangent), for
    the backward kernels: dS of the raw score is dS of the modified one times the derivative."""

    def __init__(self, score_program: str, score_dtypes: tuple):
        program, result, derivative = tangent(score_program, score_dtypes)
        self.fn = make_score_fn(program, score_dtypes, outputs=(result, derivative))

    def element(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, v: int, scale: Float32, b: Int32, head: Int32,
                q: Int32, kv: Int32, delta: Float32, tensors: list):
        """Element v: S (raw) becomes x = score_mod(s * scale) * log2(e), dP becomes
        (dP - delta) * d score_mod / d score (times P later, where P is known)."""
        x, derivative = self.fn(acc_s[v] * scale, b, head, q, kv, tensors)
        acc_s[v] = x * LOG2E
        acc_dp[v] = (acc_dp[v] - delta) * derivative


@cute.jit
def mask_past_end(acc_s: cute.Tensor, tScS: cute.Tensor, kv_block: int, blk: Int32, seq_len: Int32):
    """x = -inf for the keys of KV block `blk` at and past seq_len; only the block that holds the
    end of the sequence has any (a block mask's block may lie wholly past it)."""
    if (blk + 1) * kv_block > seq_len:
        for v in cutlass.range(cute.size(acc_s), unroll_full=True):
            if blk * kv_block + tScS[v][1] >= seq_len:
                acc_s[v] = Float32(NEG_INF)

