"""The two GEMM kernel families behind ops.mm and the Inductor choices, told apart by their
config type: GemmConfig (WGMMA tiles, any shape) and GemvConfig (decode: M <= 16, both operands
K-major). DSL-free."""

from __future__ import annotations

from .config import GemmConfig, GemmProblem, config_error, gemm_spec
from .gemv_config import GemvConfig, gemv_spec
from .gemv_config import config_error as gemv_config_error
from .gemv_config import unsupported_reason as gemv_unsupported_reason

GEMV_TAG = "gemv"  # first element of a GemvConfig's tuple form


def kernel_spec(problem: GemmProblem, config: GemmConfig | GemvConfig, num_sms: int):
    if isinstance(config, GemvConfig):
        return gemv_spec(problem, config)
    return gemm_spec(problem, config, num_sms)


def config_problem(config: GemmConfig | GemvConfig, problem: GemmProblem, m: int | None = None,
                   k: int | None = None) -> str | None:
    """Why `config` cannot run `problem` (with M and K where known, for the GEMV); None if it can."""
    if isinstance(config, GemvConfig):
        if m is not None and k is not None:
            reason = gemv_unsupported_reason(m, 8, k, problem)  # N is checked by every caller
            if reason:
                return reason
        elif problem.a_major != "k" or problem.b_major != "k":
            return "gemv needs K-major A and B"
        return gemv_config_error(config, problem, m=m, k=k)
    return config_error(config, problem)


def as_tuple(config: GemmConfig | GemvConfig) -> tuple:
    """A config as plain values, for generated code (and back with `from_tuple`)."""
    values = tuple(config.as_params().values())
    return (GEMV_TAG, *values) if isinstance(config, GemvConfig) else values


def from_tuple(values: tuple) -> GemmConfig | GemvConfig:
    if values and values[0] == GEMV_TAG:
        return GemvConfig(*values[1:])
    return GemmConfig(*values)
