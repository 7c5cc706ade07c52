"""Hopper GEMM configurations, limits and kernel specs: plain Python, usable without the CuTe DSL."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
INPUT_DTYPES = ("bfloat16", "float16")
ACTIVATIONS = ("identity", "relu", "gelu_tanh", "gelu_erf", "silu", "sigmoid", "tanh")
SMEM_BUDGET = 227 * 1024  # dynamic shared memory one CTA may use on H100/H200
EPI_N = 32  # columns per epilogue subtile
EPI_STAGES = 2  # shared-memory buffers for outgoing D subtiles
C_STAGES = 2  # shared-memory buffers for incoming C subtiles
KERNEL_MODULE = "inductor_cute.kernels.gemm.sm90"


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


def problem_error(p: GemmProblem) -> str | None:
    if p.dtype_name not in INPUT_DTYPES:
        return f"A/B dtype {p.dtype_name} is not supported (use bfloat16 or float16)"
    if p.out_dtype_name not in ELEMENT_BYTES:
        return f"output dtype {p.out_dtype_name} is not supported (use bfloat16, float16 or float32)"
    if p.a_major not in ("k", "m") or p.b_major not in ("k", "n"):
        return "a_major must be 'k' or 'm' and b_major 'k' or 'n'"
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation!r} is not one of {', '.join(ACTIVATIONS)}"
    if p.epilogue:
        from ..common.programs.epilogue import loads, operands

        if p.activation != "identity":
            return "an epilogue program and an activation cannot be combined"
        try:
            used = operands(loads(p.epilogue))
        except ValueError as e:
            return str(e)
        if ("row" in used) != p.has_bias or ("full" in used) != p.has_c:
            return "the epilogue program's row/full operands must match has_bias/has_c"
    return None


def config_error(c: GemmConfig, p: GemmProblem) -> str | None:
    """Why `c` cannot run `p` (a short reason), or None when it can."""
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


def default_config(m: int, n: int, p: GemmProblem, batch: int = 1, num_sms: int = 132) -> GemmConfig:
    """Untuned heuristic: the largest tile that still gives a wave of CTAs, the deepest pipeline
    that fits, persistence beyond one wave, 2x1 clusters when M spans several tiles."""
    shapes = [(64, 256, 1), (64, 128, 1), (64, 64, 1)] if m <= 64 else [(128, 256, 2), (128, 128, 2), (128, 64, 2)]
    tm, tn, wg = shapes[-1]
    for shape in shapes:
        if _ceil_div(m, shape[0]) * _ceil_div(n, shape[1]) * batch >= num_sms:
            tm, tn, wg = shape
            break
    tiles = _ceil_div(m, tm) * _ceil_div(n, tn) * batch
    cluster_m = 2 if _ceil_div(m, tm) >= 4 and tiles >= 2 * num_sms else 1
    cfg = GemmConfig(tm, tn, 64, cluster_m, 1, 8, wg, tiles > num_sms)
    while cfg.stages > 2 and config_error(cfg, p):
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    return cfg


def gemm_spec(p: GemmProblem, config: GemmConfig, num_sms: int = 132):
    """The KernelSpec of one GEMM kernel."""
    from ...runtime.spec import KernelSpec

    return KernelSpec.make(KERNEL_MODULE, num_sms=num_sms, **p.as_params(), **config.as_params())
