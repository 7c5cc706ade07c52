"""Attention training step (issue 15): forward + backward of flex attention, ours (host.flex_prefill
with its lse, then host.flex_backward, eager) vs stock flex_attention compiled (Triton) vs SDPA vs
flex_attention's FLASH backend (FlashAttention-4), bf16, beside the matmul bound.

Cases: issue 15's, a subset of flex_prefill's (same shapes, mods, inputs and BlockMasks).
Runners of a case (same q, k, v, grad_out and mods); each returns (out, dq, dk, dv):
  inductor_cute  flex_prefill(return_lse=True) then flex_attention_backward with the mask program
                 and both list sets of the BlockMask (the forward's KV lists, the backward's query
                 lists); left out with the reason where the backward cannot run the case (head
                 dims it has no kernel for, score_mod gradients)
  triton         stock flex_attention compiled, forward then backward through autograd, with the
                 BlockMask create_block_mask builds, in whichever of default and
                 max-autotune-no-cudagraphs mode times faster for the whole step (both in notes)
  aten           SDPA (is_causal, enable_gqa) forward and backward through autograd, for the plain
                 causal and non-causal cases only (as flex_prefill)
  flash          flex_attention compiled with kernel_options={"BACKEND": "FLASH"}, forward and
                 backward; left out with the reason where it does not run
Correctness: out, dq, dk and dv of every runner are checked, before timing, against an fp32
reference (untimed; autograd of the same math on the same bf16 inputs, chunked over queries),
atol 2e-2 of each reference tensor's largest magnitude (the gradients' scales differ by orders).
flops: the backward's five products, 2 * B * Hq * Lq * Lkv * (3 * Dqk + 2 * Dv), plus the
forward's two, 2 * B * Hq * Lq * Lkv * (Dqk + Dv), both over the kept fraction of (q, kv) pairs
(exact from the mask): matmul=True, the roofline is the matmul time of that work. A kernel that
recomputes products (ours computes S and dP twice) does more work than the count.
Bytes: forward q, k, v, out and lse once; backward q, k, v, out, grad_out and lse read and dq, dk,
dv written once.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import flex_attention

from ..case import Case, named
from . import flex_prefill as fp

NAMES = ["llama B4 H32/8 S4096 causal", "llama B2 H32/8 S16384 noncausal", "dsv2-lite B1 H16 S8192 causal",
         "doc-causal B1 H32 S16384", "sliding1024 B4 H32/8 S8192", "softcap50 B2 H16/8 S8192 causal"]
CASES = [next(p for p in fp.CASES if p.name == name) for name in NAMES]
QUICK = [CASES[0], CASES[3]]
BACKWARD_LISTS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
FLOPS_NOTE = ("flops: forward 2*B*Hq*Lq*Lkv*(Dqk+Dv) + backward 2*B*Hq*Lq*Lkv*(3*Dqk+2*Dv), "
              "both scaled by the kept fraction of (q, kv) pairs")


def cost(p: fp.Prefill, kept: int) -> tuple[int, int]:
    """(flops, bytes) of one forward and backward over the kept pairs, bf16 tensors, fp32 lse."""
    fwd_flops, fwd_bytes = fp.cost(p, kept)  # q, k, v and out once
    bwd_flops = 2 * p.b * p.hq * kept * (3 * p.dqk + 2 * p.dv)
    lse_bytes = 4 * p.b * p.hq * p.s
    grads_bytes = 2 * p.b * (p.hq * p.s * p.dqk + p.hkv * p.s * (p.dqk + p.dv))  # dq, dk, dv
    grad_out_bytes = 2 * p.b * p.hq * p.s * p.dv
    return fwd_flops + bwd_flops, 2 * fwd_bytes + 2 * lse_bytes + grad_out_bytes + grads_bytes


def make_inputs(p: fp.Prefill, kept: int, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """flex_prefill's q, k, v (peaked q) as autograd leaves, and grad_out (B, Hq, S, Dv) ~ N(0, 1)."""
    q, k, v = (t.requires_grad_() for t in fp.make_inputs(p, kept, device, dtype, seed))
    g = torch.Generator(device=device).manual_seed(seed + 1)
    grad_out = torch.randn(p.b, p.hq, p.s, p.dv, generator=g, device=device, dtype=dtype)
    return q, k, v, grad_out


