"""Attention prefill (issue 13): ours (host.flex_prefill, eager) vs stock flex_attention compiled
(Triton) vs SDPA vs flex_attention's FLASH backend (FlashAttention-4), bf16, beside the matmul bound.

Runners of a case (all on the same q, k, v and mods):
  inductor_cute  host.flex_prefill called eagerly with the score and mask programs that compute the
                 case's score_mod and mask_mod, and the tensors of the BlockMask below
  triton         stock flex_attention as users meet it: compiled, with the BlockMask
                 create_block_mask builds from the mask_mod (128 x 128 blocks, one for all batches
                 and heads), in whichever of default and max-autotune-no-cudagraphs mode is faster
                 (both times in notes). Non-causal cases pass no BlockMask, as a ViT calls it.
  aten           SDPA (is_causal, enable_gqa) for the plain causal and non-causal cases only; left
                 out where it would need a dense attn_mask (documents, sliding window, ALiBi) or
                 cannot express the case (softcap)
  flash          flex_attention compiled with kernel_options={"BACKEND": "FLASH"} (the CuTe kernels
                 of the flash-attn-4 package), same mods and BlockMask; left out, with the reason in
                 notes, where it does not run (package missing, mod unsupported)
  plain, split_kv_early, persistent_early, persistent_split_early, dynamic_early, dynamic_split_early
                 ours with one fixed config each (VARIANT_KNOBS): a plain config (one CTA per tile)
                 with K and V in rings of their own (split_kv), persistent CTAs (one per SM, two Q
                 buffers where they fit), each row's first 5/8 exponentials of a block before the
                 wait for the previous P V (early_exps), persistent CTAs claiming their tiles from a
                 counter (dynamic_tiles); where a config does not fit, its runner is left out
                 (--quick: QUICK_VARIANTS only)
Correctness: the harness checks every runner's output against an fp32 reference (untimed; the
same score_mod and mask_mod applied to dense scores, chunked over queries). q is scaled so softmax
puts its weight on a few dozen keys (flex_decode.peaked_query_scale), as trained attention does,
so outputs are large enough for the 2e-2 tolerance to catch a wrong kernel.
flops: 2 * B * Hq * kept (q, kv) pairs * (Dqk + Dv), the kept pairs counted exactly from the
mask_mod (it is the same for every batch and head here): only unmasked work counts, so the
roofline is the matmul time of that work (matmul=True). Bytes: q, k, v and the output once.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ...kernels.common.programs import score as score_program
from ..case import Case, named
from . import flex_decode as fd

VARIANTS = ("causal", "noncausal", "document", "sliding", "softcap", "alibi")
WINDOW = 1024  # sliding-window keys, the query's own included (Mistral-style)
SOFTCAP = 50.0  # Gemma-2's attention logit softcap: cap * tanh(score / cap)
# 8 documents of uneven lengths (not multiples of the 128 blocks) packed into 16384 tokens
DOC_LENGTHS = (3001, 517, 4243, 1210, 2777, 389, 2650, 1597)


@dataclass(frozen=True)
class Prefill:
    name: str
    b: int
    hq: int
    hkv: int
    s: int  # query and key length
    dqk: int
    dv: int
    variant: str


CASES = [
    Prefill("dsv3-mla B1 H128 S4096 causal", 1, 128, 128, 4096, 192, 128, "causal"),
    Prefill("dsv2-lite B1 H16 S8192 causal", 1, 16, 16, 8192, 192, 128, "causal"),
    Prefill("llama B4 H32/8 S4096 causal", 4, 32, 8, 4096, 128, 128, "causal"),
    Prefill("llama B2 H32/8 S16384 noncausal", 2, 32, 8, 16384, 128, 128, "noncausal"),
    Prefill("doc-causal B1 H32 S16384", 1, 32, 32, 16384, 128, 128, "document"),
    Prefill("sliding1024 B4 H32/8 S8192", 4, 32, 8, 8192, 128, 128, "sliding"),
    Prefill("softcap50 B2 H16/8 S8192 causal", 2, 16, 8, 8192, 256, 256, "softcap"),
    Prefill("alibi B4 H16 S4096 causal", 4, 16, 16, 4096, 128, 128, "alibi"),
    Prefill("vit B32 H16 S1024 noncausal", 32, 16, 16, 1024, 64, 64, "noncausal"),
]
QUICK = [CASES[0], CASES[2], CASES[8]]

CAUSAL_PROGRAM = score_program.dumps([["o", "ge", "q", "kv"]])
DOCUMENT_CAUSAL_PROGRAM = score_program.dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"],
                                               ["same", "eq", "qd", "kd"], ["c", "ge", "q", "kv"],
                                               ["o", "and", "same", "c"]])
# score + slope[h] * (kv - q): ALiBi's linear bias, the slopes a captured tensor
ALIBI_PROGRAM = score_program.dumps([["m", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "m", "d"],
                                     ["o", "add", "score", "bias"]])


@dataclass
class Mods:
    """A variant as flex_attention takes it (score_mod, mask_mod: Python functions of index
    tensors) and as our kernel takes it (programs over captured 1-D tensors)."""

    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    score_program: str | None = None
    mask_program: str | None = None
    score_tensors: tuple = ()
    mask_tensors: tuple = ()
    notes: list[str] = field(default_factory=list)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_lengths(length: int) -> list[int]:
    """DOC_LENGTHS scaled to `length` tokens (exactly DOC_LENGTHS at 16384); the last takes the rest."""
    total = sum(DOC_LENGTHS)
    ends = [length * end // total for end in itertools.accumulate(DOC_LENGTHS)]
    return [end - start for start, end in zip([0, *ends[:-1]], ends)]


def document_ids(length: int, device="cpu") -> torch.Tensor:
    """int32 (length,): the document of each token, documents packed back to back."""
    sizes = torch.tensor(document_lengths(length), device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device, dtype=torch.int32), sizes)


def alibi_slopes(heads: int, device="cpu") -> torch.Tensor:
    """fp32 (heads,): ALiBi's geometric slopes 2^(-8 (h + 1) / heads)."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


