"""The weight-gradient form of `torch._grouped_mm` (MoE backward): problem, limits, candidates and
kernel specs. Plain Python, usable without the CuTe DSL.

    out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g], :]      (offs[-1] taken as 0)

a (M, T), b (T, N), offs int32 (E,) cumulative group ends over the tokens T on the device, out
(E, M, N) row-major: the groups split the reduction, so every group has a whole (M, N) output
(zeros for an empty group). Autograd of `_grouped_mm(x, w.transpose(-2, -1), offs)` calls it with
a = grad_out.t() (M-major) and b = x (N-major). Tiles and stages are the forward's GroupedConfig;
tile_k counts tokens. Same names as grouped_config.py: Problem, Config, unsupported_reason,
candidates, default_config, spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import grouped_config
from .config import SM_COUNT, SMEM_BUDGET
from .grouped_config import MAX_GROUPS, MAX_STAGES, GroupedConfig

KERNEL_MODULE = "inductor_cute.kernels.gemm.grouped_wgrad_sm90"


@dataclass(frozen=True)
class WgradProblem:
    """What a compiled weight-gradient kernel is specialised on; sizes and the group count stay
    dynamic."""

    dtype_name: str = "bfloat16"  # a and b
    out_dtype_name: str = "bfloat16"
    a_major: str = "m"  # "m": a (M, T) is the transposed view of a row-major (T, M); "k": tokens contiguous
    b_major: str = "n"  # "n": b (T, N) row-major; "k": tokens contiguous

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def unsupported_reason(problem: WgradProblem, config: GroupedConfig | None = None, *,
                       m: int | None = None, n: int | None = None, groups: int | None = None) -> str | None:
    """Why the weight-gradient kernel cannot run `problem` (with `config`; at these sizes where
    given), in one line; None when it can."""
    p = problem
    if p.dtype_name not in grouped_config.INPUT_DTYPES or p.out_dtype_name not in grouped_config.INPUT_DTYPES:
        return f"dtypes {p.dtype_name} -> {p.out_dtype_name} are not supported (use bfloat16)"
    if p.a_major not in ("m", "k") or p.b_major not in ("n", "k"):
        return "a_major must be 'm' or 'k' and b_major 'n' or 'k'"
    if m is not None and (m < 1 or m % 8):
        return f"M={m} must be a positive multiple of 8 (16-byte rows of the output for TMA)"
    if n is not None and (n < 1 or n % 8):
        return f"N={n} must be a positive multiple of 8 (16-byte rows of the output for TMA)"
    if groups is not None and not 1 <= groups <= MAX_GROUPS:
        return f"{groups} groups: between 1 and {MAX_GROUPS} are supported"
    if config is None:
        return None
    if config.prefetch or config.overlap_last or config.staged_partial or config.half_tiles:
        return ("the weight gradient runs without prefetch, overlap_last, staged_partial or half_tiles (its groups "
                "split K)")
    if config.store_whole_tile and config.tile_k != 64:
        return "the whole-tile store takes tile_k 64 (the form its GPU tests run)"
    if config.cluster_size > 1 and (config.tile_m != 128 or config.tile_k != 64):
        return "weight-gradient clusters take 128-row tiles at tile_k 64 (the forms their GPU tests run)"
    if config.cluster_size > 2 and not config.pingpong:
        # cooperative units are bound by their serial phases, not their operand reads (2-CTA clusters
        # gained nothing), so a larger cluster would not help them
        return "clusters of more than 2 CTAs (2x2) are ping-pong's"
    if config.pingpong and (config.consumer_warpgroups != 2
                            or (config.tile_m, config.tile_n, config.tile_k) != (128, 128, 64)):
        # a warp group's whole tile in its registers: 128 x 128 fp32 is 128 a thread
        return "pingpong takes 128x128x64 tiles of two consumer warp groups"
    # the forward's rules (cluster shapes among them); they budget two group tables where this kernel
    # keeps one (2 KB slack)
    reason = grouped_config.unsupported_reason(grouped_config.GroupedProblem(p.dtype_name, p.out_dtype_name),
                                               dataclasses.replace(config, store_whole_tile=False, pingpong=False))
    if reason is None and config.store_whole_tile:  # the whole tile's buffer beside the ring, one table
        need = grouped_config.smem_bytes(config, grouped_config.ELEMENT_BYTES[p.dtype_name],
                                         grouped_config.ELEMENT_BYTES[p.out_dtype_name], tables=1)
        if need > SMEM_BUDGET:
            return f"shared memory {need} B exceeds {SMEM_BUDGET} B (the whole tile staged)"
    return reason


def _deepest(cfg: GroupedConfig, p: WgradProblem) -> GroupedConfig | None:
    for stages in range(MAX_STAGES, 1, -1):
        candidate = dataclasses.replace(cfg, stages=stages)
        if unsupported_reason(p, candidate) is None:
            return candidate
    return None


def work_units(m: int, n: int, groups: int, tile_m: int, tile_n: int) -> int:
    """Output tiles of all groups: every group has a whole (M, N) output, empty groups included."""
    return groups * -(-m // tile_m) * -(-n // tile_n)


def default_config(problem: WgradProblem, m: int, n: int, tokens: int | None = None, groups: int = 1,
                   num_sms: int = SM_COUNT) -> GroupedConfig:
    """Untuned: the largest tile that still gives every SM a work unit. Tokens do not change the
    tile count (they are the reduction)."""
    shapes = grouped_config._SHAPES
    chosen = shapes[-1]
    for shape in shapes:
        if work_units(m, n, groups, shape[0], shape[1]) >= num_sms:
            chosen = shape
            break
    return _deepest(GroupedConfig(chosen[0], chosen[1], 64, MAX_STAGES, chosen[2]), problem)


# The whole-tile store (GroupedConfig.store_whole_tile) is offered with 128-row tiles and 64-wide
# k-blocks: the forms its GPU tests ran (tests/gpu/test_grouped_wgrad_gpu.py, all passed in the
# twenty-seventh session). On the Qwen3-30B-A3B weight gradients at 4096 tokens (H100) 128x128 with
# it won the down projection's round (244 us against 248 for 128x256 without); 64-row tiles with it
# lost every round, and tile_k 128 with it has not run on a GPU.
def offers_whole_tile_store(tile_m: int, tile_k: int) -> bool:
    return tile_m == 128 and tile_k == 64


# Clusters (2x1: two row tiles share b's token block; 1x2: two column tiles share a's) pass their GPU
# tests (tests/gpu/test_grouped_wgrad_gpu.py -k cluster: 50 passed on an H100 in the twenty-eighth
# session). On Qwen3-30B-A3B's weight gradients at 4096 tokens (~256 a group; grouped-rounds-h100-
# 20261206-s28.txt) they won no round (up: 128x256 490.1 us, 1x2 492.3, 2x1 500.2): short units are
# bound by their serial phases. Long groups are another matter: a 128x256 unit reads 48 KB of
# operands out of L2 per 4.2 MFLOP, so at the ~6.7 TB/s this L2 gives, unclustered units cannot pass
# ~580 TFLOP/s (the suite's skewed Qwen3 case, ~1000 tokens a group, took 1839.5 us against a 1200.5
# us bound at the measured matmul rate, eager 1516.2: grouped_gemm-quick-partial-h100-20261206-s26.md),
# and a cluster cuts that traffic by a quarter to a third. So they are offered, and autotuning weighs
# them on the call's own groups.
CLUSTERS_OFFERED = True

# Ping-pong (GroupedConfig.pingpong, 128x128 tiles) joins the candidates since its GPU tests passed
# (tests/gpu/test_grouped_wgrad_gpu.py -k pingpong: 20 passed on an H100 in the twenty-eighth session).
# There, on Qwen3-30B-A3B's weight gradients at 4096 tokens (wgrad-pingpong-h100-20261206-s28.txt), it
# took the up projection from 498.0 us (128x256, the best before) to 476.0 and the down projection from
# 257.0 to 245.6; cooperative 128x128 took 574.8 and 294.2.
PINGPONG_GPU_CHECKED = True

# Ping-pong's whole-tile store (the warp groups take one staging buffer in turn, 5 ring stages) and
# ping-pong in 2x1/1x2 clusters passed their GPU tests (-k pingpong: 106 passed on an H100 in the
# twenty-ninth session) but won nothing there on the same weight gradients (us, up / down; plain
# ping-pong 472.1 / 244.8): whole tiles 490.1 / 255.1, 1x2 474.8 / 248.5, 2x1 478.8 / 248.9
# (grouped-rounds-h100-20261206-s29.txt). Nsight Compute put the plain form at 79% of L2's
# throughput and 64% of DRAM's, so neither its epilogue nor one operand's L2 reads bind alone.
# They stay out of the candidates (compile time for no gain) until a case shows them winning.
PINGPONG_WHOLE_TILE_OFFERED = False
PINGPONG_CLUSTERS_OFFERED = False


def _cluster_shapes(m: int, n: int, tile_m: int, tile_n: int, square: bool = False) -> tuple[tuple[int, int], ...]:
    """2x1 where M spans two row tiles or more, 1x2 where N spans two column tiles (else a peer
    would only load for the other), and with `square` 2x2 where both do."""
    shapes = tuple(shape for shape, tiles in (((2, 1), -(-m // tile_m)), ((1, 2), -(-n // tile_n))) if tiles >= 2)
    return shapes + (((2, 2),) if square and len(shapes) == 2 else ())


def candidates(problem: WgradProblem, m: int, n: int, tokens: int | None = None, groups: int = 1,
               num_sms: int = SM_COUNT, exhaustive: bool = False, clusters: bool | None = None,
               pingpong: bool | None = None) -> list[GroupedConfig]:
    """Valid configs: the default first, then the other tile shapes at their deepest pipelines
    (and tile_k 128 with `exhaustive`), each also storing whole tiles where that is offered and,
    for 128-row tiles at tile_k 64, in clusters (with `clusters`; by default CLUSTERS_OFFERED), then
    the ping-pong 128x128 config (with `pingpong`, by default once PINGPONG_GPU_CHECKED), also in
    clusters (with `clusters`, by default if PINGPONG_CLUSTERS_OFFERED), also storing whole
    tiles (with `pingpong`, by default if PINGPONG_WHOLE_TILE_OFFERED)."""
    out = [default_config(problem, m, n, tokens, groups, num_sms)]
    clustered = CLUSTERS_OFFERED if clusters is None else clusters
    for tm, tn, wg in grouped_config._SHAPES:
        for tk in ((64, 128) if exhaustive else (64,)):
            shapes = ((1, 1),) + (_cluster_shapes(m, n, tm, tn) if clustered and tm == 128 and tk == 64 else ())
            for cm, cn in shapes:
                for whole in ((False, True) if offers_whole_tile_store(tm, tk) else (False,)):
                    cfg = _deepest(GroupedConfig(tm, tn, tk, MAX_STAGES, wg, cm, cn, store_whole_tile=whole), problem)
                    if cfg is not None and cfg not in out:
                        out.append(cfg)
    if PINGPONG_GPU_CHECKED if pingpong is None else pingpong:
        in_clusters = PINGPONG_CLUSTERS_OFFERED if clusters is None else clusters
        wholes = (False, True) if PINGPONG_WHOLE_TILE_OFFERED or pingpong else (False,)
        for cm, cn in ((1, 1),) + (_cluster_shapes(m, n, 128, 128, square=True) if in_clusters else ()):
            for whole in wholes:
                cfg = _deepest(GroupedConfig(128, 128, 64, MAX_STAGES, 2, cm, cn, store_whole_tile=whole,
                                             pingpong=True), problem)
                if cfg is not None:
                    out.append(cfg)
    return out


def spec(problem: WgradProblem, config: GroupedConfig, num_sms: int = SM_COUNT):
    """The KernelSpec of one weight-gradient kernel."""
    from ...runtime.spec import KernelSpec

    return KernelSpec.make(KERNEL_MODULE, num_sms=num_sms, **problem.as_params(), **config.as_params())


Problem, Config = WgradProblem, GroupedConfig
