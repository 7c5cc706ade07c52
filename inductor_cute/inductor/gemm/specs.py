"""From an Inductor GEMM to our kernel specs: the problem the runtime will see, compiled ahead."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time

from torch._inductor.virtualized import V

from ...host.common import DTYPE_NAMES
from ...kernels.gemm.config import GemmProblem
from ...kernels.gemm import family
from ...runtime import precompile, target_arch
from ...runtime.loader import kernel_key
from .runtime import input_role

log = logging.getLogger(__name__)


def _unit_last(node) -> tuple[bool, bool]:
    """Whether the node's last / second-to-last dimension is contiguous (size-1 counts)."""
    sizes = V.graph.sizevars.optimization_hints(node.get_size())
    strides = V.graph.sizevars.optimization_hints(node.get_stride())
    return (sizes[-1] == 1 or strides[-1] == 1), (sizes[-2] == 1 or strides[-2] == 1)


def problem_for(kernel_inputs, op_name: str) -> tuple[GemmProblem, int]:
    """The GemmProblem ops.mm/bmm will pick for these buffers (same layout preferences: A K-major,
    B N-major, either read in place when its strides allow) and the batch size hint."""
    mat1, mat2 = kernel_inputs.mat1mat2()
    a_k, a_m = _unit_last(mat1)
    b_n, b_k = _unit_last(mat2)
    a_major = "m" if not a_k and a_m else "k"
    b_major = "k" if not b_n and b_k else "n"
    has_input = op_name in ("addmm", "baddbmm")
    problem = GemmProblem(DTYPE_NAMES[mat1.get_dtype()], DTYPE_NAMES[kernel_inputs.out_dtype()],
                          a_major, b_major, has_bias=has_input, has_c=False)
    if has_input:  # the runtime passes a broadcast row as bias and anything else as C
        inp = kernel_inputs.nodes()[0]
        hints = V.graph.sizevars.optimization_hints
        role = input_role(hints(inp.get_size()), hints(inp.get_stride()), hints(mat2.get_size())[-1],
                          float(kernel_inputs.get_scalar("beta")))
        problem = dataclasses.replace(problem, has_bias=role == "row", has_c=role == "full")
    batch = V.graph.sizevars.optimization_hint(mat1.get_size()[0]) if len(mat1.get_size()) == 3 else 1
    return problem, batch


def precompile_choices(problem, configs: list, num_sms: int, spec_of=family.spec) -> list[tuple]:
    """Compile every config in parallel worker processes (or find it cached); (config, spec key)
    for those that are ready, in the given order. Failures are logged and left out. `spec_of`
    makes a config's KernelSpec: the dense GEMM's (GemmConfig, GemvConfig) unless another family's
    (the grouped GEMM's) is given."""
    arch = target_arch().name
    specs = [spec_of(problem, cfg, num_sms) for cfg in configs]
    start = time.perf_counter()
    results = precompile(specs, arch)
    ready = []
    for cfg, spec, result in zip(configs, specs, results):
        if result.status == "failed":
            log.warning("inductor-cute config %s dropped: compile failed: %s", cfg.describe(), result.error)
        else:
            ready.append((cfg, kernel_key(spec, arch)))
    counts = {status: sum(r.status == status for r in results) for status in ("compiled", "cached", "failed")}
    log.info("inductor-cute precompile: %d configs (%d compiled, %d cached, %d failed) in %.1f s", len(specs),
             counts["compiled"], counts["cached"], counts["failed"], time.perf_counter() - start)
    return ready


def table_spec_key(table, keys: dict) -> str:
    """One key for an M-bucket table (buckets.py): its bounds and every bucket's spec key, hashed."""
    text = "|".join(f"{bound}:{keys[cfg]}" for bound, cfg in table)
    return "m_buckets-" + hashlib.sha256(text.encode()).hexdigest()[:32]