def reference(q, k, v, grad_out, scale: float, mods: fp.Mods, max_scores: int = 1 << 26) -> tuple:
    """fp32 (out, dq, dk, dv): autograd through the attention of fp.reference (GQA, score_mod on
    the scaled scores, mask_mod's keys), one (batch, KV head) and at most `max_scores` scores at a
    time; dk and dv summed over the chunks and the query heads of a KV head. Every row of the
    suite's cases attends to a key (its own)."""
    b, hq, lq, dqk = q.shape
    hkv, lkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    f32 = dict(device=q.device, dtype=torch.float32)
    out, dq = torch.empty(b, hq, lq, dv, **f32), torch.empty(b, hq, lq, dqk, **f32)
    dk, dv_ = torch.zeros(b, hkv, lkv, dqk, **f32), torch.zeros(b, hkv, lkv, dv, **f32)
    rows = max(1, max_scores // (group * lkv))
    kv_idx = torch.arange(lkv, device=q.device)[None, None, :]
    with torch.enable_grad():
        for bi in range(b):
            batch = torch.tensor(bi, device=q.device)
            for g in range(hkv):
                heads = slice(g * group, (g + 1) * group)
                h_idx = torch.arange(g * group, (g + 1) * group, device=q.device)[:, None, None]
                kf, vf = (t[bi, g].detach().float().requires_grad_() for t in (k, v))
                for start in range(0, lq, rows):
                    stop = min(start + rows, lq)
                    q_idx = torch.arange(start, stop, device=q.device)[None, :, None]
                    qf = q[bi, heads, start:stop].detach().float().requires_grad_()
                    s = torch.matmul(qf, kf.T) * scale
                    if mods.score_mod is not None:
                        s = mods.score_mod(s, batch, h_idx, q_idx, kv_idx)
                    if mods.mask_mod is not None:
                        s = s.masked_fill(~mods.mask_mod(batch, h_idx, q_idx, kv_idx), float("-inf"))
                    o = torch.matmul(torch.softmax(s, dim=-1), vf)
                    gq, gk, gv = torch.autograd.grad(o, (qf, kf, vf), grad_out[bi, heads, start:stop].float())
                    out[bi, heads, start:stop] = o.detach()
                    dq[bi, heads, start:stop] = gq
                    dk[bi, g] += gk
                    dv_[bi, g] += gv
    return out, dq, dk, dv_


def autograd_step(attend: Callable, q, k, v, grad_out) -> Callable:
    """One training step of `attend(q, k, v)`: forward, then backward through autograd; returns
    (out, dq, dk, dv)."""

    def step():
        out = attend(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))

    return step


def ours_reason(p: fp.Prefill, mods: fp.Mods) -> str | None:
    """Why our backward cannot run the case (the host's own checks); None when it can."""
    from ...kernels.attention import flex_backward_config as fbc

    return fbc.unsupported_reason(p.dqk, p.dv, "bfloat16")


def backward_kwargs(mods: fp.Mods, block_mask) -> dict:
    """flex_attention_backward's keyword arguments: the score and mask programs and both list sets."""
    kw = dict(score_mod=mods.score_program, score_tensors=mods.score_tensors, mask_mod=mods.mask_program,
              mask_tensors=mods.mask_tensors)
    if block_mask is not None:
        forward = fp.ours_kwargs(mods, block_mask)
        kw.update({n: forward[n] for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                           "kv_block_size", "q_block_size")})
        kw.update({n: getattr(block_mask, n) for n in BACKWARD_LISTS})
    return kw


def ours_runner(p: fp.Prefill, mods: fp.Mods, q, k, v, grad_out, scale: float, block_mask):
    """(runner, note): flex_prefill with lse then flex_attention_backward, eager; (None, why) where
    the backward cannot run the case."""
    reason = ours_reason(p, mods)
    if reason:
        return None, f"inductor_cute omitted: {reason}"
    from ...host.flex_backward import flex_attention_backward
    from ...host.flex_prefill import flex_prefill

    q, k, v = q.detach(), k.detach(), v.detach()
    forward_kw, backward_kw = fp.ours_kwargs(mods, block_mask), backward_kwargs(mods, block_mask)

    def step():
        out, lse = flex_prefill(q, k, v, scale=scale, return_lse=True, **forward_kw)
        return (out, *flex_attention_backward(q, k, v, out, lse, grad_out, scale=scale, **backward_kw))

    return step, "inductor_cute: flex_prefill (return_lse) then flex_attention_backward, eager"


def _flex(scale: float, kwargs: dict, kernel_options: dict | None = None) -> Callable:
    def attend(q, k, v):
        return flex_attention(q, k, v, scale=scale, enable_gqa=True, kernel_options=kernel_options, **kwargs)

    return attend


