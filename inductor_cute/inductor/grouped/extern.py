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
    """The chosen grouped GEMM in the graph: `icute_grouped_mm_<n>(a, b, offs, out)`, with gathered
    rows `icute_grouped_mm_<n>(a, rows, b, offs, out)`, the gate's gradient (a, b, offs, gate, up, out)."""

    def codegen(self, wrapper) -> None:
        made = runtime.GroupedLauncher(tuple(self.kwargs["config"]), self.kwargs.get("activation", ""))
        method = {"grouped_mm_rows": "launch_rows", "grouped_mm_gate_grad": "launch_gate_grad"}.get(
            _kernel_name(self.inputs, self.kwargs), "launch")
        launcher = define_call_site(wrapper, "icute_grouped_mm", RUNTIME, f"{made!r}.{method}")
        self.codegen_comment(wrapper)
        out = (self.output_view or self).codegen_reference()
        wrapper.writeline(f"{launcher}({', '.join([*self.codegen_args(), out])})")


class CuteGroupedCaller(CuteGemmCaller):
    """One config of ours among the grouped GEMM's choices (a CuteGemmCaller, so that the GEMM's
    feedback saver reports it too; a failed benchmark drops it the same way)."""

    def __str__(self) -> str:
        return f"inductor_cute_{_kernel_name(self.input_nodes, self.kwargs)}({self.description})"

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
            if self.kwargs.get("gate_grad"):  # (a, b, offs, gate, up): the forward form's offsets
                a, b, offs, *halves = args
                args = (a, b, runtime.valid_offsets(offs, a.shape[0]), *halves)
            elif _gathers(args):  # (a, rows, b, offs): indices out of a's rows would trap
                a, rows, b, offs = args
                rows = runtime.valid_rows(rows, a.shape[0])
                args = (a, rows, b, runtime.valid_offsets(offs, rows.shape[0]))
            else:
                a, b, offs = args
                args = (a, b, runtime.valid_offsets(offs, runtime.token_count(a, b)))
        except Exception as e:
            log.warning("inductor-cute %s dropped: its benchmark inputs: %s", self.description, first_line(e))
            return float("inf")
        return super().benchmark(*args, out=out)

    def output_node(self):
        gated = self.kwargs.get("activation", "")
        form = f" ({gated} gate{'s gradient' if self.kwargs.get('gate_grad') else ''})" if gated else ""
        log.info("inductor-cute grouped GEMM %s%s chosen", self.description, form)
        name = f"{RUNTIME}.{_kernel_name(self.input_nodes, self.kwargs)}"
        return ir.TensorBox.create(CuteGroupedOut(layout=self.layout, inputs=self.input_nodes, kwargs=self.kwargs,
                                                  python_kernel_name=name))


def _gathers(inputs) -> bool:
    """Whether a choice's inputs are gathered rows' (a, rows, b, offs); the gate's gradient has five
    (a, b, offs, gate, up), every other form three."""
    return len(inputs) == 4


def _kernel_name(inputs, kwargs: dict) -> str:
    """The runtime function of a choice with these inputs and kwargs (`activation`: the gate;
    `gate_grad`: its gradient)."""
    if kwargs.get("gate_grad"):
        return "grouped_mm_gate_grad"
    if _gathers(inputs):
        return "grouped_mm_rows"
    return "grouped_mm_gated" if kwargs.get("activation") else "grouped_mm"


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


def new_rows_choice(name: str) -> CuteGroupedChoice:
    """Gathered rows' (gather.py, through gate_lowering.py): registers `runtime.grouped_mm_rows`."""
    return CuteGroupedChoice(runtime.grouped_mm_rows, name=name, has_out_variant=True)


def new_gate_grad_choice(name: str) -> CuteGroupedChoice:
    """The gate's gradient's (gate_grad.py, through gate_lowering.py): registers `runtime.grouped_mm_gate_grad`.
    Its choices' kwargs carry gate_grad=True."""
    return CuteGroupedChoice(runtime.grouped_mm_gate_grad, name=name, has_out_variant=True)


def new_unfused_choice(name: str) -> ExternKernelChoice:
    """Torch's kernels for a fused op's computation (runtime.grouped_mm_unfused): the choice our
    fused configs must beat."""
    return ExternKernelChoice(runtime.grouped_mm_unfused, name=name, has_out_variant=True)


# The hooks that register our extern kernels; inductor/install.py lists them with the others.
GROUPED_KERNEL = ExternKernel("grouped_extern_kernel", "inductor_cute_grouped_mm", lambda: new_grouped_choice)
GATED_KERNEL = ExternKernel("grouped_gated_extern_kernel", "inductor_cute_grouped_mm_gated", lambda: new_gated_choice)
ROWS_KERNEL = ExternKernel("grouped_rows_extern_kernel", "inductor_cute_grouped_mm_rows", lambda: new_rows_choice)
GATE_GRAD_KERNEL = ExternKernel("grouped_gate_grad_extern_kernel", "inductor_cute_grouped_mm_gate_grad",
                                lambda: new_gate_grad_choice)
UNFUSED_KERNEL = ExternKernel("grouped_unfused_extern_kernel", "inductor_cute_grouped_mm_unfused",
                              lambda: new_unfused_choice)


def grouped_choice() -> CuteGroupedChoice:
    return GROUPED_KERNEL.choice()


def gated_choice() -> CuteGroupedChoice:
    return GATED_KERNEL.choice()


def rows_choice() -> CuteGroupedChoice:
    return ROWS_KERNEL.choice()


def gate_grad_choice() -> CuteGroupedChoice:
    return GATE_GRAD_KERNEL.choice()


def unfused_choice() -> ExternKernelChoice:
    return UNFUSED_KERNEL.choice()
