"""The two GEMM kernels behind ops.mm and the Inductor choices, told apart by their config type:
GemmConfig (WGMMA tiles, any shape) and GemvConfig (decode: M <= 16, both operands K-major).
Offers the config modules' names (see config.py) for either kernel. DSL-free."""

from __future__ import annotations

import dataclasses

from . import config as gemm_config
from . import gemv_config
from .config import SM_COUNT, GemmConfig, GemmProblem
from .gemv_config import GemvConfig

GEMV_TAG = "gemv"  # first element of a GemvConfig's tuple form


def config_module(config: GemmConfig | GemvConfig):
    """The config module of the kernel that `config` configures."""
    return gemv_config if isinstance(config, GemvConfig) else gemm_config


def unsupported_reason(problem: GemmProblem, config: GemmConfig | GemvConfig | None = None, *,
                       m: int | None = None, n: int | None = None, k: int | None = None,
                       batch: int = 1) -> str | None:
    """Why `config`'s kernel cannot run `problem` (at the sizes given); without a config, why no
    kernel of the family can. None when it can."""
    return config_module(config).unsupported_reason(problem, config, m=m, n=n, k=k, batch=batch)


def default_config(problem: GemmProblem, m: int, n: int, k: int, batch: int = 1,
                   num_sms: int = SM_COUNT) -> GemmConfig | GemvConfig:
    """The decode GEMV for one matrix of at most 16 rows against a K-major weight, else the WGMMA
    GEMM's heuristic tile."""
    if gemv_config.unsupported_reason(problem, m=m, n=n, k=k, batch=batch) is None:
        gemv = gemv_config.default_config(problem, m, n, k, batch, num_sms)
        if gemv_config.unsupported_reason(problem, gemv, m=m, k=k) is None:  # a K past 64 full A slices cannot
            return gemv
    return gemm_config.default_config(problem, m, n, k, batch, num_sms)


def fitted_config(problem: GemmProblem, config: GemmConfig | GemvConfig) -> GemmConfig | GemvConfig | None:
    """`config` itself when it can run `problem`, else the same tile with the fewest pipeline
    stages dropped that make it fit (an epilogue's C tile takes shared memory the autotuned config
    gave to stages; one stage less costs far less than the output's round trip through memory);
    None when no such variant runs it."""
    if unsupported_reason(problem, config) is None:
        return config
    if isinstance(config, GemmConfig):
        for stages in range(config.stages - 1, 1, -1):
            candidate = dataclasses.replace(config, stages=stages)
            if unsupported_reason(problem, candidate) is None:
                return candidate
    return None


def spec(problem: GemmProblem, config: GemmConfig | GemvConfig, num_sms: int = SM_COUNT):
    """The KernelSpec that compiles `config`'s kernel for `problem`."""
    return config_module(config).spec(problem, config, num_sms)


def as_tuple(config: GemmConfig | GemvConfig) -> tuple:
    """A config as plain values, for generated code (and back with `from_tuple`)."""
    values = tuple(config.as_params().values())
    return (GEMV_TAG, *values) if isinstance(config, GemvConfig) else values


def from_tuple(values: tuple) -> GemmConfig | GemvConfig:
    if values and values[0] == GEMV_TAG:
        return GemvConfig(*values[1:])
    return GemmConfig(*values)
