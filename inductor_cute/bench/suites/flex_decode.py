"""Attention decoding (issue 5): ours (ops.flex_decode, split-KV) vs torch.compile'd flex_attention
(Triton) vs SDPA, one query token per sequence, bf16, beside the HBM bound.

Each shape runs plain, with a sliding-window mask_mod and with a softcap score_mod:
  inductor_cute  ops.flex_decode; softcap as a score program, the sliding window as a mask program
                 over the same BlockMask's blocks (only the window's blocks are read)
  triton         stock flex_attention as models call it: compiled, enable_gqa=True, with the
                 BlockMask create_block_mask builds for a decoding query over its cache (causal
                 with the query at position KV - 1; the sliding window's for that variant), in
                 whichever of default and max-autotune-no-cudagraphs mode is faster (both in notes)
  triton_bare    stock flex_attention compiled and called with no BlockMask (the suite's baseline
                 before 2026-12-03). It is slower because without a mask flex_attention makes one
                 partial block of 2^30 keys, and the decoding template (flex_decode.py.jinja, torch
                 2.11-2.13) gives each of its KV splits cdiv(kv_num_blocks * block size, SPLIT_KV)
                 keys: the first split's share covers the whole cache and the others get none, so
                 B * Hkv CTAs stream it (8 at B1 Hkv8). A model's mask has 128-key blocks (full
                 blocks split by length), which the splits share out.
The decoding query sits at position KV - 1. The bound is HBM only (matmul=False): the bytes of K
and V a kernel must read (only the window's keys when masked; K alone when V is a view of K, as
absorbed MLA's latent cache is), plus q and the output.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ... import ops
from ...kernels.common.programs import score as score_program
from ..case import Case

WINDOW = 1024  # sliding-window keys (Gemma-3-like local layers)
SOFTCAP = 30.0  # score_mod: cap * tanh(score / cap), score already scaled
VARIANTS = ("plain", "sliding", "softcap")
DOC_TBPS = 4.3  # the H200 bandwidth DESIGN.md's bounds are quoted at; the run measures its own
TARGET_KEYS = 32  # inputs are drawn so that softmax puts its weight on about this many keys


@dataclass(frozen=True)
class Shape:
    b: int
    hq: int
    hkv: int
    dqk: int
    dv: int
    kv: int
    v_view: bool = False  # v = k[..., :dv], one latent cache (absorbed MLA)
    lq: int = 1

    @property
    def label(self) -> str:
        dims = f"d{self.dqk}" if self.dqk == self.dv else f"{self.dqk}/{self.dv}"
        return f"B{self.b} Hq{self.hq} Hkv{self.hkv} {dims} KV{self.kv}" + (" v=k view" if self.v_view else "")


SHAPES = [
    Shape(8, 64, 8, 128, 128, 8192),
    Shape(4, 48, 8, 128, 128, 32768),
    Shape(64, 64, 8, 128, 128, 4096),
    Shape(1, 64, 8, 128, 128, 131072),
    Shape(8, 128, 1, 192, 128, 8192),  # MLA-style, not absorbed (DESIGN.md's 26530 us Triton case)
    Shape(8, 128, 1, 576, 512, 8192, v_view=True),  # absorbed MLA: 512 latent + 64 rope dims
]
QUICK = SHAPES[:3]


def case_name(shape: Shape, variant: str) -> str:
    suffix = {"plain": "", "sliding": f" sliding{WINDOW}", "softcap": f" softcap{SOFTCAP:g}"}[variant]
    return shape.label + suffix


def keys_read(shape: Shape, variant: str) -> int:
    """Keys per sequence a mask-aware kernel must read."""
    return min(shape.kv, WINDOW + shape.lq - 1) if variant == "sliding" else shape.kv


def cost(shape: Shape, variant: str = "plain") -> tuple[int, int]:
    """(flops, bytes): QK^T and PV over the keys read; K and V bytes of those keys (V not again when
    it is a view of K), plus q and the output. bf16."""
    s = shape
    keys = keys_read(s, variant)
    flops = 2 * s.b * s.hq * s.lq * keys * (s.dqk + s.dv)
    kv_dims = s.dqk + (0 if s.v_view else s.dv)
    n_bytes = 2 * (s.b * s.hkv * keys * kv_dims + s.b * s.hq * s.lq * (s.dqk + s.dv))
    return flops, n_bytes


def hbm_bound_us(shape: Shape, variant: str = "plain", tbps: float = DOC_TBPS) -> float:
    return cost(shape, variant)[1] / (tbps * 1e6)


def peaked_query_scale(keys: float) -> float:
    """The scale of a unit-variance q (against unit-variance k, softmax scale 1/sqrt(D)) that puts
    softmax's weight on about TARGET_KEYS of `keys` keys: scores with variance ln(keys /
    TARGET_KEYS). Unit-variance q would spread it almost evenly: outputs ~1/sqrt(keys), under the
    2e-2 tolerance whatever a kernel computes. Trained attention is peaked; outputs are O(0.2)."""
    return math.sqrt(math.log(max(keys / TARGET_KEYS, 2.0)))


def make_inputs(shape: Shape, variant: str = "plain", device="cuda", dtype=torch.bfloat16, seed: int = 0):
    """q (B, Hq, Lq, Dqk), k (B, Hkv, KV, Dqk), v (B, Hkv, KV, Dv); q scaled by peaked_query_scale."""
    s = shape
    g = torch.Generator(device=device).manual_seed(seed)
    sigma = peaked_query_scale(keys_read(s, variant))
    q = (torch.randn(s.b, s.hq, s.lq, s.dqk, generator=g, device=device) * sigma).to(dtype)
    k = torch.randn(s.b, s.hkv, s.kv, s.dqk, generator=g, device=device, dtype=dtype)
    if s.v_view:
        v = k[..., :s.dv]
    else:
        v = torch.randn(s.b, s.hkv, s.kv, s.dv, generator=g, device=device, dtype=dtype)
    return q, k, v


def sliding_window(kv_len: int, q_len: int = 1, window: int = WINDOW):
    """mask_mod: query i sits at position kv_len - q_len + i and sees itself and the window - 1 keys before."""
    offset = kv_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        return (kv_idx <= q_pos) & (q_pos - kv_idx < window)

    return mask_mod


def softcap(cap: float = SOFTCAP):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def softcap_program(cap: float = SOFTCAP) -> str:
    """softcap()'s score_mod as ops.flex_decode's score program."""
    return score_program.dumps([["a", "truediv", "score", cap], ["t", "tanh", "a"], ["o", "mul", "t", cap]])


def sliding_window_program(kv_len: int, q_len: int = 1, window: int = WINDOW) -> str:
    """sliding_window()'s mask_mod as ops.flex_decode's mask program."""
    offset = kv_len - q_len
    return score_program.dumps([["pos", "add", "q", offset], ["c", "le", "kv", "pos"], ["d", "sub", "pos", "kv"],
                                ["w", "lt", "d", window], ["o", "and", "c", "w"]])


def dense_window_mask(kv_len: int, q_len: int = 1, window: int = WINDOW, device="cuda") -> torch.Tensor:
    """The sliding window as SDPA's boolean attn_mask (True = attend), (1, 1, Lq, KV)."""
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    return ((kv_idx <= q_pos) & (q_pos - kv_idx < window))[None, None]


