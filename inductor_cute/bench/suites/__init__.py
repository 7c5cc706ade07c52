"""Benchmark suites by name. Each module has `cases(quick) -> [() -> Case]` (cases are built one at a
time so only one case's tensors live at once) and may have `host_overhead() -> {backend: fn}`."""

from . import e2e, flex_decode, gemm, gemm_compiled, gemm_dynamic, host, models, rmsnorm

SUITES = {"gemm": gemm, "rmsnorm": rmsnorm, "gemm_compiled": gemm_compiled, "e2e": e2e,
          "flex_decode": flex_decode, "models": models,
          "host": host, "gemm_dynamic": gemm_dynamic}
