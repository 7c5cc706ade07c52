"""Adds our GEMM choices to Inductor's mm/addmm/bmm/baddbmm autotuning through InductorChoices."""

from __future__ import annotations

import logging
import weakref

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

from ...errors import first_line
from ...host.common import DTYPE_NAMES
from ..settings import Settings

log = logging.getLogger(__name__)

BACKEND_TOKEN = "ICUTE"
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
# A call whose template list holds one of these (or is empty, when only our backend is enabled)
# is where a lowering asks for its main choices; 2.13's addmm asks several times, we attach once.
ANCHOR_UIDS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "triton::mm", "triton::bmm"}


def _gemm_backends() -> list[str]:
    return [b.strip().upper() for b in inductor_config.max_autotune_gemm_backends.split(",")]


def backend_requested() -> bool:
    return BACKEND_TOKEN in _gemm_backends() and bool(inductor_config.max_autotune or inductor_config.max_autotune_gemm)


class CuteChoices(InductorChoices):
    """InductorChoices that also offers inductor-cute GEMMs when our backend token is enabled.

    `tag` names our version and settings; Inductor puts it in the FX-graph cache key (2.13 calls
    `uuid()`, 2.11 pickles the functools.partial that carries it). `settings` are enable()'s, read
    while lowering and scheduling through `install.active_settings()`."""

    def __init__(self, tag: str = "", settings: Settings = Settings()) -> None:
        super().__init__()
        self._tag = tag
        self.settings = settings
        self._attached: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def uuid(self) -> str:
        return self._tag

    def get_template_configs(self, kernel_inputs, templates, op_name, kwarg_overrides=None):
        choices = super().get_template_configs(kernel_inputs, templates, op_name, kwarg_overrides)
        if op_name in GEMM_OPS and backend_requested() and _m_robust_only_or_false(kernel_inputs, op_name):
            choices = [c for c in choices if not _template_uid(c).startswith("triton")]
        if op_name in GEMM_OPS and backend_requested() and self._first_ask(kernel_inputs, templates, op_name):
            try:
                choices.extend(gemm_choices(kernel_inputs, op_name))
            except Exception as e:  # our choices are optional: never fail the user's compile
                log.warning("inductor-cute offers nothing for %s: %s", op_name, first_line(e))
        return choices

    @staticmethod
    def can_fuse(scheduler, node1, node2, shared_data_score):
        # torch 2.11 scores a fusion by exact dependency index, so the (B, S, N) epilogue of our
        # (M, N) GEMM scores 0 ("no shared data") before our scheduling is asked; count what it
        # reads of our template by buffer name, as 2.13 does for templates.
        from torch._inductor.dependencies import MemoryDep, StarDep

        from .template import _ours

        template = _ours(node1)
        if shared_data_score == 0 and template is not None and _ours(node2) is None:
            shared_data_score = sum(scheduler.dep_size_hint(d) for d in node2.read_writes.reads
                                    if isinstance(d, (MemoryDep, StarDep)) and d.name == template.get_name())
        return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

    def _first_ask(self, kernel_inputs, templates, op_name) -> bool:
        if templates and not any(getattr(t, "uid", None) in ANCHOR_UIDS for t in templates):
            return False
        seen = self._attached.setdefault(V.graph, set())
        key = (op_name, *map(id, kernel_inputs.mat1mat2()))
        if op_name in ("addmm", "baddbmm"):  # the same matrices with another input is another GEMM
            key += (kernel_inputs.nodes()[0].get_name(),)
        if key in seen:
            return False
        seen.add(key)
        return True


def _template_uid(choice) -> str:
    return getattr(getattr(choice, "template", None), "uid", "") or ""


def m_robust_only(kernel_inputs, op_name) -> bool:
    """Whether only choices that adapt to each call's M may compete: for a dynamic M that our
    M-bucket table serves, beside cuBLAS (the ATen choices, which pick their kernel per call).
    Inductor times every choice at the hint M and the winner serves every M; a Triton template
    is one tile for all of them, and one tuned at 17 rows ran 4096 rows at half cuBLAS's speed
    (gemm_dynamic-h200-20261205-s17: the enabled dynamic MLP 2096 us against 1012 us static)."""
    return "ATEN" in _gemm_backends() and _dynamic_m(kernel_inputs) and unsupported_reason(kernel_inputs, op_name) is None


def _m_robust_only_or_false(kernel_inputs, op_name) -> bool:
    try:
        return m_robust_only(kernel_inputs, op_name)
    except Exception as e:  # the stock choices stay as they are: never fail the user's compile
        log.warning("inductor-cute keeps every choice for %s: %s", op_name, first_line(e))
        return False


def _static(expr) -> int | None:
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_number else None