def causal_cache(kv_len: int, q_len: int = 1):
    """mask_mod of a decoding query over its cache: query i at position kv_len - q_len + i sees
    every key up to itself (what a model's causal mask over a static cache is)."""
    offset = kv_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def flex_mods(shape: Shape, variant: str, device="cuda", model_mask: bool = False) -> dict:
    """flex_attention's score_mod / block_mask keyword arguments for a variant; `model_mask` adds
    the causal cache BlockMask a model passes where the variant has none (one query token only:
    there it masks nothing, so every runner still computes the plain variant)."""
    if variant == "sliding":
        mask = create_block_mask(sliding_window(shape.kv, shape.lq), None, None, shape.lq, shape.kv, device=device)
        return {"block_mask": mask}
    mods = {"score_mod": softcap()} if variant == "softcap" else {}
    if model_mask and shape.lq == 1:
        mods["block_mask"] = create_block_mask(causal_cache(shape.kv, shape.lq), None, None, shape.lq, shape.kv,
                                               device=device)
    return mods


def stock_runners(q, k, v, scale: float, mods: dict, bare_mods: dict | None) -> tuple[dict, list[str]]:
    """Stock flex_attention compiled in default and max-autotune-no-cudagraphs modes: ({"triton":
    the faster, "triton_bare": the no-BlockMask call if asked}, notes)."""
    from ..timing import time_us

    def attend(q, k, v, **kw):
        return flex_attention(q, k, v, scale=scale, enable_gqa=True, **kw)

    timed, runners, notes = {}, {}, []
    for mode in ("default", "max-autotune-no-cudagraphs"):
        compiled = torch.compile(attend, dynamic=False, mode=None if mode == "default" else mode)
        fn = functools.partial(compiled, q, k, v, **mods)
        fn()
        timed[mode] = (time_us(fn), fn)
    best = min(timed, key=lambda m: timed[m][0])
    runners["triton"] = timed[best][1]
    notes.append("stock " + ", ".join(f"{m} {t:.1f} us" for m, (t, _) in timed.items()) + f": triton is {best}")
    if bare_mods is not None:
        runners["triton_bare"] = functools.partial(torch.compile(attend, dynamic=False), q, k, v, **bare_mods)
    return runners, notes


