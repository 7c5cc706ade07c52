"""Hopper GEMM: the problem, configurations, limits, candidates and kernel specs. Plain Python,
usable without the CuTe DSL.

Every config module of the GEMM family (this one, gemv_config) offers the same names:
    Problem                      what is computed: dtypes, operand layouts, epilogue (GemmProblem,
                                 shared by the family); sizes stay dynamic
    Config                       the kernel's tuning knobs only
    unsupported_reason(problem, config=None, *, m=None, n=None, k=None, batch=1)
                                 why the kernel cannot run this (with this config, at these sizes
                                 where given), in one line; None when it can
    candidates(problem, m, n, k, batch=1, num_sms=SM_COUNT, exhaustive=False)
                                 the configs worth timing, the default first
    default_config(problem, m, n, k, batch=1, num_sms=SM_COUNT)
    spec(problem, config, num_sms=SM_COUNT)   the KernelSpec that compiles it
family.py dispatches on the config's type.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from ...runtime.arch import SUPPORTED
from ..common.programs.epilogue import loads, operands

HOPPER = SUPPORTED[(9, 0)]
SMEM_BUDGET = HOPPER.smem_per_block  # dynamic shared memory one CTA may use
SM_COUNT = HOPPER.sm_count  # when the caller does not say which part

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
INPUT_DTYPES = ("bfloat16", "float16")
ACTIVATIONS = ("identity", "relu", "gelu_tanh", "gelu_erf", "silu", "sigmoid", "tanh")
EPI_N = 32  # columns per epilogue subtile
EPI_STAGES = 2  # shared-memory buffers for outgoing D subtiles
C_STAGES = 2  # shared-memory buffers for incoming C subtiles
KERNEL_MODULE = "inductor_cute.kernels.gemm.sm90"
MAX_STAGES = 8


@dataclass(frozen=True)
class GemmConfig:
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 4
    consumer_warpgroups: int = 2
    persistent: bool = True
    # ping-pong: the two consumer warp groups take alternate whole tiles, so one's epilogue
    # overlaps the other's mainloop; otherwise both share every tile ("cooperative")
    pingpong: bool = False

    @property
    def tile_warpgroups(self) -> int:
        """Consumer warp groups that share one tile (its MMA and its epilogue)."""
        return 1 if self.pingpong else self.consumer_warpgroups

    @property
    def slots(self) -> int:
        """Consumer slots: warp groups owning separate tiles, each with its own epilogue buffers."""
        return 2 if self.pingpong else 1

    def as_params(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k} cluster {self.cluster_m}x{self.cluster_n} "
                f"stages {self.stages}{' pingpong' if self.pingpong else ''}{' persistent' if self.persistent else ''}")


@dataclass(frozen=True)
class GemmProblem:
    """What a compiled GEMM kernel is specialised on; sizes and strides stay dynamic."""

    dtype_name: str  # A and B
    out_dtype_name: str  # D, C and bias
    a_major: str  # "k": A row-major (M, K); "m": column-major
    b_major: str  # "n": B row-major (K, N); "k": B = W.t() for an (N, K) row-major W
    has_bias: bool = False
    has_c: bool = False
    activation: str = "identity"
    epilogue: str = ""  # a kernels.epilogue_program text; replaces alpha/bias/C/activation when set

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def smem_bytes(cfg: GemmConfig, ab_bytes: int, out_bytes: int, has_c: bool, has_bias: bool = False) -> int:
    ab = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * ab_bytes * cfg.stages
    epi = 64 * cfg.tile_warpgroups * EPI_N * out_bytes  # one epilogue subtile
    # 1 KB for mbarriers; one C pipeline serves the epilogues in tile order
    total = 1024 + ab + epi * EPI_STAGES * cfg.slots + (epi * C_STAGES if has_c else 16)
    total += 4 * cfg.tile_n * cfg.slots if has_bias else 16  # the tile's bias row
    return -(-total // 1024) * 1024  # the shared-storage struct is 1 KB aligned


def unsupported_reason(problem: GemmProblem, config: GemmConfig | None = None, *, m: int | None = None,
                       n: int | None = None, k: int | None = None, batch: int = 1) -> str | None:
    """Why the GEMM cannot run `problem` (with `config`, when given), in one line; None when it can.
    Without a config: whether the problem is one the GEMM family computes at all. The GEMM takes
    any sizes (the host checks that the operands suit TMA)."""
    p = problem
    if p.dtype_name not in INPUT_DTYPES:
        return f"A/B dtype {p.dtype_name} is not supported (use bfloat16 or float16)"
    if p.out_dtype_name not in ELEMENT_BYTES:
        return f"output dtype {p.out_dtype_name} is not supported (use bfloat16, float16 or float32)"
    if p.a_major not in ("k", "m") or p.b_major not in ("k", "n"):
        return "a_major must be 'k' or 'm' and b_major 'k' or 'n'"
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation!r} is not one of {', '.join(ACTIVATIONS)}"
    if p.epilogue:
        if p.activation != "identity":
            return "an epilogue program and an activation cannot be combined"
        try:
            used = operands(loads(p.epilogue))
        except ValueError as e:
            return str(e)
        if ("row" in used) != p.has_bias or ("full" in used) != p.has_c:
            return "the epilogue program's row/full operands must match has_bias/has_c"
    return None if config is None else _config_reason(config, p)


def _config_reason(c: GemmConfig, p: GemmProblem) -> str | None:
    if c.consumer_warpgroups not in (1, 2):
        return "consumer_warpgroups must be 1 or 2"
    if c.pingpong and c.consumer_warpgroups != 2:
        return "pingpong needs consumer_warpgroups=2"
    if c.pingpong and not c.persistent:
        return "pingpong needs persistent=True (each warp group takes every other tile)"
    if c.pingpong and c.tile_m not in (64, 128):
        return "pingpong tile_m must be 64 or 128"
    if c.pingpong and p.has_c and p.out_dtype_name == "float32":
        # measured wrong on the H200 (128x96 tiles, 2026-12-02): refused until fixed
        return "pingpong with an fp32 C operand is not supported"
    if c.tile_m % (64 * c.tile_warpgroups) or not 64 <= c.tile_m <= 256:
        return "tile_m must be a multiple of 64 * consumer_warpgroups, at most 256"
    if c.tile_n % EPI_N or not EPI_N <= c.tile_n <= 256:
        return f"tile_n must be a multiple of {EPI_N} in [{EPI_N}, 256]"
    if c.tile_k % 16 or not 16 <= c.tile_k <= 128:
        return "tile_k must be a multiple of 16 in [16, 128]"
    if c.tile_m * c.tile_n // (128 * c.tile_warpgroups) > 128:
        return "accumulator exceeds 128 fp32 registers per thread"
    if c.cluster_m not in (1, 2, 4) or c.cluster_n not in (1, 2, 4) or c.cluster_m * c.cluster_n > 4:
        return "cluster dims must be 1, 2 or 4 with at most 4 CTAs"
    if c.stages < 2:
        return "at least 2 pipeline stages"
    need = smem_bytes(c, ELEMENT_BYTES[p.dtype_name], ELEMENT_BYTES[p.out_dtype_name], p.has_c, p.has_bias)
    if need > SMEM_BUDGET:
        return f"shared memory {need} B exceeds {SMEM_BUDGET} B"
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _tiles(m: int, n: int, tile_m: int, tile_n: int, batch: int) -> int:
    return _ceil_div(m, tile_m) * _ceil_div(n, tile_n) * batch


def default_config(problem: GemmProblem, m: int, n: int, k: int | None = None, batch: int = 1,
                   num_sms: int = SM_COUNT) -> GemmConfig:
    """Untuned heuristic: the largest tile that still gives a wave of CTAs, the deepest pipeline
    that fits, persistence beyond one wave, 2x1 clusters when M spans several tiles (K plays no
    part)."""
    shapes = [(64, 256, 1), (64, 128, 1), (64, 64, 1)] if m <= 64 else [(128, 256, 2), (128, 128, 2), (128, 64, 2)]
    tm, tn, wg = shapes[-1]
    for shape in shapes:
        if _tiles(m, n, shape[0], shape[1], batch) >= num_sms:
            tm, tn, wg = shape
            break
    tiles = _tiles(m, n, tm, tn, batch)
    cluster_m = 2 if _ceil_div(m, tm) >= 4 and tiles >= 2 * num_sms else 1
    cfg = GemmConfig(tm, tn, 64, cluster_m, 1, MAX_STAGES, wg, tiles > num_sms)
    while cfg.stages > 2 and _config_reason(cfg, problem):
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def _deepest(cfg: GemmConfig, p: GemmProblem) -> GemmConfig | None:
    """`cfg` with the most pipeline stages (<= MAX_STAGES) that fit, or None if none does."""
    for stages in range(MAX_STAGES, 1, -1):
        candidate = dataclasses.replace(cfg, stages=stages)
        if _config_reason(candidate, p) is None:
            return candidate
    return None


def candidates(problem: GemmProblem, m: int, n: int, k: int | None = None, batch: int = 1,
               num_sms: int = SM_COUNT, exhaustive: bool = False) -> list[GemmConfig]:
    """Valid configs for an (m, n) output: the heuristic default first, then alternates.

    The small set varies what the heuristic cannot predict (tile shape against wave
    quantization, cluster orientation, persistence); `exhaustive` walks the whole space."""
    if exhaustive:
        shapes = [(tm, tn, wg) for tm in (64, 128, 256) for tn in (32, 64, 96, 128, 192, 256)
                  for wg in (1, 2) if tm % (64 * wg) == 0]
        clusters = [(1, 1), (2, 1), (1, 2)]
        persistence = (True, False)
    elif m <= 64:
        shapes, clusters, persistence = [(64, 256, 1), (64, 128, 1), (64, 64, 1), (64, 32, 1)], [(1, 1)], (False,)
    elif m <= 128:
        shapes = [(128, 128, 2), (128, 64, 2), (128, 32, 2), (64, 128, 1)]
        clusters, persistence = [(1, 1)], (False,)
    else:
        shapes = [(128, 256, 2), (256, 128, 2), (128, 192, 2), (128, 128, 2)]
        clusters, persistence = [(2, 1), (1, 2)], (True,)
    out = [default_config(problem, m, n, k, batch, num_sms)]
    for (tm, tn, wg), (cm, cn), persistent in itertools.product(shapes, clusters, persistence):
        if cm * cn > 1 and _tiles(m, n, tm, tn, batch) < 2 * num_sms:
            cm = cn = 1  # clusters pay off only with several waves of tiles
        cfg = _deepest(GemmConfig(tm, tn, 64, cm, cn, MAX_STAGES, wg, persistent), problem)
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out


def spec(problem: GemmProblem, config: GemmConfig, num_sms: int = SM_COUNT):
    """The KernelSpec of one GEMM kernel."""
    from ...runtime.spec import KernelSpec

    return KernelSpec.make(KERNEL_MODULE, num_sms=num_sms, **problem.as_params(), **config.as_params())


Problem, Config = GemmProblem, GemmConfig
