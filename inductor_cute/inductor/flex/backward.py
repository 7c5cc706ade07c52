"""The flex_attention backward HOP of a training graph under torch.compile, with
enable(flex_backward=True): a call whose forward runs our kernel (lowering.py) runs our backward
kernels (host.flex_backward); every other goes to the stock lowering, unchanged.

AOT autograd compiles the forward and the backward graphs separately. Each lowering builds the
call's FlexProblem from its own HOP's arguments (the same q, k, v, mods, block mask, scale and
kernel options) and asks the same `lowering.decline_reason`, whose training checks cover both
kernels (`lowering._training_reason`): our forward runs exactly when our backward does. One case
is decided here alone: a loss that depends on the logsumexp (grad_logsumexp) takes the stock
backward, which reads our forward's lse in the HOP's log2 units, as it reads its own.

A call we take is the custom op `torch.ops.inductor_cute.flex_backward` in the graph; output code
calls a runtime.FlexBackwardLauncher defined per call site (lowering._FlexCall).
"""

from __future__ import annotations

import logging

import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

from ...kernels.common.units import LOG2E
from . import lowering as _lowering
from . import runtime as _runtime

log = logging.getLogger(__name__)

_HOP = torch.ops.higher_order.flex_attention_backward

SCHEMA = ("flex_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, float scale, "
          "str score_mod, Tensor[] score_tensors, str mask_mod, Tensor[] mask_tensors, Tensor? kv_num_blocks, "
          "Tensor? kv_indices, Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor? q_num_blocks, "
          "Tensor? q_indices, Tensor? full_q_num_blocks, Tensor? full_q_indices, SymInt kv_block_size, "
          "SymInt q_block_size) "
          "-> (Tensor, Tensor, Tensor)")
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def register_kernel(device_type: str, fn) -> None:
    """Run `fn` (runtime.flex_backward's signature) for the op's calls on `device_type` ("cpu" for tests)."""
    _LIBRARY.impl("flex_backward", fn, torch._C._dispatch_key_for_device(device_type))


register_kernel("cuda", _runtime.flex_backward)


@torch.library.register_fake("inductor_cute::flex_backward", lib=_LIBRARY)
def _flex_backward_fake(q, k, v, out, lse, grad_out, *rest):
    """dq like q, dk like k, dv like v (contiguous, q's dtype)."""
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


class _FlexBackwardCall(_lowering._FlexCall):
    LAUNCHER = "FlexBackwardLauncher"

    @staticmethod
    def site(args: list) -> dict:
        return dict(scale=float(args[6]), score_mod=args[7], mask_mod=args[9], kv_block_size=int(args[19]),
                    q_block_size=int(args[20]))


def _flex_attention_backward(*args, **kwargs):
    captured = ()
    try:  # torch 2.11 and 2.13 pass these 14 by position; another count is a decision failure, not a crash
        (query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, _joint_graph, block_mask, scale,
         kernel_options, score_mod_other_buffers, mask_mod_other_buffers) = args
        captured = (*score_mod_other_buffers, *mask_mod_other_buffers)
        problem = None if V.graph.cpp_wrapper else _lowering._problem(
            query, key, value, fw_graph, block_mask, scale, kernel_options, score_mod_other_buffers,
            mask_mod_other_buffers)
        reason = _lowering._call_reason(problem, query, key)
        if not reason:
            (score_program, mask_program), _ = problem.translated
            reason = _captured_gradient_reason(_joint_graph, len(score_mod_other_buffers))
    except Exception as e:  # our decision must never fail a compile
        reason = f"the decision failed: {type(e).__name__}: {e}"
    if not reason and kwargs:
        reason = f"keyword arguments {sorted(kwargs)} we do not know"
    if not reason and grad_logsumexp is not None:
        reason = "the loss depends on the logsumexp (our backward takes no lse gradient; the stock one reads our lse)"
    if reason:
        from ..hooks import stock_lowering

        log.debug("inductor-cute: flex_attention backward left to the stock lowering: %s", reason)
        _lowering.realized(captured)  # as for the forward (a pad the partitioner recomputes here)
        return stock_lowering(_HOP)(*args, **kwargs)
    _lowering.add_guards(problem, query)
    log.info("inductor-cute: flex_attention backward %s runs our kernels (score program %r, mask program %r%s)",
             list(query.get_size()), score_program, mask_program,
             "" if problem.keys_all_in_blocks else ", a block mask")
    kv_block, q_block = problem.block_sizes
    lists = [*_lowering._block_mask_fields(block_mask)[:4], *_lowering._backward_lists(block_mask)]
    if problem.keys_all_in_blocks:  # flex_attention's "no block mask": every key of every query
        lists, kv_block, q_block = [None] * 8, 0, 0
    device = query.get_device()
    score_buffers = _lowering.kernel_buffers(score_mod_other_buffers, problem.score_buffers, device)
    mask_buffers = _lowering.kernel_buffers(mask_mod_other_buffers, problem.mask_buffers, device)
    from torch._inductor.lowering import lowerings

    lse = lowerings[torch.ops.aten.mul.Tensor](logsumexp, 1 / LOG2E)  # the HOP's log2 units -> natural log
    dq, dk, dv = (ir.TensorBox.create(x) for x in _FlexBackwardCall.create(
        torch.ops.inductor_cute.flex_backward.default, query, key, value, out, lse, grad_out, float(scale),
        score_program, score_buffers, mask_program, mask_buffers, *lists, kv_block, q_block))
    # no captured tensor of the score_mod needs a gradient (_captured_gradient_reason)
    return dq, dk, dv, tuple(None for _ in score_mod_other_buffers)


def _captured_gradient_reason(joint_graph, n_captured: int) -> str | None:
    """Why our backward cannot serve a call whose score_mod captures tensors: one of them needs a
    gradient (the joint graph computes one for it: our kernels compute none), or the joint graph is
    not one we can read. None without captured tensors, or when none needs a gradient."""
    if n_captured == 0:
        return None
    try:
        (outputs,) = [node.args[0] for node in joint_graph.graph_module.graph.nodes if node.op == "output"]
        grads = list(outputs)[-n_captured:]
    except Exception as e:  # another torch's joint graph: decline rather than guess
        return f"the score_mod's joint graph could not be read ({type(e).__name__}: {e})"
    if any(g is not None for g in grads):
        return "a tensor the score_mod captures needs a gradient (our backward computes none)"
    return None
