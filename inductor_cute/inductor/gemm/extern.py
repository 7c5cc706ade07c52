"""Our GEMM as an Inductor extern-kernel choice: benchmarked in-process beside ATen and Triton,
emitted into output code as a call to `inductor_cute.inductor.gemm.runtime.gemm`."""

from __future__ import annotations

import logging

from torch._inductor import ir
from torch._inductor.select_algorithm import ExternKernelCaller, ExternKernelChoice

from ...errors import first_line
from . import runtime

log = logging.getLogger(__name__)
RUNTIME = runtime.MODULE


class CuteGemmOut(ir.ExternKernelOut):
    """The chosen GEMM in the graph; its output code imports our runtime itself, so a graph
    served from the FX cache works in a process that never lowered it."""

    def codegen(self, wrapper) -> None:
        wrapper.add_import_once(f"import {RUNTIME}")
        super().codegen(wrapper)


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
        if fusion_enabled() and scheduling_installed():
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


_fuse_epilogues = False  # set by enable(fuse_epilogues=...)


def fusion_enabled() -> bool:
    return _fuse_epilogues


def set_fusion(enabled: bool) -> None:
    global _fuse_epilogues
    _fuse_epilogues = enabled


def _make_choice() -> CuteGemmChoice:
    # ExternKernelChoice registers its kernel on torch's extern_kernels module once per name.
    name = "inductor_cute_gemm"
    from torch._inductor.select_algorithm import extern_kernels

    if hasattr(extern_kernels, name):
        delattr(extern_kernels, name)
    return CuteGemmChoice(runtime.gemm, name=name, has_out_variant=True)


CUTE_GEMM = _make_choice()
