"""The fused MoE gate's op (`inductor_cute::grouped_mm_gated`, gate.py) under max-autotune with our
backend: its configs are autotuned like `_grouped_mm`'s (timed on routed group sizes), where
otherwise Inductor would call the op as a fallback kernel with the untuned heuristic config.

gate.py gives the op Inductor's fallback lowering when it defines the op (`ensure_fallback`); with
enable()'s fuse_moe_gate not False, inductor/install.py puts `gated_lowering` in its place (a
LoweringWrapper), which autotunes where our backend is requested and our kernel serves the call
(grouped/lowering.py's decline reasons, the gated kernel's limits), and otherwise calls that
fallback. Our configs compete with torch's kernels computing the same unfused
(runtime.grouped_mm_unfused: the grouped_mm, the gather and the gate's pointwise ops in eager), so a
fusion is kept only where it measures faster than not fusing. A config whose benchmark failed may
still be picked (every time infinite): its launcher then runs the computation unfused
(runtime.GroupedLauncher), as the op itself does.
"""

from __future__ import annotations

import dataclasses
import logging

from ...errors import first_line

log = logging.getLogger(__name__)
NAME = "grouped_mm_gated"


def ensure_fallback(op) -> None:
    """Inductor's lowering of a custom op, registered now as Inductor registers one at the op's
    first use (graph.py's implicit fallback: a fallback kernel, the layout constraint the op's tags
    ask for, exact strides by default), so that our wrapper has a stock lowering to stand in for
    and to fall back to."""
    from torch._inductor import lowering

    if op in lowering.lowerings:
        return
    try:
        from torch._library.utils import get_layout_constraint_tag

        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
    except (ImportError, AttributeError, TypeError):  # another torch's spelling: no constraint
        constraint = None
    lowering.make_fallback(op, layout_constraint=constraint, warn=False)


def gated_lowering(a, b, offs, activation: str):
    """The gate op's lowering while enable()'s fuse_moe_gate is not False: autotuned when our backend is
    requested and the choices build, else the fallback kernel."""
    import torch

    return _lowering(torch.ops.inductor_cute.grouped_mm_gated.default, (a, b, offs, activation),  # gate.OP
                     lambda: _autotuned(a, None, b, offs, activation))


def rows_lowering(a, rows, b, offs, activation: str):
    """The gathered rows' op's lowering (gather.py) while fuse_moe_gather is not False: as the gate's."""
    import torch

    return _lowering(torch.ops.inductor_cute.grouped_mm_rows.default, (a, rows, b, offs, activation),  # gather.OP
                     lambda: _autotuned(a, rows, b, offs, activation))


def gate_grad_lowering(a, b, offs, gate, up, activation: str):
    """The gate's gradient's op's lowering (gate_grad.py) while fuse_moe_gate is not False: as the gate's."""
    import torch

    return _lowering(torch.ops.inductor_cute.grouped_mm_gate_grad.default,  # gate_grad.OP
                     (a, b, offs, gate, up, activation), lambda: _autotuned(a, None, b, offs, activation, (gate, up)))


def _lowering(op, args: tuple, autotuned):
    from ..gemm.choices import backend_requested
    from ..hooks import stock_lowering

    if backend_requested():
        try:
            node = autotuned()
            if node is not None:
                return node
        except Exception as e:  # the fallback computes the same: never fail the user's compile
            log.warning("inductor-cute leaves %s to its fallback: %s", op, first_line(e))
    return stock_lowering(op)(*args)


