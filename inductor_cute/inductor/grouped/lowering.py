"""`aten._grouped_mm` under torch.compile: our grouped GEMM's configurations join the stock
lowering's autotuning, beside ATen's `_grouped_mm` and Inductor's Triton template. Two forms are
served: the forward (2-D a x 3-D b, groups of tokens; the MoE backward's input gradient is this
form too, with b the transposed weight) and the weight gradient (2-D a x 2-D b, groups splitting
the reduction over tokens).

A third form, 3-D a x 3-D b without offsets, is a batched GEMM: it gets our bmm's choices
(gemm/choices.py), bound to the grouped call.

The stock lowering (torch/_inductor/kernel/mm_grouped.py) builds its choices and hands them to
`autotune_select_algorithm` with offsets its `input_gen_fns` make valid; it asks InductorChoices
nothing. So inductor/install.py installs two hooks: `grouped_mm_lowering` wraps the lowering and
announces a call in this thread (`_pending`), and `joining_select` stands in for the
`autotune_select_algorithm` that mm_grouped.py looks up at each call: when a call was announced, it
appends our choices for the lowering's own (realized) input nodes and output layout, then calls
the real one with everything else unchanged but the offsets every choice is timed on: routed group
sizes instead of the stock even split (`_with_routed_offsets`). Without an announcement (another
lowering of that module, our backend not requested) it only passes the call through. (Inductor's
autotuning cache then holds the stock choices' routed timings too: a later stock compile of the
same shapes that finds every choice cached reuses them.)

Which calls we serve is `decline_reason(GroupedCall)`: plain values, testable without a graph. A
call we decline gets no choice of ours and the stock behaviour, with the reason logged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading

import torch
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V

from ...errors import first_line
from ...host.common import sm_count
from ...kernels.gemm import grouped_config, grouped_wgrad_config
from ..gemm.choices import _static, backend_requested

log = logging.getLogger(__name__)

OP = torch.ops.aten._grouped_mm.default
_pending = threading.local()  # .offer: the _Offer of the lowering call under way in this thread


@dataclasses.dataclass(frozen=True)
class _Offer:
    has_bias: bool


# ---------------------------------------------------------------------------- the decision

@dataclasses.dataclass(frozen=True)
class GroupedCall:
    """What decides whether our kernel serves a `_grouped_mm` call. Sizes and strides are ints, or
    None where symbolic; `offs_size` is None without offsets."""

    a_size: tuple
    a_stride: tuple
    b_size: tuple
    b_stride: tuple
    offs_size: tuple | None
    out_size: tuple
    out_stride: tuple
    a_dtype: torch.dtype = torch.bfloat16
    b_dtype: torch.dtype = torch.bfloat16
    offs_dtype: torch.dtype | None = torch.int32
    out_dtype: torch.dtype = torch.bfloat16
    has_bias: bool = False
    device_type: str = "cuda"
    output_code: str = "python"  # or "cpp_wrapper", "aot"


def _tma_mode(size: tuple, stride: tuple, modes: tuple) -> int | None:
    """The first of `modes` that can be the unit-stride mode of a TMA view in place (the test
    host/common.tma_view makes on tensors, without the base address): that mode of stride 1 (or
    extent 1), every other one of extent 1 or a stride of a positive multiple of 8 elements."""
    for unit in modes:
        if size[unit] != 1 and stride[unit] != 1:
            continue
        if all(i == unit or size[i] == 1 or (stride[i] is not None and stride[i] > 0 and stride[i] % 8 == 0)
               for i in range(len(size))):
            return unit
    return None


def b_major(call: GroupedCall) -> str | None:
    """How our kernel reads b (groups, K, N) in place, as ops.grouped_mm picks it: "k" (the
    transposed view of an (groups, N, K) weight) or "n" (row-major); None when it would copy b."""
    mode = _tma_mode(call.b_size, call.b_stride, (1, 2))
    return None if mode is None else ("k" if mode == 1 else "n")


def is_wgrad(call: GroupedCall) -> bool:
    """The weight-gradient form: 2-D a (M, tokens) x 2-D b (tokens, N) -> (groups, M, N)."""
    return len(call.a_size) == 2 and len(call.b_size) == 2


def wgrad_majors(call: GroupedCall) -> tuple[str, str] | None:
    """How the weight-gradient kernel reads a (M, tokens) and b (tokens, N) in place, as
    ops.grouped_mm picks it: (a_major "m" or "k", b_major "n" or "k"); None when it would copy.
    Tokens contiguous only when their count is a static multiple of 8, as ops.grouped_mm takes them."""
    tokens = call.b_size[0]
    token_major = tokens is not None and tokens % 8 == 0
    a_mode = _tma_mode(call.a_size, call.a_stride, (0, 1)[:1 + token_major])
    b_mode = _tma_mode(call.b_size, call.b_stride, (1, 0)[:1 + token_major])
    if a_mode is None or b_mode is None:
        return None
    return ("m" if a_mode == 0 else "k"), ("n" if b_mode == 1 else "k")


def decline_reason(call: GroupedCall) -> str | None:
    """Why our grouped GEMM does not serve this call, in one line; None when it does: the forward
    form (2-D a, 3-D b) or the weight-gradient form (2-D a, 2-D b), with offsets and no bias, in
    bf16, every size but the token count static, every operand read in place by TMA; or the
    batched form (3-D a, 3-D b, no offsets), which our bmm's own checks then decide."""
    if call.output_code != "python":
        return f"{call.output_code} output code is not supported"
    if call.device_type != "cuda":
        return f"device {call.device_type} is not CUDA"
    if is_batched(call):
        return None  # our bmm's configs, with their own checks (gemm/choices.py)
    if len(call.a_size) != 2 or len(call.b_size) not in (2, 3):
        return (f"only 2-D a x 3-D b (MoE forward), 2-D a x 2-D b (weight gradient) and 3-D x 3-D without "
                f"offsets (batched) are supported, got {len(call.a_size)}-D x {len(call.b_size)}-D")
    if call.offs_size is None:
        return "no offsets"
    if call.has_bias:
        return "a bias is not supported"
    if (call.a_dtype, call.b_dtype, call.out_dtype) != (torch.bfloat16,) * 3:
        return f"dtypes {call.a_dtype} x {call.b_dtype} -> {call.out_dtype} (need bfloat16 throughout)"
    if call.offs_dtype != torch.int32:
        return f"offsets of dtype {call.offs_dtype} (need int32)"
    if is_wgrad(call):
        return _wgrad_decline_reason(call)
    tokens, k = call.a_size
    groups, _, n = call.b_size
    if None in (k, n, groups) or call.offs_size != (groups,):
        return "K, N and the group count must be static"
    if tokens == 0:
        return "no tokens"
    reason = grouped_config.unsupported_reason(grouped_config.GroupedProblem(), n=n, k=k, groups=groups)
    if reason:
        return reason
    if _tma_mode(call.a_size, call.a_stride, (1,)) is None:
        return f"a of strides {call.a_stride} is not row-major with 16-byte rows (it would be copied)"
    if b_major(call) is None:
        return f"b of strides {call.b_stride} is neither K- nor N-major with 16-byte rows (it would be copied)"
    if _tma_mode(call.out_size, call.out_stride, (1,)) is None:
        return f"the output of strides {call.out_stride} is not row-major with 16-byte rows"
    return None


