"""Our GEMM as an Inductor extern-kernel choice: benchmarked in-process beside ATen and Triton
(through `inductor_cute.inductor.gemm.runtime.gemm`), emitted into output code as a GemmLauncher
defined in the module's header and called at the GEMM's place in the graph."""

from __future__ import annotations

import logging

from torch._inductor import ir
from torch._inductor.select_algorithm import ExternKernelCaller, ExternKernelChoice

from ...errors import first_line
from ..hooks import ExternKernel
from ..settings import active_settings
from . import runtime
from .codegen import define_launcher, is_static, layout_exprs

log = logging.getLogger(__name__)
RUNTIME = runtime.MODULE


class CuteGemmOut(ir.ExternKernelOut):
    """The chosen GEMM in the graph, unfused: `icute_gemm_<n>(*inputs, out)`."""

    def codegen(self, wrapper) -> None:
        out_node = self.output_view or self
        static = is_static(*(e for node in (*self.inputs, out_node) for e in layout_exprs(node)))
        launcher = define_launcher(wrapper, static=static, **self.kwargs)
        self.codegen_comment(wrapper)
        out = out_node.codegen_reference()
        wrapper.writeline(f"{launcher}({', '.join([*self.codegen_args(), out])})")


class CuteGemmCaller(ExternKernelCaller):
    def __init__(self, choice, input_nodes, layout, kwargs, spec_key: str, description: str, problem, num_sms: int):
        super().__init__(choice, input_nodes, layout, kwargs, has_out_variant=True)
        self.spec_key = spec_key  # covers kernel source, config, arch and versions
        self.description = description
        self.problem, self.num_sms = problem, num_sms

    def __str__(self) -> str:
        return f"inductor_cute_gemm({self.description})"

    def hash_key(self) -> str:
        # Inductor's autotune cache keys on this: a kernel or version change re-tunes.
        return f"{super().hash_key()}-{self.spec_key}"

    def benchmark(self, *args, out):
        try:
            return super().benchmark(*args, out=out)
        except Exception as e:  # never let our choice break autotuning: it just loses
            log.warning("inductor-cute %s dropped: benchmarking failed: %s", self.description, first_line(e))
            return float("inf")

    def info_dict(self):
        return {"backend": "inductor_cute", "kernel_name": self.name, "config": self.description}

    def output_node(self):
        from .template import CuteGemmTemplateBuffer, scheduling_installed

        log.info("inductor-cute %s chosen for %s", self.description, self.kwargs["op"])
        if active_settings().fuse_epilogues and scheduling_installed():
            # a template node, so that the scheduler can fuse pointwise epilogues into it
            node = CuteGemmTemplateBuffer(self.layout, self.input_nodes, op=self.kwargs["op"], kwargs=self.kwargs,
                                          problem=self.problem, num_sms=self.num_sms)
        else:
            node = CuteGemmOut(layout=self.layout, inputs=self.input_nodes, kwargs=self.kwargs,
                               python_kernel_name=f"{RUNTIME}.gemm")
        return ir.TensorBox.create(node)


class CuteGemmChoice(ExternKernelChoice):
    def bind(self, input_nodes, layout, ordered_kwargs_for_cpp_kernel=(), *, spec_key: str = "",
             description: str = "", problem=None, num_sms: int = 0, **kwargs):
        self.ordered_kwargs_for_cpp_kernel = ordered_kwargs_for_cpp_kernel
        return CuteGemmCaller(self, input_nodes, layout, kwargs, spec_key, description, problem, num_sms)


def new_gemm_choice(name: str) -> CuteGemmChoice:
    """Constructing it registers `runtime.gemm` as `extern_kernels.<name>`: inductor/install.py does,
    at install."""
    return CuteGemmChoice(runtime.gemm, name=name, has_out_variant=True)


# The hook that registers our extern kernel; inductor/install.py lists it with the others.
GEMM_KERNEL = ExternKernel("gemm_extern_kernel", "inductor_cute_gemm", lambda: new_gemm_choice)


def gemm_choice() -> CuteGemmChoice:
    """Our GEMM's extern choice (registered on first use when Inductor was configured directly)."""
    return GEMM_KERNEL.choice()


def log_timings(timings, name, input_nodes, choices, profiled_time_fn, precompile_times=None) -> None:
    """select_algorithm's feedback saver: how our choices placed in an autotuning that had them."""
    ours = [c for c in timings if isinstance(c, CuteGemmCaller)]
    if not ours or not log.isEnabledFor(logging.INFO):
        return
    ranked = sorted(timings.items(), key=lambda kv: kv[1])
    winner, best = ranked[0]
    our_best = min(timings[c] for c in ours)
    log.info("inductor-cute %s: winner %s %.1f us; best of ours %.1f us (%+.1f%%)", name, winner,
             best * 1e3, our_best * 1e3, (our_best / best - 1) * 100 if best else 0.0)
    for choice, ms in ranked:
        log.debug("  %-60s %9.1f us", str(choice)[:60], ms * 1e3)