def stock_runner(q, k, v, grad_out, scale: float, kwargs: dict) -> tuple[Callable | None, str]:
    """Stock flex_attention compiled in default and max-autotune-no-cudagraphs modes, forward and
    backward: (the step of the faster mode, note with both times); a mode that fails is noted
    (e.g. a backward out of shared memory at a large head dim), (None, why) when both do."""
    from ...errors import first_line
    from ..timing import time_us

    timed, failed = {}, []
    for mode in ("default", "max-autotune-no-cudagraphs"):
        try:
            compiled = torch.compile(_flex(scale, kwargs), dynamic=False, mode=None if mode == "default" else mode)
            step = autograd_step(compiled, q, k, v, grad_out)
            step()
            timed[mode] = (time_us(step), step)
        except Exception as e:  # one mode's failure must not lose the case
            failed.append(f"{mode} failed: {first_line(e)[:160]}")
    if not timed:
        return None, "triton omitted: " + "; ".join(failed)
    best = min(timed, key=lambda m: timed[m][0])
    return timed[best][1], ("stock fwd+bwd " + ", ".join([*(f"{m} {t:.1f} us" for m, (t, _) in timed.items()),
                                                          *failed]) + f": triton is {best}")


def flash_runner(q, k, v, grad_out, scale: float, kwargs: dict) -> tuple[Callable | None, str]:
    """flex_attention compiled with the FLASH backend, forward and backward, run once here:
    (runner, note), or (None, why) where it cannot run."""
    from ...errors import first_line

    try:
        compiled = torch.compile(_flex(scale, kwargs, {"BACKEND": "FLASH"}), dynamic=False)
        step = autograd_step(compiled, q, k, v, grad_out)
        step()
        torch.cuda.synchronize()
    except Exception as e:  # flash-attn-4 missing, or a mod, shape or backward it does not take
        return None, f"flash omitted: {first_line(e)[:200]}"
    return step, "flash is flex_attention BACKEND=FLASH, compiled (default mode), forward and backward"


def sdpa_runner(p: fp.Prefill, q, k, v, grad_out, scale: float) -> Callable | None:
    """SDPA forward and backward for the cases it expresses without a dense mask; None otherwise."""
    forward = fp.sdpa_runner(p, q, k, v, scale)
    return None if forward is None else autograd_step(lambda q, k, v: forward(), q, k, v, grad_out)


def _case(p: fp.Prefill) -> Case:
    torch._dynamo.reset()
    mods = fp.mods_of(p)
    kept = fp.kept_pairs(mods.mask_mod, p.s, p.s, device="cuda")
    flops, n_bytes = cost(p, kept)
    q, k, v, grad_out = make_inputs(p, kept)
    scale = p.dqk ** -0.5
    block_mask = fp.block_mask_of(p, mods)
    ours, ours_note = ours_runner(p, mods, q, k, v, grad_out, scale, block_mask)
    flex_kw = fp.flex_kwargs(mods, block_mask)
    stock, stock_note = stock_runner(q, k, v, grad_out, scale, flex_kw)
    flash, flash_note = flash_runner(q, k, v, grad_out, scale, flex_kw)
    fraction = kept / (p.s * p.s)
    notes = [FLOPS_NOTE + f" ({fraction:.6f}, {kept} per head, exact from the mask)", *mods.notes, ours_note,
             stock_note, flash_note, "every runner's out, dq, dk, dv checked against fp32 autograd, atol 2e-2 of "
             "each tensor's max"]
    if p.variant not in ("causal", "noncausal"):
        notes.append("aten left out: SDPA would need a dense attn_mask" if p.variant != "softcap"
                     else "aten left out: SDPA cannot softcap")
    return Case(
        name=p.name,
        params={"B": p.b, "Hq": p.hq, "Hkv": p.hkv, "S": p.s, "Dqk": p.dqk, "Dv": p.dv, "variant": p.variant,
                "kept_fraction": fraction, "window": fp.WINDOW if p.variant == "sliding" else None,
                "softcap": fp.SOFTCAP if p.variant == "softcap" else None,
                "documents": fp.document_lengths(p.s) if p.variant == "document" else None, "dtype": "bfloat16",
                "step": "forward+backward"},
        flops=flops, bytes=n_bytes, matmul=True, notes=notes, atol=2e-2, rtol=2e-2, atol_of_max=True,
        runners={"inductor_cute": ours, "triton": stock, "aten": sdpa_runner(p, q, k, v, grad_out, scale),
                 "flash": flash},
        reference=lambda: reference(q, k, v, grad_out, scale, mods),
    )


def cases(quick: bool):
    return [named(functools.partial(_case, p), p.name) for p in (QUICK if quick else CASES)]
