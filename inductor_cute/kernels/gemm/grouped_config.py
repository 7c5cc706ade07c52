"""Grouped GEMM for MoE on Hopper (the forward form of `torch._grouped_mm`): the problem,
configurations, limits, candidates and kernel specs. Plain Python, usable without the CuTe DSL.

    out[offs[g-1]:offs[g], :] = a[offs[g-1]:offs[g], :] @ b[g]      (offs[-1] taken as 0)

a (total_tokens, K) row-major, b (E, K, N), offs int32 (E,) cumulative group ends on the device,
out (total_tokens, N) row-major. Group sizes are read on the device only: one persistent launch,
no host sync. Gated (problem.gate = an activation name): b has 2F columns, gate then up, and

    out[offs[g-1]:offs[g], :] = act(a_g @ b[g][:, :F]) * (a_g @ b[g][:, F:])      out (total_tokens, F)

The gate's gradient (problem.gate_grad = "silu"): b has F columns, gate and up (total_tokens, F)
are the up projection's saved product's halves, and with y_g = a_g @ b[g] (the down projection's
input gradient, never stored)

    out[rows, :F] = y * up * silu'(gate),  out[rows, F:] = y * silu(gate)      out (total_tokens, 2F)

Same names as config.py (see there): Problem, Config, unsupported_reason, candidates,
default_config, spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import EPI_N, EPI_STAGES, SM_COUNT, SMEM_BUDGET

KERNEL_MODULE = "inductor_cute.kernels.gemm.grouped_sm90"
INPUT_DTYPES = ("bfloat16",)
ELEMENT_BYTES = {"bfloat16": 2}
# The kernel keeps the groups' row ends and tile prefix in shared memory: one Int32 each per group.
MAX_GROUPS = 512
MAX_STAGES = 8
# activations a gated problem takes (kernels/common/activations.py)
GATES = ("silu", "gelu_tanh", "gelu_erf", "relu", "sigmoid", "tanh")
GATE_GRADS = ("silu",)  # activations whose gated product's gradient the epilogue computes
ROW_INDEX_DTYPES = ("int32", "int64")  # of a gathered problem's row index


@dataclass(frozen=True)
class GroupedProblem:
    """What a compiled grouped GEMM is specialised on; sizes and the group count stay dynamic."""

    dtype_name: str = "bfloat16"  # a and b
    out_dtype_name: str = "bfloat16"
    a_major: str = "k"  # a row-major (tokens, K)
    b_major: str = "k"  # "k": b[g] is the transposed view of an (N, K) row-major weight; "n": (K, N) row-major
    gate: str = ""  # gated: the activation of the gate half (GATES), fused with the product by the up half
    # gathered: the dtype (ROW_INDEX_DTYPES) of a row index: out's row r is computed from a[rows[r]]
    # (the MoE permute's gather fused into the A loads); "": a's rows in order
    rows: str = ""
    # the gate's gradient: the activation (GATE_GRADS) of a gated product whose saved gate and up
    # the epilogue reads to turn the product (the gate's output gradient) into [gate | up]'s gradient
    gate_grad: str = ""

    def as_params(self) -> dict:
        params = dataclasses.asdict(self)
        for name in ("rows", "gate_grad"):  # the specs that predate them keep their keys
            if not params[name]:
                del params[name]
        return params


@dataclass(frozen=True)
class GroupedConfig:
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    consumer_warpgroups: int = 2  # both share every tile (cooperative), 64 rows each
    # a cluster of cluster_m x cluster_n CTAs takes a block of tiles of one group: cluster_m = 2
    # shares (multicasts) the weight tile between two row tiles, cluster_n = 2 the token rows
    # between two column tiles
    cluster_m: int = 1
    cluster_n: int = 1
    # the producer also asks L2 for the weight's k-tile this many k-steps ahead (TMA prefetch), so
    # HBM latency hides beyond the smem ring's `stages`; 0: off. Within a tile only: its first
    # `prefetch` k-steps are not prefetched
    prefetch: int = 0
    # a group's last row tile, where it would end past the group's rows, starts tile_m rows before
    # the group's end instead (grouped_tile_map.tile_first_row): stored whole by TMA, not by the
    # per-element predicated stores a partial tile needs; only groups under tile_m rows keep those
    overlap_last: bool = False
    # a partial tile (the group's rows end inside it) is stored through the staging buffer in
    # 16-byte pieces of its rows, not by 2-byte predicated stores from registers
    staged_partial: bool = False
    # (the weight gradient's) the epilogue stages the whole output tile in shared memory, one
    # buffer per subtile, and its TMA stores drain while the next unit's mainloop runs: two barriers
    # a tile instead of two a subtile, and no wait for a buffer within the tile
    store_whole_tile: bool = False
    # (128-row tiles, two consumer warp groups) a warp group whose 64 rows all lie past the group's
    # rows issues no MMAs, and with overlap_last a group's last tile holding at most tile_m / 2 of
    # its rows keeps its place (a partial tile, one warp group's MMAs) instead of recomputing
    # tile_m / 2 rows or more of the tile before it. On Qwen3-30B-A3B's routing at 4096 tokens
    # (groups of 198-300 rows, 128-row tiles) about half the groups end in such a tile
    half_tiles: bool = False
    # (the weight gradient's) the two consumer warp groups take alternate work units, each a whole
    # tile_m x tile_n tile, and take turns at their mainloops: one's epilogue (and boundary masks)
    # runs under the other's MMAs. Units of a few hundred tokens spend as long storing as computing
    pingpong: bool = False

    def as_params(self) -> dict:
        """The fields, those added later left out when off (the specs that predate them keep their
        keys)."""
        params = dataclasses.asdict(self)
        for name in ("prefetch", "overlap_last", "staged_partial", "store_whole_tile", "half_tiles", "pingpong"):
            if not params[name]:
                del params[name]
        return params

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    def describe(self) -> str:
        cluster = f" cluster {self.cluster_m}x{self.cluster_n}" if self.cluster_size > 1 else ""
        prefetch = f" prefetch {self.prefetch}" if self.prefetch else ""
        overlap = " overlap-last" if self.overlap_last else ""
        staged = " staged-partial" if self.staged_partial else ""
        whole = " whole-tile-store" if self.store_whole_tile else ""
        half = " half-tiles" if self.half_tiles else ""
        pingpong = " pingpong" if self.pingpong else ""
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k} stages {self.stages} wg {self.consumer_warpgroups}"
                f"{cluster}{prefetch}{overlap}{staged}{whole}{half}{pingpong}")


def table_bytes(max_groups: int = MAX_GROUPS) -> int:
    """Shared memory of the group tables: row ends and tile prefix, (max_groups + 1) Int32 each."""
    return 2 * 4 * (max_groups + 1)


def smem_bytes(cfg: GroupedConfig, ab_bytes: int = 2, out_bytes: int = 2, tables: int = 2) -> int:
    """Shared memory of one CTA with `tables` group tables (the forward keeps 2, the weight
    gradient 1); the outgoing D buffers are two subtiles per tile in progress (ping-pong: per warp
    group), or the whole tile (store_whole_tile; ping-pong's warp groups share it in turn)."""
    ab = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * ab_bytes * cfg.stages
    epi = 64 * cfg.consumer_warpgroups * EPI_N * out_bytes * EPI_STAGES  # outgoing D subtiles (either schedule)
    if cfg.store_whole_tile:
        epi = cfg.tile_m * cfg.tile_n * out_bytes
    total = 1024 + ab + epi + table_bytes() * tables // 2  # 1 KB for mbarriers
    return -(-total // 1024) * 1024  # the shared-storage struct is 1 KB aligned


def unsupported_reason(problem: GroupedProblem, config: GroupedConfig | None = None, *,
                       n: int | None = None, k: int | None = None, groups: int | None = None) -> str | None:
    """Why the grouped GEMM cannot run `problem` (with `config`; at these sizes where given), in
    one line; None when it can."""
    p = problem
    if p.dtype_name not in INPUT_DTYPES or p.out_dtype_name not in INPUT_DTYPES:
        return f"dtypes {p.dtype_name} -> {p.out_dtype_name} are not supported (use bfloat16)"
    if p.a_major != "k":
        return "a must be row-major (tokens, K)"
    if p.b_major not in ("k", "n"):
        return "b_major must be 'k' or 'n'"
    if p.rows and p.rows not in ROW_INDEX_DTYPES:
        return f"row index dtype {p.rows!r} is not one of {', '.join(ROW_INDEX_DTYPES)}"
    if p.gate and p.gate not in GATES:
        return f"gate activation {p.gate!r} is not one of {', '.join(GATES)}"
    if p.gate_grad and (p.gate_grad not in GATE_GRADS or p.gate or p.rows):
        return f"the gate's gradient takes {', '.join(GATE_GRADS)}, without a gate or gathered rows"
    if p.gate_grad and n is not None and n % EPI_N:
        # an epilogue subtile's columns lie wholly in the gate half or wholly past it: the gate
        # half's TMA stores clip only at the output's edge, past the up half
        return f"the gate's gradient: N={n} must be a multiple of {EPI_N}"
    if p.gate and n is not None and (n < 2 or n % 16):
        return f"gated: the weight's N={n} (gate and up) must be a positive multiple of 16 (8 output columns)"
    if n is not None and (n < 1 or n % 8):
        return f"N={n} must be a positive multiple of 8 (16-byte rows for TMA)"
    if k is not None and (k < 1 or k % 8):
        return f"K={k} must be a positive multiple of 8 (16-byte rows for TMA)"
    if groups is not None and not 1 <= groups <= MAX_GROUPS:
        return f"{groups} groups: between 1 and {MAX_GROUPS} are supported"
    return None if config is None else _config_reason(config, p)


def _config_reason(c: GroupedConfig, p: GroupedProblem) -> str | None:
    if c.store_whole_tile:
        return "store_whole_tile is the weight gradient's (the forward stores through two subtile buffers)"
    if c.pingpong:
        return "pingpong is the weight gradient's (the forward's consumers share every tile)"
    if p.rows and (c.tile_k != 64 or c.cluster_n != 1):
        # 128 producer threads copy 16 rows of 8 pieces a pass, their tokens in registers; a 1x2
        # cluster would multicast token rows that each CTA gathers itself
        return "gathered rows: tile_k must be 64 and clusters 1x1 or 2x1"
    if p.gate and c.tile_k != 64:
        # at tile_k 64 the half tiles' layout addresses a stage as the whole tile's does
        return "gated: tile_k must be 64"
    if p.gate and (c.tile_n // 2) % 64:
        # a half tile of 64 columns or more gets the whole tile's 128-byte swizzle (an N-major
        # weight's swizzle follows the tile's width: at 32 or 96 columns the halves would not
        # address the stage as the whole tile does)
        return "gated: tile_n must be a multiple of 128"
    if c.prefetch and not c.stages < c.prefetch <= 64:
        # within the tile's own k-steps: the ring already loads `stages` ahead
        return f"prefetch must be 0 or more than the {c.stages} stages (at most 64) k-steps ahead"
    if c.cluster_m not in (1, 2) or c.cluster_n not in (1, 2):
        return "clusters of 1x1, 2x1, 1x2 or 2x2 CTAs are supported"
    if c.cluster_size > 2 and c.tile_m != 128:
        return "2x2 clusters take 128-row tiles"
    if c.consumer_warpgroups not in (1, 2):
        return "consumer_warpgroups must be 1 or 2"
    if c.half_tiles and (c.consumer_warpgroups != 2 or c.tile_m != 128):
        return "half_tiles needs 128-row tiles of two consumer warp groups (a half tile is one warp group's 64 rows)"
    if c.tile_m % (64 * c.consumer_warpgroups) or not 64 <= c.tile_m <= 256:
        return "tile_m must be a multiple of 64 * consumer_warpgroups, at most 256"
    if c.tile_n % EPI_N or not EPI_N <= c.tile_n <= 256:
        return f"tile_n must be a multiple of {EPI_N} in [{EPI_N}, 256]"
    if c.tile_k % 16 or not 16 <= c.tile_k <= 128:
        return "tile_k must be a multiple of 16 in [16, 128]"
    if c.tile_m * c.tile_n // (128 * c.consumer_warpgroups) > 128:
        return "accumulator exceeds 128 fp32 registers per thread"
    if c.stages < 2:
        return "at least 2 pipeline stages"
    need = smem_bytes(c, ELEMENT_BYTES[p.dtype_name], ELEMENT_BYTES[p.out_dtype_name])
    if need > SMEM_BUDGET:
        return f"shared memory {need} B exceeds {SMEM_BUDGET} B"
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def max_work_units(tokens: int, n: int, groups: int, tile_m: int, tile_n: int,
                   cluster_mn: tuple[int, int] = (1, 1)) -> int:
    """An upper bound of the work units (cluster blocks of tiles), known without reading the
    offsets: each group adds at most one partial row of blocks to ceil(tokens / block rows) full
    ones (the kernel's launch bound)."""
    cm, cn = cluster_mn
    return _ceil_div(_ceil_div(n, tile_n), cn) * (_ceil_div(tokens, tile_m * cm) + groups)


def _deepest(cfg: GroupedConfig, p: GroupedProblem) -> GroupedConfig | None:
    for stages in range(MAX_STAGES, 1, -1):
        candidate = dataclasses.replace(cfg, stages=stages)
        if _config_reason(candidate, p) is None:
            return candidate
    return None


# (tile_m, tile_n, consumer warp groups), largest first
_SHAPES = ((128, 256, 2), (128, 128, 2), (64, 256, 1), (64, 128, 1))


def default_config(problem: GroupedProblem, tokens: int, n: int, k: int | None = None, groups: int = 1,
                   num_sms: int = SM_COUNT) -> GroupedConfig:
    """Untuned heuristic from the mean group size (the offsets are on the device): 64-row tiles
    when groups average at most 64 tokens, else the largest tile that still gives a wave; where
    groups average two row tiles or more, in clusters: of two column tiles sharing the token rows
    where N spans two column tiles, else of two row tiles sharing the weight tile. On even
    splits 2x1 led (H200, sweep_grouped of the seventeenth session, 128x256 tiles, TFLOP/s plain
    -> 2x1: DeepSeek-V3 up 16384 tokens 638 -> 761, Mixtral up 755 -> 787); on routed group sizes,
    which models have, 1x2 did (grouped_routing.py, H200, the MoE block's routing, us: Qwen3-30B-A3B
    up T16384 1x2 1317, 2x1 1467; down 745 and 813; at T4096 2x1 ahead by 2-5%: 494 against 502,
    301 against 317; Qwen3 up with skewed routing in the seventeenth session: 1x2 642, 2x1 582
    TFLOP/s). Autotuning tries both."""
    mean_rows = tokens / max(groups, 1)
    shapes = [s for s in _SHAPES if s[0] == 64] if mean_rows <= 64 else [s for s in _SHAPES if s[0] == 128]
    chosen = shapes[-1]
    for shape in shapes:
        tiles = _ceil_div(n, shape[1]) * max(groups, 1) * _ceil_div(max(int(mean_rows), 1), shape[0])
        if tiles >= num_sms:
            chosen = shape
            break
    plain = _deepest(GroupedConfig(chosen[0], chosen[1], 64, MAX_STAGES, chosen[2]), problem)
    shapes = cluster_shapes(tokens, n, groups, *chosen[:2]) if CLUSTERS_GPU_CHECKED and chosen[0] == 128 else []
    if (2, 1) in shapes:  # groups of two row tiles or more (measured there); 1x2 where N allows
        cluster = (1, 2) if (1, 2) in shapes and not problem.rows else (2, 1)  # gathered rows: no 1x2
        plain = _deepest(GroupedConfig(chosen[0], chosen[1], 64, MAX_STAGES, chosen[2], *cluster), problem) or plain
    return _with_checked_edge_stores(plain)


# Every config stores a group's last row tile whole (overlap_last) and the remaining partial tiles
# through the staging buffer (staged_partial) once their GPU tests have passed: autotuning checks
# no results. Written in the twenty-third session; passed on an H100 in the twenty-fourth
# (test_grouped_gemm_gpu.py, 300 passed), where on the MoE block's routing they took our 128x256
# config's up projection (with its gather) from 891 to 598 us at 4096 tokens (grouped_gather.py).
OVERLAP_LAST_GPU_CHECKED = True
STAGED_PARTIAL_GPU_CHECKED = True


def _with_checked_edge_stores(cfg: GroupedConfig | None) -> GroupedConfig | None:
    if cfg is None:
        return None
    return dataclasses.replace(cfg, overlap_last=cfg.overlap_last or OVERLAP_LAST_GPU_CHECKED,
                               staged_partial=cfg.staged_partial or STAGED_PARTIAL_GPU_CHECKED)


# Cluster configs join the candidates (and the default) once their GPU tests have passed:
# autotuning checks no results, so an unproven kernel must not compete. They passed on the H200 in
# the seventeenth session (test_grouped_gemm_gpu.py -k "cluster or gated": 120 passed).
CLUSTERS_GPU_CHECKED = True


def cluster_shapes(tokens: int, n: int, groups: int, tile_m: int, tile_n: int,
                   square: bool = False) -> list[tuple[int, int]]:
    """The clusters worth trying for this tile: 2x1 (two row tiles share the weight tile) when
    groups average two row tiles or more, 1x2 (two column tiles share the token rows) when N
    spans two column tiles or more, and with `square` 2x2 (four tiles share both) where both do."""
    out = []
    if tokens / max(groups, 1) >= 2 * tile_m:
        out.append((2, 1))
    if _ceil_div(n, tile_n) >= 2:
        out.append((1, 2))
    if square and len(out) == 2:
        out.append((2, 2))
    return out


# 2x2 clusters (four tiles of one group share both operands' blocks) passed their GPU tests on an H100
# in the twenty-ninth session (-k 2x2: 64 passed) but lost everywhere on the MoE block's routing at
# 4096 tokens: 1.7-2x the time of our best (grouped-rounds-h100-20261206-s29.txt). That card fits only
# 30 clusters of 4 at once and we launched 32, so two ran their shares as a second wave (Nsight
# Compute: every throughput halved); TileScheduler.max_clusters now launches 29. Half the measured
# time scaled by 32/29 predicts one wave: up forward ~436 us (1x2 half tiles took 436.8, Triton 423.5),
# down input gradient at 128x128 ~232 (our best 235.1): no clear win, as groups of 198-300 rows pad
# 2x2 clusters of 128-row tiles to 512 rows. Not offered until re-timed; asked for with
# `clusters=True`; never for gathered rows.
CLUSTERS_2X2_OFFERED = False


# Half tiles (GroupedConfig.half_tiles) join the candidates, as twins of the 128-row configs of two
# consumer warp groups, since their GPU tests passed (test_grouped_gemm_gpu.py -k half: 13 passed on an
# H100 in the twenty-eighth session). On the MoE block's routing at 4096 tokens (groups of 198-300 rows,
# grouped-rounds-h100-20261206-s28.txt) they took our best up forward from 456.5 to 430.0 us, the up
# input gradient from 462.9 to 427.2 and the down forward from 236.8 to 233.4; the down input gradient
# lost (228.6 -> 243.7), so autotuning weighs both twins.
HALF_TILES_GPU_CHECKED = True


def candidates(problem: GroupedProblem, tokens: int, n: int, k: int | None = None, groups: int = 1,
               num_sms: int = SM_COUNT, exhaustive: bool = False,
               clusters: bool | None = None, half_tiles: bool | None = None) -> list[GroupedConfig]:
    """Valid configs: the heuristic default first, then the other tile shapes at their deepest
    pipelines (and tile_k 128 with `exhaustive`), then the 128-row shapes in clusters (with
    `clusters`, by default once CLUSTERS_GPU_CHECKED; 2x2 ones by default if
    CLUSTERS_2X2_OFFERED, never with gathered rows), then the half-tile twins of the 128-row
    ones of two consumer warp groups (with `half_tiles`, by default once HALF_TILES_GPU_CHECKED)."""
    out = [default_config(problem, tokens, n, k, groups, num_sms)]
    for tm, tn, wg in _SHAPES:
        for tk in ((64, 128) if exhaustive else (64,)):
            cfg = _deepest(GroupedConfig(tm, tn, tk, MAX_STAGES, wg), problem)
            if cfg is not None and cfg not in out:
                out.append(cfg)
    if CLUSTERS_GPU_CHECKED if clusters is None else clusters:
        square = (CLUSTERS_2X2_OFFERED if clusters is None else clusters) and not problem.rows
        for tm, tn, wg in _SHAPES[:2]:
            for cm, cn in cluster_shapes(tokens, n, groups, tm, tn, square):
                cfg = _deepest(GroupedConfig(tm, tn, 64, MAX_STAGES, wg, cm, cn), problem)
                if cfg is not None and cfg not in out:
                    out.append(cfg)
    out = list(dict.fromkeys(_with_checked_edge_stores(c) for c in out))
    if HALF_TILES_GPU_CHECKED if half_tiles is None else half_tiles:
        out += [dataclasses.replace(c, half_tiles=True) for c in out if c.consumer_warpgroups == 2 and c.tile_m == 128]
    return out


def spec(problem: GroupedProblem, config: GroupedConfig, num_sms: int = SM_COUNT):
    """The KernelSpec of one grouped GEMM kernel."""
    from ...runtime.spec import KernelSpec

    return KernelSpec.make(KERNEL_MODULE, num_sms=num_sms, **problem.as_params(), **config.as_params())


Problem, Config = GroupedProblem, GroupedConfig