def mods_of(p: Prefill, device="cuda") -> Mods:
    """The score and mask of a case's variant; every variant but noncausal is causal."""
    v = p.variant
    if v == "noncausal":
        return Mods()
    if v == "document":
        doc = document_ids(p.s, device)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return Mods(mask_mod=document_causal, mask_program=DOCUMENT_CAUSAL_PROGRAM, mask_tensors=(doc,),
                    notes=[f"{len(DOC_LENGTHS)} documents of {document_lengths(p.s)} tokens, causal within each; "
                           "document ids a captured int32 tensor"])
    if v == "sliding":
        return Mods(mask_mod=fd.sliding_window(p.s, p.s, WINDOW),
                    mask_program=fd.sliding_window_program(p.s, p.s, WINDOW),
                    notes=[f"causal sliding window of {WINDOW} keys"])
    mods = Mods(mask_mod=causal, mask_program=CAUSAL_PROGRAM)
    if v == "softcap":
        mods.score_mod, mods.score_program = fd.softcap(SOFTCAP), fd.softcap_program(SOFTCAP)
        mods.notes.append(f"score_mod {SOFTCAP:g} * tanh(score / {SOFTCAP:g})")
    elif v == "alibi":
        slopes = alibi_slopes(p.hq, device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        mods.score_mod, mods.score_program, mods.score_tensors = alibi, ALIBI_PROGRAM, (slopes,)
        mods.notes.append("score_mod score + slope[h] * (kv - q), slopes a captured fp32 tensor")
    return mods


def kept_pairs(mask_mod: Callable | None, q_len: int, kv_len: int, device="cpu", chunk: int = 1024) -> int:
    """The (q, kv) pairs `mask_mod` keeps for one batch and head (b = h = 0), counted exactly,
    `chunk` queries at a time."""
    if mask_mod is None:
        return q_len * kv_len
    zero = torch.zeros((), dtype=torch.int64, device=device)
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    total = 0
    for start in range(0, q_len, chunk):
        q_idx = torch.arange(start, min(start + chunk, q_len), device=device)[:, None]
        total += int(mask_mod(zero, zero, q_idx, kv_idx).expand(len(q_idx), kv_len).sum())
    return total


def cost(p: Prefill, kept: int) -> tuple[int, int]:
    """(flops, bytes): both matrix products over the kept pairs of every batch and query head;
    q, k, v and the output read or written once, bf16."""
    flops = 2 * p.b * p.hq * kept * (p.dqk + p.dv)
    n_bytes = 2 * p.b * (p.hq * p.s * (p.dqk + p.dv) + p.hkv * p.s * (p.dqk + p.dv))
    return flops, n_bytes


def make_inputs(p: Prefill, kept: int, device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """q (B, Hq, S, Dqk), k (B, Hkv, S, Dqk), v (B, Hkv, S, Dv); q peaked over the mean kept keys
    of a row."""
    g = torch.Generator(device=device).manual_seed(seed)
    sigma = fd.peaked_query_scale(kept / p.s)
    q = (torch.randn(p.b, p.hq, p.s, p.dqk, generator=g, device=device) * sigma).to(dtype)
    k = torch.randn(p.b, p.hkv, p.s, p.dqk, generator=g, device=device, dtype=dtype)
    v = torch.randn(p.b, p.hkv, p.s, p.dv, generator=g, device=device, dtype=dtype)
    return q, k, v


def reference(q, k, v, scale: float, mods: Mods, max_scores: int = 1 << 27) -> torch.Tensor:
    """fp32 attention with GQA, mods.score_mod on the scaled scores and mods.mask_mod's keys,
    one (batch, KV head) and at most `max_scores` scores at a time. A row with no key gets 0."""
    b, hq, lq, _ = q.shape
    hkv, lkv, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    out = torch.empty(b, hq, lq, dv, device=q.device, dtype=torch.float32)
    rows = max(1, max_scores // (group * lkv))
    kv_idx = torch.arange(lkv, device=q.device)[None, None, :]
    for bi in range(b):
        batch = torch.tensor(bi, device=q.device)
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            h_idx = torch.arange(g * group, (g + 1) * group, device=q.device)[:, None, None]
            kf, vf = k[bi, g].float(), v[bi, g].float()
            for start in range(0, lq, rows):
                stop = min(start + rows, lq)
                q_idx = torch.arange(start, stop, device=q.device)[None, :, None]
                s = torch.matmul(q[bi, heads, start:stop].float(), kf.T) * scale
                if mods.score_mod is not None:
                    s = mods.score_mod(s, batch, h_idx, q_idx, kv_idx)
                if mods.mask_mod is not None:
                    s = s.masked_fill(~mods.mask_mod(batch, h_idx, q_idx, kv_idx), float("-inf"))
                p = torch.softmax(s, dim=-1).nan_to_num(0.0)
                out[bi, heads, start:stop] = torch.matmul(p, vf)
    return out


def block_mask_of(p: Prefill, mods: Mods, device="cuda"):
    """The BlockMask create_block_mask builds for the case (None without a mask)."""
    if mods.mask_mod is None:
        return None
    return create_block_mask(mods.mask_mod, None, None, p.s, p.s, device=device)


def ours_kwargs(mods: Mods, block_mask) -> dict:
    """flex_prefill's keyword arguments: the programs, their tensors, the BlockMask's tensors."""
    kw = dict(score_mod=mods.score_program, score_tensors=mods.score_tensors, mask_mod=mods.mask_program,
              mask_tensors=mods.mask_tensors)
    if block_mask is not None:
        kw.update(kv_num_blocks=block_mask.kv_num_blocks, kv_indices=block_mask.kv_indices,
                  full_kv_num_blocks=block_mask.full_kv_num_blocks, full_kv_indices=block_mask.full_kv_indices,
                  kv_block_size=block_mask.BLOCK_SIZE[1], q_block_size=block_mask.BLOCK_SIZE[0])
    return kw


def flex_kwargs(mods: Mods, block_mask) -> dict:
    """flex_attention's score_mod / block_mask keyword arguments."""
    kw = {} if block_mask is None else {"block_mask": block_mask}
    if mods.score_mod is not None:
        kw["score_mod"] = mods.score_mod
    return kw


def flash_runner(q, k, v, scale: float, kwargs: dict) -> tuple[Callable | None, str]:
    """flex_attention compiled with the FLASH backend, called once here: (runner, note), or
    (None, why) where it cannot run."""
    from ...errors import first_line

    def attend(q, k, v, **kw):
        return flex_attention(q, k, v, scale=scale, enable_gqa=True, kernel_options={"BACKEND": "FLASH"}, **kw)

    try:
        fn = functools.partial(torch.compile(attend, dynamic=False), q, k, v, **kwargs)
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # flash-attn-4 missing, or a mod or shape it does not take
        return None, f"flash omitted: {first_line(e)[:200]}"
    return fn, "flash is flex_attention BACKEND=FLASH, compiled (default mode)"


def sdpa_runner(p: Prefill, q, k, v, scale: float) -> Callable | None:
    """SDPA for the cases it expresses without a dense mask; None for the others."""
    if p.variant not in ("causal", "noncausal"):
        return None
    is_causal, gqa = p.variant == "causal", p.hq != p.hkv
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)


# The runners beside `inductor_cute` (the config the host picks): each a plain config (plain_config:
# one CTA per tile, the deepest ring) with these knobs, so that each name means one config whatever
# the defaults are. persistent: one CTA per SM, two Q buffers where they fit; early: early_exps
# at EARLY_EXPS of a thread's values per row; dynamic: persistent CTAs claiming their tiles
VARIANT_KNOBS = {
    "plain": {},
    "split_kv_early": dict(split_kv=True, early=True),
    "persistent_early": dict(persistent=True, early=True),
    "persistent_split_early": dict(persistent=True, split_kv=True, early=True),
    "dynamic_early": dict(persistent=True, dynamic=True, early=True),
    "dynamic_split_early": dict(persistent=True, dynamic=True, split_kv=True, early=True),
}
# --quick times the variants still open (each compiles its own kernel per case); the others were
# measured in the sixteenth session (flex_prefill-quick-h200-20261205-s16)
QUICK_VARIANTS = ("plain", "persistent_split_early", "dynamic_early", "dynamic_split_early")
EARLY_EXPS = (5, 8)  # the fraction of a thread's values per row (kv_block / 4) made early: 20 of 32


def variant_config(p: Prefill, persistent=False, split_kv=False, early=False, dynamic=False):
    """The case's plain config with the knobs VARIANT_KNOBS names, or None where it does not fit."""
    import dataclasses

    from ...host.common import sm_count
    from ...kernels.attention import flex_prefill_config as fpc

    problem = fpc.FlexPrefillProblem(p.dqk, p.dv, "bfloat16")
    config = fpc.plain_config(problem, split_kv)
    if persistent:
        config = dataclasses.replace(fpc.persistent_config(config, problem, sm_count(0)), dynamic_tiles=dynamic)
    if early:
        config = dataclasses.replace(config, early_exps=config.kv_block // 4 * EARLY_EXPS[0] // EARLY_EXPS[1])
    return config if fpc.config_error(config, problem) is None else None


def _case(p: Prefill, variants=tuple(VARIANT_KNOBS)) -> Case:
    from ...host.flex_prefill import flex_prefill

    torch._dynamo.reset()
    mods = mods_of(p)
    kept = kept_pairs(mods.mask_mod, p.s, p.s, device="cuda")
    flops, n_bytes = cost(p, kept)
    q, k, v = make_inputs(p, kept)
    scale = p.dqk ** -0.5
    block_mask = block_mask_of(p, mods)
    ours_kw = ours_kwargs(mods, block_mask)
    stock, stock_notes = fd.stock_runners(q, k, v, scale, flex_kwargs(mods, block_mask), None)
    flash, flash_note = flash_runner(q, k, v, scale, flex_kwargs(mods, block_mask))
    fraction = kept / (p.s * p.s)
    notes = [f"flops count the kept {fraction:.6f} of (q, kv) pairs ({kept} per head, exact from the mask)",
             *mods.notes, *stock_notes, flash_note]
    if p.variant not in ("causal", "noncausal"):
        notes.append("aten left out: SDPA would need a dense attn_mask" if p.variant != "softcap"
                     else "aten left out: SDPA cannot softcap")
    variant_runners = {name: functools.partial(flex_prefill, q, k, v, scale=scale, config=config, **ours_kw)
                       for name, config in ((n, variant_config(p, **VARIANT_KNOBS[n])) for n in variants)
                       if config is not None}
    return Case(
        name=p.name,
        params={"B": p.b, "Hq": p.hq, "Hkv": p.hkv, "S": p.s, "Dqk": p.dqk, "Dv": p.dv, "variant": p.variant,
                "kept_fraction": fraction, "window": WINDOW if p.variant == "sliding" else None,
                "softcap": SOFTCAP if p.variant == "softcap" else None,
                "documents": document_lengths(p.s) if p.variant == "document" else None, "dtype": "bfloat16"},
        flops=flops, bytes=n_bytes, matmul=True, notes=notes, atol=2e-2, rtol=2e-2,
        runners={"inductor_cute": lambda: flex_prefill(q, k, v, scale=scale, **ours_kw), **stock,
                 "aten": sdpa_runner(p, q, k, v, scale), "flash": flash, **variant_runners},
        reference=lambda: reference(q, k, v, scale, mods),
    )


def cases(quick: bool):
    if quick:
        return [named(functools.partial(_case, p, QUICK_VARIANTS), p.name) for p in QUICK]
    return [named(functools.partial(_case, p), p.name) for p in CASES]
