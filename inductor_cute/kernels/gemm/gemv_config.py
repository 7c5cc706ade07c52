"""Decode GEMM ("GEMV", M <= 16) on Hopper: configuration, limits, split heuristic and workspace
sizes. Plain Python, usable without the CuTe DSL.

    D (M, N) = epilogue(A (M, K) @ W (N, K)^T)     W an nn.Linear weight, read exactly once

One CTA streams `16 * warps` rows of W over one K slice of `k_slice` elements; a K longer than
the slice is split over CTAs (grid = N blocks x splits) whose fp32 partials the last CTA to
finish an N block sums in split order (deterministic) before the epilogue.

The same names as every config module of the family (see config.py): Problem (the shared
GemmProblem; the GEMV computes those with K-major A and B), Config, unsupported_reason,
candidates, default_config, spec.

A group of `weights` GEMVs sharing A (D_i = A @ W_i^T, as the q/k/v or gate/up projections of a
decode step) runs as one launch whose grid walks the N blocks of W_0, then W_1, ...: where these
functions take `n`, a group passes the N of each weight (a tuple) and sizes as for their summed
N blocks. Groups take the plain epilogue only (no bias, C, activation or program).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import config as gemm_config
from .config import ELEMENT_BYTES, SM_COUNT, SMEM_BUDGET, GemmProblem

MAX_M = 16  # the rows the GEMV is picked for by default and offered to autotuning
MAX_M_TILES = 4  # an explicit config's token tiles: M up to 32 (not yet run on a GPU past 2)
K_STEP = 32  # K elements a pipeline stage covers per vector (a 16-byte vector per thread and row)
MAX_REGISTERS = 64  # per thread; tests hold ptxas to it (occupancy)
MAX_SPLITS = 64
MAX_WEIGHTS = 3  # weights one group launch takes
KERNEL_MODULE = "inductor_cute.kernels.gemm.gemv_sm90"


@dataclass(frozen=True)
class GemvConfig:
    warps: int = 4  # each warp owns 16 rows of W (an mma.sync M of 16)
    k_slice: int = 512  # K elements per CTA; K > k_slice splits K over CTAs
    stages: int = 4  # cp.async ring depth: 32 * vecs bytes of W per thread and stage in flight
    m_tiles: int = 1  # 8 tokens per tile (the mma.sync N); 2 covers M up to 16, 4 up to 32
    # 16-byte vectors each thread copies per W row and stage (vectors t, t + 4, ... of the stage's
    # K): a warp's copies of one row are 64 * vecs contiguous bytes (a stage covers K_STEP * vecs)
    vecs: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def k_step(self) -> int:
        """K elements one stage covers."""
        return K_STEP * self.vecs

    @property
    def n_block(self) -> int:
        return 16 * self.warps

    def as_params(self) -> dict:
        """The fields, vecs left out at 1 (so the configs that predate it keep their kernel specs)."""
        params = dataclasses.asdict(self)
        if self.vecs == 1:
            del params["vecs"]
        return params

    def describe(self) -> str:
        wide = f" v{self.vecs}" if self.vecs > 1 else ""
        return f"gemv w{self.warps} k{self.k_slice} s{self.stages} m{8 * self.m_tiles}{wide}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def smem_bytes(cfg: GemvConfig, ab_bytes: int = 2) -> int:
    """W ring (two rows of `vecs` 16-byte vectors per thread and stage), the A slice, and a
    16-byte flag."""
    ring = cfg.stages * cfg.threads * 2 * 16 * cfg.vecs
    a_slice = 8 * cfg.m_tiles * cfg.k_slice * ab_bytes
    return ring + a_slice + 16


def splits(k: int, cfg: GemvConfig) -> int:
    return _ceil_div(k, cfg.k_slice)


def n_blocks(n: int | tuple[int, ...], cfg: GemvConfig) -> int:
    """CTAs along N: the N blocks of one weight, or of every weight of a group (one tuple entry each)."""
    return sum(_ceil_div(x, cfg.n_block) for x in _sizes(n))


def _sizes(n) -> tuple:
    """The N of each weight: a tuple or list for a group, one size otherwise."""
    return tuple(n) if isinstance(n, (tuple, list)) else (n,)


def unsupported_reason(problem: GemmProblem, config: GemvConfig | None = None, *, m: int | None = None,
                       n: int | tuple[int, ...] | None = None, k: int | None = None, batch: int = 1,
                       weights: int = 1) -> str | None:
    """Why the GEMV (over `weights` weights sharing A) cannot run `problem` (with `config`, at the
    sizes given), in one line; None when it can."""
    p = problem
    err = gemm_config.unsupported_reason(p)
    if err:
        return err
    if p.a_major != "k" or p.b_major != "k":
        return "gemv needs A row-major (M, K) and B = W.t() for a row-major W (N, K)"
    if batch != 1:
        return "gemv is not batched"
    if not 1 <= weights <= MAX_WEIGHTS:
        return f"gemv takes 1..{MAX_WEIGHTS} weights sharing A, got {weights}"
    if weights > 1 and (p.has_bias or p.has_c or p.activation != "identity" or p.epilogue):
        return "gemv over several weights takes no bias, C, activation or epilogue program"
    if isinstance(n, (tuple, list)) and len(n) != weights:
        return f"gemv over {weights} weights needs {weights} N sizes, got {len(n)}"
    most = MAX_M if config is None else 8 * MAX_M_TILES  # (the config's own tiles are checked below)
    if m is not None and not 1 <= m <= most:
        return f"gemv handles M in 1..{most}, got M={m}"
    ns = () if n is None else _sizes(n)
    if any(x < 1 or x % 8 for x in ns) or (k is not None and (k < 1 or k % 8)):
        return f"gemv needs N and K positive multiples of 8 (16-byte rows), got N={n}, K={k}"
    return None if config is None else _config_reason(config, p, m, k)


def _config_reason(c: GemvConfig, p: GemmProblem, m: int | None, k: int | None) -> str | None:
    if c.warps not in (1, 2, 4, 8):
        return "warps must be 1, 2, 4 or 8"
    if not 1 <= c.m_tiles <= MAX_M_TILES:
        return f"m_tiles must be 1 to {MAX_M_TILES} (8 tokens each)"
    if c.vecs not in (1, 2):  # 4 spills at the register cap (ptxas, CuTe DSL 4.8.1)
        return "vecs must be 1 or 2"
    if c.vecs > 1 and c.m_tiles > 2:  # spills at the register cap too
        return "vecs = 2 takes at most 2 token tiles (M <= 16)"
    if c.k_slice % c.k_step or c.k_slice < c.k_step:
        return f"k_slice must be a positive multiple of {c.k_step} (K_STEP * vecs)"
    if c.stages < 2:
        return "at least 2 pipeline stages"
    need = smem_bytes(c, ELEMENT_BYTES[p.dtype_name])
    if need > SMEM_BUDGET:
        return f"shared memory {need} B exceeds {SMEM_BUDGET} B"
    if m is not None and m > 8 * c.m_tiles:
        return f"M={m} needs m_tiles={_ceil_div(m, 8)}"
    if k is not None and splits(k, c) > MAX_SPLITS:
        return f"K={k} over k_slice={c.k_slice} gives more than {MAX_SPLITS} splits"
    return None


def default_config(problem: GemmProblem, m: int, n: int | tuple[int, ...], k: int, batch: int = 1,
                   num_sms: int = SM_COUNT) -> GemvConfig:
    """8 warps and an 8-deep ring; K split over the fewest CTAs that still put three quarters of
    the SMs to work (each split adds partial traffic and a reduction), and over more only where
    the A slice would not fit in shared memory. In the H200 sweep (benchmarks/results/
    gemv-config-sweep-h200-20261203.txt) this pick is within 4% of the best of 56 configs on the
    measured decode shapes; the previous one (4 warps, 4 stages, splits filling 4 CTAs per SM)
    was 5-12% slower. It may still not run K past MAX_SPLITS full A slices (unsupported_reason
    with the config says so)."""
    ab_bytes = ELEMENT_BYTES[problem.dtype_name]
    m_tiles = min(_ceil_div(m, 8), MAX_M_TILES)
    base = GemvConfig(warps=8, stages=8, m_tiles=m_tiles)
    steps = _ceil_div(k, K_STEP)
    ring = smem_bytes(dataclasses.replace(base, k_slice=0), ab_bytes)
    max_slice = max(K_STEP, (SMEM_BUDGET - ring) // (ab_bytes * 8 * m_tiles) // K_STEP * K_STEP)
    wanted = max(_ceil_div(3 * num_sms, 4 * n_blocks(n, base)), _ceil_div(k, max_slice))
    wanted = min(wanted, MAX_SPLITS, steps)
    return dataclasses.replace(base, k_slice=_line_aligned_slice(steps, wanted, ab_bytes, max_slice))


LINE_BYTES = 128  # an L2 line


def _line_aligned_slice(steps: int, wanted_splits: int, ab_bytes: int = 2, max_slice: int | None = None) -> int:
    """K elements per split for `wanted_splits` splits of `steps` K steps, rounded up to whole
    128-byte lines of a W row (where that still fits `max_slice`): every split then starts its
    rows on a line boundary. In the H200 sweep (sweep-gemv-quick-h200-20261204-s13.txt) the one
    default whose slice was not (8 x 6144 x 4096: 3 splits of 1376, 2752 bytes) took 19.6 us
    graph-timed where 2 and 4 splits of whole lines took 17.3 and 18.1."""
    k_slice = _ceil_div(steps, wanted_splits) * K_STEP
    line = max(K_STEP, LINE_BYTES // ab_bytes)
    aligned = _ceil_div(k_slice, line) * line
    return aligned if max_slice is None or aligned <= max_slice else k_slice


def candidates(problem: GemmProblem, m: int, n: int | tuple[int, ...], k: int, batch: int = 1,
               num_sms: int = SM_COUNT, exhaustive: bool = False) -> list[GemvConfig]:
    """The default first, then the alternates that won somewhere in the sweep: half and twice
    the split count, and 4 warps (more CTAs per SM); those that can run M and K only. The set is
    the same when `exhaustive`."""
    best = default_config(problem, m, n, k, batch, num_sms)
    out = [best]
    steps = _ceil_div(k, K_STEP)
    for s in (splits(k, best) * 2, max(1, splits(k, best) // 2)):
        s = min(s, MAX_SPLITS, steps)
        out.append(dataclasses.replace(best, k_slice=_line_aligned_slice(steps, s, ELEMENT_BYTES[problem.dtype_name])))
    out.append(dataclasses.replace(best, warps=4, stages=6))
    unique = []
    for cfg in out:
        if cfg not in unique and _config_reason(cfg, problem, m, k) is None:
            unique.append(cfg)
    return unique


def workspace_sizes(n: int | tuple[int, ...], k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(fp32 partials, int32 counters) the kernel needs: one accumulator fragment per thread, N
    block (over every weight of a group) and split; one arrival counter per N block. Allocate the
    counters zeroed once: every call leaves them zero again. The kernel always takes both; without
    a split it touches neither (partials: any multiple of 8 elements, at least 8)."""
    blocks = n_blocks(n, cfg)
    s = splits(k, cfg)
    partials = s * blocks * cfg.threads * 4 * cfg.m_tiles if s > 1 else 8
    return partials, blocks


def spec(problem: GemmProblem, config: GemvConfig, num_sms: int = SM_COUNT, weights: int = 1):
    """The KernelSpec of one GEMV kernel over `weights` weights sharing A (its grid does not depend
    on the SM count). One weight's spec has no `weights` parameter (the same key as before groups)."""
    from ...runtime.spec import KernelSpec

    group = {"weights": weights} if weights > 1 else {}
    return KernelSpec.make(KERNEL_MODULE, **problem.as_params(), **config.as_params(), **group)


Problem, Config = GemmProblem, GemvConfig
