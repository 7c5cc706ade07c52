"""Benchmark suites by name. Each module has `cases(quick) -> [() -> Case]` (cases are built one at a
time so only one case's tensors live at once; a factory made with case.named carries its case's
name, so a filtered run skips it unbuilt) and may have `host_overhead() -> {backend: fn}`."""

from . import (e2e, flex_backward, flex_decode, flex_prefill, gemm, gemm_compiled, gemm_dynamic, grouped_gemm, host,
               models, rmsnorm)

SUITES = {"gemm": gemm, "rmsnorm": rmsnorm, "gemm_compiled": gemm_compiled, "e2e": e2e,
          "flex_decode": flex_decode, "flex_prefill": flex_prefill,
          "flex_backward": flex_backward, "grouped_gemm": grouped_gemm, "models": models,
          "host": host, "gemm_dynamic": gemm_dynamic}