def softcap_reference(q, k, v, scale: float, cap: float = SOFTCAP) -> torch.Tensor:
    """Eager softcapped attention with GQA (each KV head's query heads batched into one matmul), in
    fp32: bf16 scores (cuBLAS rounds its output) put this reference 0.01-0.015 off fp32 on the
    suite's inputs, too near the 2e-2 tolerance for a reference."""
    b, hq, lq, dqk = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    qg = q.reshape(b, hkv, (hq // hkv) * lq, dqk).float()
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale
    p = torch.softmax(torch.tanh(s / cap) * cap, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype).reshape(b, hq, lq, dv)


def aten_runner(shape: Shape, variant: str, q, k, v, scale: float):
    """The reference: SDPA (with a dense mask for the window), or the math softcap reference."""
    if variant == "softcap":
        return lambda: softcap_reference(q, k, v, scale)
    mask = dense_window_mask(shape.kv, shape.lq, device=q.device) if variant == "sliding" else None
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _splits_note(shape: Shape) -> str:
    from ...kernels.attention import flex_decode_config as fdc

    s = shape
    kv_block = fdc.HEAD_DIMS[(s.dqk, s.dv)][0]
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    n = fdc.num_splits(s.b, s.hkv, fdc.m_tiles(s.hq // s.hkv, s.lq), s.kv, kv_block, sms)
    return f"ours {n} KV splits"


def _case(shape: Shape, variant: str) -> Case:
    torch._dynamo.reset()
    q, k, v = make_inputs(shape, variant)
    scale = shape.dqk ** -0.5
    flops, n_bytes = cost(shape, variant)
    mods = flex_mods(shape, variant, model_mask=True)
    ours_args = {}
    if variant == "sliding":
        bm = mods["block_mask"]
        ours_args = dict(mask_mod=sliding_window_program(shape.kv, shape.lq), kv_num_blocks=bm.kv_num_blocks,
                         kv_indices=bm.kv_indices, full_kv_num_blocks=bm.full_kv_num_blocks,
                         full_kv_indices=bm.full_kv_indices, kv_block_size=bm.BLOCK_SIZE[1],
                         q_block_size=bm.BLOCK_SIZE[0])
    elif variant == "softcap":
        ours_args = dict(score_mod=softcap_program())
    ours = lambda: ops.flex_decode(q, k, v, scale=scale, **ours_args)  # noqa: E731
    notes = [_splits_note(shape)]
    if variant == "sliding":
        notes.append(f"bound counts the {WINDOW}-key window only; aten is SDPA with a dense bool mask")
    elif variant == "softcap":
        notes.append("aten is an eager fp32 math reference (matmul, tanh, softmax, matmul): SDPA cannot softcap")
    if shape.v_view:
        notes.append("v is a view of k (one latent cache), counted once in bytes")
    stock, stock_notes = stock_runners(q, k, v, scale, mods, flex_mods(shape, variant) if variant != "sliding" else None)
    notes += stock_notes
    return Case(
        name=case_name(shape, variant),
        params={"B": shape.b, "Hq": shape.hq, "Hkv": shape.hkv, "Dqk": shape.dqk, "Dv": shape.dv, "KV": shape.kv,
                "Lq": shape.lq, "v_view": shape.v_view, "variant": variant,
                "window": WINDOW if variant == "sliding" else None,
                "softcap": SOFTCAP if variant == "softcap" else None, "dtype": "bfloat16"},
        flops=flops, bytes=n_bytes, matmul=False, notes=notes, atol=2e-2, rtol=2e-2,
        runners={"inductor_cute": ours, **stock, "aten": aten_runner(shape, variant, q, k, v, scale)},
    )


def cases(quick: bool):
    if quick:
        return [functools.partial(_case, s, "plain") for s in QUICK]
    return [functools.partial(_case, s, variant) for s in SHAPES for variant in VARIANTS]
