"""Our grouped GEMM as an Inductor extern-kernel choice: benchmarked in-process beside ATen's
`_grouped_mm` and the Triton template (through runtime.grouped_mm), emitted into output code as a
GroupedLauncher defined in the module's header and called at the GEMM's place in the graph."""

from __future__ import annotations

import logging

from torch._inductor import ir
from torch._inductor.select_algorithm import ExternKernelChoice

from ...errors import first_line
from ..gemm.codegen import define_call_site
from ..gemm.extern import CuteGemmCaller
from ..hooks import ExternKernel
from . import runtime

log = logging.getLogger(__name__)
RUNTIME = runtime.MODULE


class CuteGroupedOut(ir.ExternKernelOut):
    """The chosen grouped GEMM in the graph: `icute_grouped_mm_<n>(a, b, offs, out)`."""

    def codegen(self, wrapper) -> None:
        made = runtime.GroupedLauncher(tuple(self.kwargs["config"]), self.kwargs.get("activation", ""))
        launcher = define_call_site(wrapper, "icute_grouped_mm", RUNTIME, f"{made!r}.launch")
        self.codegen_comment(wrapper)
        out = (self.output_view or self).codegen_reference()
        wrapper.writeline(f"{launcher}({', '.join([*self.codegen_args(), out])})")


class CuteGroupedCaller(CuteGemmCaller):
    """One config of ours among the grouped GEMM's choices (a CuteGemmCaller, so that the GEMM's
    feedback saver reports it too; a failed benchmark drops it the same way)."""

    def __str__(self) -> str:
        gated = self.kwargs.get("activation", "")
        return f"inductor_cute_grouped_mm{'_gated' if gated else ''}({self.description})"

    def hash_key(self) -> str:
        # the timing inputs are part of what a cached timing means: a change of them re-tunes
        # (a cache hit needs every choice's entry, so the stock choices are timed again too)
        return f"{super().hash_key()}-offsets-{runtime.ROUTED_OFFSETS_VERSION}"

    def benchmark(self, *args, out):
        # The stock lowering gives select_algorithm an even split for offs (input_gen_fns), but a
        # path that ignores input_gen_fns (autotuning in a subprocess, some torch versions' fusion
        # benchmarks) passes random int32s. Our kernel reads offs on the device: garbage ends would
        # make it read and write out of bounds, so such offsets are replaced by an even split.
        try:
            a, b, offs = args
            args = (a, b, runtime.valid_offsets(offs, runtime.token_count(a, b)))
        except Exception as e:
            log.warning("inductor-cute %s dropped: its benchmark inputs: %s", self.description, first_line(e))
            return float("inf")
        return super().benchmark(*args, out=out)

    def output_node(self):
        gated = self.kwargs.get("activation", "")
        log.info("inductor-cute grouped GEMM %s%s chosen", self.description, f" ({gated} gate)" if gated else "")
        name = f"{RUNTIME}.grouped_mm_gated" if gated else f"{RUNTIME}.grouped_mm"
        return ir.TensorBox.create(CuteGroupedOut(layout=self.layout, inputs=self.input_nodes, kwargs=self.kwargs,
                                                  python_kernel_name=name))


class CuteGroupedChoice(ExternKernelChoice):
    def bind(self, input_nodes, layout, ordered_kwargs_for_cpp_kernel=(), *, spec_key: str = "",
             description: str = "", problem=None, num_sms: int = 0, **kwargs):
        self.ordered_kwargs_for_cpp_kernel = ordered_kwargs_for_cpp_kernel
        return CuteGroupedCaller(self, input_nodes, layout, kwargs, spec_key, description, problem, num_sms)


def new_grouped_choice(name: str) -> CuteGroupedChoice:
    """Constructing it registers `runtime.grouped_mm` as `extern_kernels.<name>`: inductor/install.py
    does, at install."""
    return CuteGroupedChoice(runtime.grouped_mm, name=name, has_out_variant=True)


def new_gated_choice(name: str) -> CuteGroupedChoice:
    """The fused MoE gate's (gate_lowering.py): registers `runtime.grouped_mm_gated`."""
    return CuteGroupedChoice(runtime.grouped_mm_gated, name=name, has_out_variant=True)


# The hooks that register our extern kernels; inductor/install.py lists them with the others.
GROUPED_KERNEL = ExternKernel("grouped_extern_kernel", "inductor_cute_grouped_mm", lambda: new_grouped_choice)
GATED_KERNEL = ExternKernel("grouped_gated_extern_kernel", "inductor_cute_grouped_mm_gated", lambda: new_gated_choice)


def grouped_choice() -> CuteGroupedChoice:
    return GROUPED_KERNEL.choice()


def gated_choice() -> CuteGroupedChoice:
    return GATED_KERNEL.choice()