def is_batched(call: GroupedCall) -> bool:
    """3-D a x 3-D b without offsets: one GEMM per group, all of one size (torch.bmm's form)."""
    return len(call.a_size) == 3 and len(call.b_size) == 3 and call.offs_size is None and not call.has_bias


def _wgrad_decline_reason(call: GroupedCall) -> str | None:
    m, tokens = call.a_size
    n = call.b_size[1]
    groups = call.offs_size[0] if len(call.offs_size) == 1 else None
    if None in (m, n, groups):
        return "M, N and the group count must be static"
    if len(call.out_size) != 3:
        return f"the output of shape {call.out_size} is not (groups, M, N)"
    if tokens == 0:
        return "no tokens"
    reason = grouped_wgrad_config.unsupported_reason(grouped_wgrad_config.WgradProblem(), m=m, n=n, groups=groups)
    if reason:
        return reason
    if wgrad_majors(call) is None:
        return (f"a of strides {call.a_stride} or b of strides {call.b_stride} cannot be read in place by TMA "
                f"(it would be copied)")
    if _tma_mode(call.out_size, call.out_stride, (2,)) is None:
        return f"the output of strides {call.out_stride} is not row-major with 16-byte rows"
    return None


def _ints(exprs) -> tuple:
    return tuple(_static(e) for e in exprs)


