"""Our GEMM as a template node that pointwise epilogues fuse into.

When our choice wins autotuning it enters the graph as a CuteGemmTemplateBuffer. Inductor's
scheduler then asks the CUDA backend whether a following pointwise node may fuse; our scheduling
(installed by inductor/install.py for "cuda" when fusing) says yes when the node translates into
an epilogue program (gemm/epilogue.py), and at code generation defines a launcher of our runtime
for that program (codegen.define_launcher) and calls it once. Everything else is delegated to the
stock CUDA scheduling.
"""

from __future__ import annotations

import dataclasses
import logging

import sympy

from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.codegen import common
from torch._inductor.codegen.cuda_combined_scheduling import CUDACombinedScheduling
from torch._inductor.scheduler import BaseScheduling
from torch._inductor.virtualized import V

from ...errors import CompileError, first_line
from ...host.common import DTYPE_NAMES
from ...kernels.gemm import family
from .buckets import configs_of, with_configs
from .epilogue import Operand, translate
from .codegen import define_launcher, is_static, layout_exprs

log = logging.getLogger(__name__)


class CuteGemmTemplateBuffer(ir.TemplateBuffer):
    def __init__(self, layout, inputs, *, op: str, kwargs: dict, problem, num_sms: int):
        super().__init__(layout, inputs, None)
        self.op = op
        self.kwargs = kwargs  # what the unfused call passes: op, config, alpha, beta
        self.alpha = float(kwargs.get("alpha", 1.0))
        self.beta = float(kwargs.get("beta", 1.0))
        self.problem = problem  # GemmProblem of the unfused GEMM
        self.num_sms = num_sms

    def fused_problem(self, epi):
        return dataclasses.replace(self.problem, out_dtype_name=DTYPE_NAMES[epi.out.get_dtype()],
                                   has_bias=epi.row is not None, has_c=epi.full is not None,
                                   activation="identity", epilogue=epi.program)


def _ours(node) -> CuteGemmTemplateBuffer | None:
    template = node.get_template_node() if node is not None else None
    return template if isinstance(template, CuteGemmTemplateBuffer) else None


def _operand_arg(operand: Operand | None, size) -> str:
    if operand is None:
        return "None"
    wrapper = V.graph.wrapper_code
    sizes = [size[-1]] if all(s == 0 for s in operand.strides[:-1]) else list(size)
    strides = [1] if len(sizes) == 1 else list(operand.strides)
    return (f"reinterpret_tensor({operand.name}, {wrapper.codegen_shape_tuple(sizes)}, "
            f"{wrapper.codegen_shape_tuple(strides)}, {wrapper.codegen_sizevar(sympy.sympify(operand.offset))})")