def _autotuned(a, rows, b, offs, activation: str, halves: tuple = ()):
    """The autotuned node of the gated product of a and b (activation named), of the product of
    a's rows picked by `rows` (gated or not), or (given the saved gate and up `halves`) of the
    gate's gradient for the output gradient a @ b; None where no config of ours is ready (the
    reason logged)."""
    from torch._inductor.ir import FixedLayout
    from torch._inductor.select_algorithm import autotune_select_algorithm, realize_inputs
    from torch._inductor.virtualized import V

    from ...host.common import sm_count
    from ...kernels.gemm import grouped_config
    from .extern import gate_grad_choice, gated_choice, rows_choice, unfused_choice
    from .lowering import b_major, bound_choices, decline_reason, device_reason, exhaustive_search, grouped_call
    from .runtime import even_offsets, random_rows, routed_offsets

    name = "grouped_mm_rows" if rows is not None else "grouped_mm_gate_grad" if halves else NAME
    a, b, offs = realize_inputs(a, b, offs)
    if len(a.get_size()) != 2 or len(b.get_size()) != 3:
        return None
    groups, k, n = b.get_size()
    tokens = a.get_size()[0] if rows is None else rows.get_size()[0]  # the product's rows
    n_out = 2 * n if halves else n // 2 if activation else n
    layout = FixedLayout(a.get_device(), a.get_dtype(), [tokens, n_out], [n_out, 1])
    hints = V.graph.sizevars
    call = grouped_call([a, b, offs], layout, has_bias=False)
    if rows is not None:  # checked as a contiguous a of the product's rows (gather.py checked x's)
        k_hint = int(hints.optimization_hint(k))
        call = dataclasses.replace(call, a_size=(hints.optimization_hint(tokens), k_hint), a_stride=(k_hint, 1))
    groups, k, n = (int(hints.optimization_hint(x)) for x in (groups, k, n))
    rows_dtype = str(rows.get_dtype()).removeprefix("torch.") if rows is not None else ""
    gate, gate_grad = ("", activation) if halves else (activation, "")
    if halves:  # (the product's own checks: as an unfused call's output of n columns)
        call = dataclasses.replace(call, out_size=(call.out_size[0], n), out_stride=(n, 1))
    reason = decline_reason(call) or grouped_config.unsupported_reason(
        grouped_config.GroupedProblem(gate=gate, rows=rows_dtype, gate_grad=gate_grad), n=n, k=k, groups=groups) or \
        device_reason(layout.device)
    if reason:
        log.info("inductor-cute leaves %s %s x %s to its fallback: %s", name, call.a_size, call.b_size, reason)
        return None
    problem = grouped_config.GroupedProblem("bfloat16", "bfloat16", "k", b_major(call), gate, rows_dtype, gate_grad)
    tokens_hint = hints.optimization_hint(tokens)
    num_sms = sm_count(layout.device.index or 0)
    configs = grouped_config.candidates(problem, tokens_hint, n, k, groups, num_sms, exhaustive_search())
    if rows is not None:
        inputs, choice = [a, realize_inputs(rows), b, offs], rows_choice()
    elif halves:
        inputs, choice = [a, b, offs, *realize_inputs(*halves)], gate_grad_choice()
    else:
        inputs, choice = [a, b, offs], gated_choice()
    marks = {"gate_grad": True} if halves else {}
    choices = bound_choices(choice, inputs, layout, problem, configs, grouped_config, num_sms, activation=activation,
                            **marks)
    if not choices:
        log.info("inductor-cute: no config of %s compiled: its fallback", name)
        return None
    log.info("inductor-cute autotunes %d configs of %s for %sx%sx%s in %s groups", len(choices), name,
             tokens_hint, n_out, k, groups)
    # torch's kernels for the same computation compete: the fusion is taken only where it measures faster
    choices.insert(0, unfused_choice().bind(inputs, layout, activation=activation, **marks))
    alignment = max(1, 16 // a.get_dtype().itemsize)
    offsets_at = 2 if halves else len(inputs) - 1  # (a, b, offs, gate, up) or (a, [rows,] b, offs)
    timing = {offsets_at: lambda node: routed_offsets(even_offsets(tokens_hint, groups, alignment, node.get_device(),
                                                                   node.get_dtype()), alignment)}
    if rows is not None:  # each routed row's token, within a's rows
        a_rows = hints.optimization_hint(a.get_size()[0])
        timing[1] = lambda node: random_rows(tokens_hint, a_rows, node.get_dtype(), node.get_device())
    result = autotune_select_algorithm(name, choices, inputs, layout, input_gen_fns=timing)
    return result[0] if isinstance(result, tuple) else result  # (node, choice) from torch 2.12