def grouped_call(input_nodes, layout, has_bias: bool) -> GroupedCall:
    """The GroupedCall of the stock lowering's input nodes ([a, b, offs] with offsets) and output
    layout."""
    a, b, *rest = input_nodes
    offs = rest[0] if rest else None
    graph = V.graph
    output_code = "aot" if getattr(graph, "aot_mode", False) else "cpp_wrapper" if graph.cpp_wrapper else "python"
    return GroupedCall(
        a_size=_ints(a.get_size()), a_stride=_ints(a.get_stride()),
        b_size=_ints(b.get_size()), b_stride=_ints(b.get_stride()),
        offs_size=_ints(offs.get_size()) if offs is not None else None,
        out_size=_ints(layout.size), out_stride=_ints(layout.stride),
        a_dtype=a.get_dtype(), b_dtype=b.get_dtype(), offs_dtype=offs.get_dtype() if offs is not None else None,
        out_dtype=layout.dtype, has_bias=has_bias, device_type=layout.device.type,
        output_code=output_code)


# ------------------------------------------------------------------------------ our choices

def _describe(call: GroupedCall, tokens: int) -> str:
    if is_wgrad(call):
        (m, _), (_, n), (groups,) = call.a_size, call.b_size, call.offs_size
        return f"{m}x{n} over {tokens} tokens in {groups} groups (weight gradient)"
    groups, k, n = call.b_size
    return f"{tokens}x{n}x{k} in {groups} groups"


def _problem_and_configs(call: GroupedCall, tokens: int, num_sms: int, exhaustive: bool):
    """(problem, candidate configs, config module) of a call we serve."""
    if is_wgrad(call):
        m, n, groups = call.a_size[0], call.b_size[1], call.offs_size[0]
        problem = grouped_wgrad_config.WgradProblem("bfloat16", "bfloat16", *wgrad_majors(call))
        return (problem, grouped_wgrad_config.candidates(problem, m, n, tokens, groups, num_sms, exhaustive),
                grouped_wgrad_config)
    groups, k, n = call.b_size
    problem = grouped_config.GroupedProblem("bfloat16", "bfloat16", "k", b_major(call))
    return problem, grouped_config.candidates(problem, tokens, n, k, groups, num_sms, exhaustive), grouped_config


def _bmm_inputs(input_nodes, layout):
    from torch._inductor.kernel_inputs import MMKernelInputs

    return MMKernelInputs(list(input_nodes), out_dtype=layout.dtype)


def _m_robust_only(input_nodes, layout, has_bias: bool) -> bool:
    """Whether a batched call's M is dynamic and our M-bucket table serves it: then, as for bmm
    (gemm/choices.py m_robust_only), Triton templates tuned at the hint M leave the autotuning."""
    from ..gemm.choices import m_robust_only

    return is_batched(grouped_call(input_nodes, layout, has_bias)) and \
        m_robust_only(_bmm_inputs(input_nodes, layout), "bmm")


def device_reason(device) -> str | None:
    """Why our kernels cannot run on `device` (not a Hopper GPU), in one line."""
    from ...runtime.arch import device_arch

    try:
        device_arch(device.index or 0)
    except Exception as e:
        return first_line(e)
    return None


def exhaustive_search() -> bool:
    return inductor_config.max_autotune_gemm_search_space == "EXHAUSTIVE"


def bound_choices(choice, input_nodes, layout, problem, configs: list, config_module, num_sms: int, **kwargs) -> list:
    """`choice` bound to these nodes and layout once per config that compiled (in order; `kwargs`
    join each one's, as the extern kernel takes them)."""
    from ..gemm.specs import precompile_choices
    from .runtime import as_tuple

    ready = precompile_choices(problem, configs, num_sms, spec_of=config_module.spec)
    return [choice.bind(input_nodes, layout, spec_key=spec_key, description=cfg.describe(), problem=problem,
                        num_sms=num_sms, config=as_tuple(cfg), **kwargs)
            for cfg, spec_key in ready]