def unsupported_reason(kernel_inputs, op_name) -> str | None:
    """Why our kernels cannot serve this GEMM, or None. Everything the runtime could refuse is
    refused here, so a chosen kernel never fails on its inputs."""
    from ...runtime.arch import device_arch

    if V.graph.cpp_wrapper or getattr(V.graph, "aot_mode", False):
        return "cpp_wrapper / AOTInductor output code is not supported"
    device = kernel_inputs.device()
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    try:
        device_arch(device.index or 0)
    except Exception as e:
        return first_line(e)
    mat1, mat2 = kernel_inputs.mat1mat2()
    if mat1.get_dtype() not in (torch.bfloat16, torch.float16) or mat2.get_dtype() != mat1.get_dtype():
        return f"dtypes {mat1.get_dtype()}/{mat2.get_dtype()} (need bfloat16 or float16 for both)"
    if kernel_inputs.out_dtype() not in DTYPE_NAMES:
        return f"output dtype {kernel_inputs.out_dtype()}"
    _, n, k = kernel_inputs.mnk_symbolic()
    n, k = _static(n), _static(k)
    if n is None or k is None:
        return "N and K must be static (M may be dynamic)"
    if n % 8 or k % 8:
        return f"N={n} and K={k} must be multiples of 8 (16-byte TMA rows)"
    return None


def _gemv_candidates(kernel_inputs, problem, num_sms: int) -> list:
    """The decode GEMV's configs for an unbatched GEMM whose M is static and at most 16 (a
    dynamic M could outgrow it) against a K-major weight; [] otherwise."""
    from ...kernels.gemm import gemv_config

    m, n, k = (_static(x) for x in kernel_inputs.mnk_symbolic())
    if len(kernel_inputs.mat1mat2()[0].get_size()) != 2 or m is None:
        return []
    if gemv_config.unsupported_reason(problem, m=m, n=n, k=k) is not None:
        return []
    return gemv_config.candidates(problem, m, n, k, 1, num_sms)


def _dynamic_m(kernel_inputs) -> bool:
    return _static(kernel_inputs.mnk_symbolic()[0]) is None


def gemm_choices(kernel_inputs, op_name, layout=None) -> list:
    """One bound choice per candidate config that compiled; for a dynamic M instead one choice
    whose config is a table of M buckets (buckets.py), when all of its configs compiled: a single
    config tuned at the hint M would tie with the table's bucket there and, if it won, serve every
    other M. [] when we cannot serve this GEMM. `layout`: the output layout of the autotuning call
    the choices join (by default the GEMM's own)."""
    reason = unsupported_reason(kernel_inputs, op_name)
    m, n, k = kernel_inputs.mnk_hinted()
    if reason:
        log.info("inductor-cute skips %s %dx%dx%d: %s", op_name, m, n, k, reason)
        return []
    from ...kernels.gemm import config as gemm_config
    from ...kernels.gemm.family import as_tuple
    from . import buckets
    from .extern import gemm_choice
    from .specs import problem_for, precompile_choices, table_spec_key

    problem, batch = problem_for(kernel_inputs, op_name)
    num_sms = torch.cuda.get_device_properties(kernel_inputs.device()).multi_processor_count
    exhaustive = inductor_config.max_autotune_gemm_search_space == "EXHAUSTIVE"
    table, configs = (), []
    if _dynamic_m(kernel_inputs):
        table = buckets.bucket_configs(problem, n, k, batch, num_sms)
    else:
        # where the GEMV serves, WGMMA tiles are 1.4-1.8x slower than it (gemv-config-sweep-h200-
        # 20261203.txt): offering them only costs compile time and lets autotuning noise pick one
        configs = _gemv_candidates(kernel_inputs, problem, num_sms) or \
            gemm_config.candidates(problem, m, n, k, batch, num_sms, exhaustive)
    ready = precompile_choices(problem, configs or list(dict.fromkeys(cfg for _, cfg in table)), num_sms)
    scalars = {}
    if op_name in ("addmm", "baddbmm"):
        scalars = {"alpha": float(kernel_inputs.get_scalar("alpha")), "beta": float(kernel_inputs.get_scalar("beta"))}
    layout = layout or kernel_inputs.output_layout(flexible=False)
    choice, choices = gemm_choice(), []
    if table:
        keys = dict(ready)
        missing = [cfg.describe() for _, cfg in table if cfg not in keys]
        if missing:
            log.warning("inductor-cute offers no M-bucket table for %s: %s did not compile", op_name,
                        ", ".join(missing))
        else:
            choices.append(choice.bind(kernel_inputs.nodes(), layout, spec_key=table_spec_key(table, keys),
                                       description=buckets.describe(table), problem=problem, num_sms=num_sms,
                                       op=op_name, config=buckets.as_table_tuple(table), **scalars))
    for cfg, spec_key in ready if not table else ():
        choices.append(choice.bind(kernel_inputs.nodes(), layout, spec_key=spec_key, description=cfg.describe(),
                                   problem=problem, num_sms=num_sms, op=op_name, config=as_tuple(cfg), **scalars))
    log.info("inductor-cute offers %d of %d choices for %s %dx%dx%d (batch %d)%s",
             len(choices), len(configs) or 1, op_name, m, n, k, batch,
             f", M dynamic: one table of {len(table)} buckets" if table else "")
    return choices