class CuteGemmScheduling(BaseScheduling):
    def can_fuse_vertical(self, node1, node2) -> bool:
        template = _ours(node1)
        if template is None or _ours(node2) is not None:
            return False
        fused = [*(n for n in node1.get_nodes() if not n.is_template()), *node2.get_nodes()]
        try:
            epi = translate(template, fused)
        except NotImplementedError as e:
            log.debug("inductor-cute does not fuse %s into %s: %s", node2.get_name(), template.get_name(), e)
            return False
        except Exception as e:  # a gap in the translator must cost the fusion, not the compile
            log.warning("inductor-cute does not fuse %s: %s", node2.get_name(), first_line(e))
            return False
        names = {n.get_name() for n in (*node1.get_nodes(), *node2.get_nodes())}
        intermediates = [template.get_name(), *epi.written[:-1]]
        outputs = set(V.graph.get_output_names())
        for buf in intermediates:
            if buf in outputs or not self.scheduler.can_buffer_be_removed_through_fusion(buf, names):
                log.debug("inductor-cute does not fuse %s: %s is used elsewhere", node2.get_name(), buf)
                return False
        problem = template.fused_problem(epi)
        unfit = [cfg for cfg in configs_of(template.kwargs["config"]) if family.fitted_config(problem, cfg) is None]
        if unfit:
            log.debug("inductor-cute does not fuse %s: %s", node2.get_name(),
                      family.unsupported_reason(problem, unfit[0]))
            return False
        log.debug("inductor-cute fuses %s into %s", node2.get_name(), template.get_name())
        return True

    def can_fuse_horizontal(self, node1, node2) -> bool:
        return False

    def codegen_template(self, template_node, epilogue_nodes, prologue_nodes):
        from ...runtime import precompile

        assert not prologue_nodes
        template = _ours(template_node)
        wrapper = V.graph.wrapper_code
        kw = template.kwargs
        if epilogue_nodes:
            epi = translate(template, list(epilogue_nodes))
            names = {n.get_name() for n in (template_node, *epilogue_nodes)}
            for buf in (template.get_name(), *epi.written[:-1]):
                if self.scheduler.can_buffer_be_removed_through_fusion(buf, names):
                    V.graph.removed_buffers.add(buf)
            problem = template.fused_problem(epi)
            # every config the launcher may pick (an M-bucket table has several), fitted to the epilogue
            configs = [family.fitted_config(problem, cfg) for cfg in configs_of(kw["config"])]
            results = precompile([family.spec(problem, cfg, template.num_sms) for cfg in configs])
            for result in results:
                if result.status == "failed":  # past the point where Inductor could pick another kernel
                    raise CompileError(f"inductor-cute: the fused GEMM for {template.get_name()} failed to compile: "
                                       f"{result.error}")
            out = epi.out
            mats = template.inputs[-2:]
            size = template.get_size()
            out_ref = out.codegen_reference()
            if list(out.get_size()) != list(size):  # same elements, row-major (translate checks): the GEMM's view
                out_ref = (f"reinterpret_tensor({out_ref}, {wrapper.codegen_shape_tuple(size)}, "
                           f"{wrapper.codegen_shape_tuple(template.get_layout().stride)}, "
                           f"{wrapper.codegen_sizevar(out.get_layout().offset)})")
            operands = [op for op in (epi.row, epi.full) if op is not None]
            static = is_static(*(e for node in (*mats, template, out) for e in layout_exprs(node)),
                               *(e for op in operands for e in (*op.strides, op.offset)))
            launcher = define_launcher(wrapper, op="bmm" if len(size) == 3 else "mm",
                                       config=with_configs(kw["config"], configs), epilogue=epi.program,
                                       static=static)
            args = [*(m.codegen_reference() for m in mats), out_ref, _operand_arg(epi.row, size),
                    _operand_arg(epi.full, size)]
            log.info("inductor-cute fused %d epilogue node(s) into %s", len(epilogue_nodes), template.get_name())
        else:
            static = is_static(*(e for node in (*template.inputs, template) for e in layout_exprs(node)))
            launcher = define_launcher(wrapper, static=static, **kw)
            args = [*(inp.codegen_reference() for inp in template.inputs), template.codegen_reference()]
        call = f"{launcher}({', '.join(args)})"
        for node in (template_node, *epilogue_nodes):
            node.mark_run()
        wrapper.writeline(call)
        self.free_buffers_in_scheduler()


class CuteCUDAScheduling(CUDACombinedScheduling):
    """The stock CUDA scheduling, with our template nodes handled by CuteGemmScheduling."""

    def __init__(self, scheduler) -> None:
        super().__init__(scheduler)
        self._cute_scheduling = CuteGemmScheduling(scheduler)

    def can_fuse_vertical(self, node1, node2) -> bool:
        if _ours(node1) is not None or _ours(node2) is not None:
            return self._cute_scheduling.can_fuse_vertical(node1, node2)
        return super().can_fuse_vertical(node1, node2)

    def can_fuse_horizontal(self, node1, node2) -> bool:
        if _ours(node1) is not None or _ours(node2) is not None:
            return False
        return super().can_fuse_horizontal(node1, node2)

    def codegen_template(self, template_node, epilogue_nodes, prologue_nodes):
        if _ours(template_node) is not None:
            return self._cute_scheduling.codegen_template(template_node, epilogue_nodes, prologue_nodes)
        return super().codegen_template(template_node, epilogue_nodes, prologue_nodes)


class CudaSchedulingConstructor:
    """What inductor/install.py puts in place of the CUDA backend's scheduling constructor when
    fusing: Inductor's CUDA entry picks a scheduling by config.cuda_backend, and ours replaces only
    Triton's; any other backend gets the scheduling we replaced."""

    def __init__(self, replaced) -> None:
        self.replaced = replaced

    def __call__(self, scheduler):
        if inductor_config.cuda_backend != "triton":
            return self.replaced(scheduler)
        return CuteCUDAScheduling(scheduler)


def scheduling_installed() -> bool:
    """Whether template nodes of ours will reach CuteCUDAScheduling."""
    entry = common.device_codegens.get("cuda")
    return (entry is not None and isinstance(entry.scheduling, CudaSchedulingConstructor)
            and inductor_config.cuda_backend == "triton")