def grouped_choices(input_nodes, layout, has_bias: bool) -> list:
    """Our choices for one stock autotuning call: one per candidate config that compiled; [] when
    we cannot serve the call (the reason logged)."""
    call = grouped_call(input_nodes, layout, has_bias)
    reason = decline_reason(call)
    if reason is None and is_batched(call):  # a bmm: our GEMM's configs, with its own checks
        from ..gemm.choices import gemm_choices

        return gemm_choices(_bmm_inputs(input_nodes, layout), "bmm", layout=layout)
    reason = reason or device_reason(layout.device)
    if reason:
        log.info("inductor-cute skips grouped_mm %s x %s: %s", call.a_size, call.b_size, reason)
        return []
    from .extern import grouped_choice

    tokens_mode = 1 if is_wgrad(call) else 0  # a (M, tokens) or (tokens, K)
    tokens = V.graph.sizevars.optimization_hint(input_nodes[0].get_size()[tokens_mode])
    num_sms = sm_count(layout.device.index or 0)  # what ops.grouped_mm compiles for
    problem, configs, config_module = _problem_and_configs(call, tokens, num_sms, exhaustive_search())
    choices = bound_choices(grouped_choice(), input_nodes, layout, problem, configs, config_module, num_sms)
    majors = f"a {problem.a_major}-major, b {problem.b_major}-major" if is_wgrad(call) else f"b {problem.b_major}-major"
    log.info("inductor-cute offers %d of %d choices for grouped_mm %s (%s)", len(choices), len(configs),
             _describe(call, tokens), majors)
    return choices


# ---------------------------------------------------------------------------- the two hooks

def joining_select(select):
    """What stands in for mm_grouped.py's `autotune_select_algorithm` (`select`): adds our choices
    to the call our lowering announced in this thread, then calls `select` as it was called (its
    return value, a node in torch 2.11 and (node, choice) in 2.12+, passed through)."""

    @functools.wraps(select)
    def select_with_ours(name, choices, input_nodes, layout, *args, **kwargs):
        offer = getattr(_pending, "offer", None)
        if offer is not None:
            _pending.offer = None
            try:
                joined, joined_kwargs = choices, kwargs
                ours = grouped_choices(input_nodes, layout, offer.has_bias)
                if ours and _m_robust_only(input_nodes, layout, offer.has_bias):
                    from torch._inductor.select_algorithm import TritonTemplateCaller

                    joined = [c for c in choices if not isinstance(c, TritonTemplateCaller)]
                if ours:
                    joined_kwargs = _with_routed_offsets(kwargs, input_nodes)
                # taken together, only once all of it worked: a failure leaves the stock call as it was
                choices, kwargs = [*joined, *ours], joined_kwargs
            except Exception as e:  # our choices are optional: never fail the user's compile
                log.warning("inductor-cute offers nothing for %s: %s", name, first_line(e))
        return select(name, choices, input_nodes, layout, *args, **kwargs)

    return select_with_ours


def _with_routed_offsets(kwargs: dict, input_nodes) -> dict:
    """`kwargs` with the offsets' input generator (input 2: [a, b, offs]) timing every choice on
    routed group sizes instead of the stock even split (runtime.routed_offsets says why)."""
    gens = kwargs.get("input_gen_fns") or {}
    even = gens.get(2)
    if even is None or len(input_nodes) != 3:
        return kwargs
    from .runtime import routed_offsets

    alignment = max(1, 16 // input_nodes[0].get_dtype().itemsize)  # torch's rounding of the ends
    routed = functools.wraps(even)(lambda node: routed_offsets(even(node), alignment))
    return {**kwargs, "input_gen_fns": {**gens, 2: routed}}


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def grouped_mm_lowering(*args, **kwargs):
    """`aten._grouped_mm.default`'s lowering while enabled: the stock one, announcing the call
    when our backend is requested (max-autotune with our token) so that `joining_select` adds
    our choices to its autotuning."""
    from ..hooks import stock_lowering

    stock = stock_lowering(OP)
    if not backend_requested():
        return stock(*args, **kwargs)
    _pending.offer = _Offer(has_bias=_argument(args, kwargs, 3, "bias") is not None)
    try:
        return stock(*args, **kwargs)
    finally:
        if getattr(_pending, "offer", None) is not None:
            log.info("inductor-cute: the stock grouped_mm lowering made no autotuning call we could join")
        _pending.offer = None
