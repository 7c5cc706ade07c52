"""Llama-3-8B blocks end to end through torch.compile: the decoder MLP (SwiGLU) and a whole decoder
layer (RMSNorm, GQA attention, MLP, residual adds), bf16, prefill and decode.

Runners (each compiled when its case is built, in its own config and a fresh Inductor cache; see
gemm_compiled.compile_now):
  inductor_cute             max-autotune-no-cudagraphs, inductor-cute enabled (ATEN,TRITON,ICUTE)
  triton                    the baseline: the faster of stock_default and stock_max_autotune, picked
                            by timing both when the case is built (the note gives both times)
  aten                      eager PyTorch, the reference for correctness
  stock_default             torch.compile default mode
  stock_max_autotune        mode="max-autotune" (CUDA graphs on), ATEN,TRITON
  inductor_cute_cudagraphs  mode="max-autotune" (CUDA graphs on), inductor-cute enabled; not in --quick
The last three are timed by the harness into the JSON record's times_us; the Markdown table shows
the first three columns. They are checked against eager when the case is built.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..case import Case
from ..timing import time_us
from .gemm_compiled import compile_now, describe_gemms

# Llama-3-8B
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
EPS = 1e-5
PREFILL_TOKENS = 4096  # batch 1
DECODE_BATCH = 8  # one new token per sequence
CONTEXT = 2048  # KV-cache entries each decode token attends over (its own included)
BLOCKS = ("mlp", "layer")
PHASES = ("prefill", "decode")


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no bias."""

    def __init__(self, hidden=HIDDEN, intermediate=INTERMEDIATE, **kw):
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.up = nn.Linear(hidden, intermediate, bias=False, **kw)
        self.down = nn.Linear(intermediate, hidden, bias=False, **kw)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """x + o(attn(norm(x))), then + mlp(norm(.)); attention with grouped KV heads (no RoPE).

    Prefill: causal attention over the input tokens. Decode (after `attach_cache`): each sequence's
    one new token writes its K/V into the last slot of a static KV cache, then attends over the
    whole cache, as static-cache inference engines do."""

    def __init__(self, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS, kv_heads=KV_HEADS,
                 head_dim=HEAD_DIM, **kw):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(hidden, heads * head_dim, bias=False, **kw)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False, **kw)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=False, **kw)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False, **kw)
        self.attn_norm = nn.Parameter(torch.ones(hidden, **kw))
        self.mlp_norm = nn.Parameter(torch.ones(hidden, **kw))
        self.mlp = MLP(hidden, intermediate, **kw)
        self.register_buffer("k_cache", None)
        self.register_buffer("v_cache", None)

    def attach_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """(batch, kv_heads, context, head_dim) each; the last slot is overwritten by every call."""
        self.register_buffer("k_cache", k_cache)
        self.register_buffer("v_cache", v_cache)

    def qkv(self, h):
        b, s, _ = h.shape
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (d,), self.attn_norm, EPS))
        if self.k_cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            pos = self.k_cache.shape[2] - s
            self.k_cache[:, :, pos:] = k
            self.v_cache[:, :, pos:] = v
            a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return x + self.mlp(F.rms_norm(x, (d,), self.mlp_norm, EPS))


def mlp_cost(tokens: int, hidden=HIDDEN, intermediate=INTERMEDIATE, elt=2) -> tuple[float, float]:
    """(flops, bytes) of the MLP block: its three GEMMs; its weights plus the input and output."""
    flops = 2 * tokens * 3 * hidden * intermediate
    return flops, elt * (3 * hidden * intermediate + 2 * tokens * hidden)


def layer_cost(batch: int, seq: int, context: int = 0, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS,
               kv_heads=KV_HEADS, head_dim=HEAD_DIM, elt=2) -> tuple[float, float]:
    """(flops, bytes) of the decoder layer. Flops: the seven projections plus attention's two
    matmuls (causal prefill: half of seq x seq; decode: seq x context). Bytes: weights (with the
    norms), input and output, and for decode the KV cache read."""
    tokens = batch * seq
    proj = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp_flops, _ = mlp_cost(tokens, hidden, intermediate, elt)
    keys = context if context else seq
    attn = 4 * batch * heads * seq * keys * head_dim
    if not context:
        attn //= 2
    flops = 2 * tokens * proj + mlp_flops + attn
    weights = proj + 3 * hidden * intermediate + 2 * hidden
    cache = 2 * batch * kv_heads * context * head_dim
    return flops, elt * (weights + 2 * tokens * hidden + cache)


def case_name(block: str, phase: str) -> str:
    if phase == "prefill":
        return f"{block} prefill {PREFILL_TOKENS} tokens"
    return f"{block} decode batch {DECODE_BATCH}" + (f" context {CONTEXT}" if block == "layer" else "")


def _close(out, ref, atol, rtol) -> bool:
    return torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)


def _case(block: str, phase: str, cudagraphs: bool = True) -> Case:
    torch._dynamo.reset()
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    batch, seq = (1, PREFILL_TOKENS) if phase == "prefill" else (DECODE_BATCH, 1)
    params = {"block": block, "phase": phase, "batch": batch, "seq": seq, "tokens": batch * seq, "dtype": "bfloat16"}
    if block == "mlp":
        model = MLP(**kw)
        flops, n_bytes = mlp_cost(batch * seq)
    else:
        model = DecoderLayer(**kw)
        context = CONTEXT if phase == "decode" else 0
        if context:
            model.attach_cache(*(torch.randn(batch, KV_HEADS, context, HEAD_DIM, **kw) for _ in range(2)))
            params["context"] = context
        flops, n_bytes = layer_cost(batch, seq, context)
    model.requires_grad_(False).eval()
    x = torch.randn(batch, seq, HIDDEN, **kw)
    atol = rtol = 3e-2 if block == "mlp" else 5e-2
    with torch.no_grad():
        ref = model(x)

    def eager():
        with torch.no_grad():
            return model(x)

    runners, notes, compiled = {"aten": eager}, [], {}
    from ...errors import first_line

    for backend, mode, ours in (("inductor_cute", "max-autotune-no-cudagraphs", True),
                                ("inductor_cute_cudagraphs", "max-autotune", True),
                                ("stock_default", None, False),
                                ("stock_max_autotune", "max-autotune", False)):
        if backend == "inductor_cute_cudagraphs" and not cudagraphs:
            continue
        try:
            c = compile_now(model, (x,), mode=mode, ours=ours)
        except Exception as e:
            notes.append(f"{backend} compile failed: {first_line(e)[:160]}")
            continue
        if backend != "inductor_cute" and not _close(c.out, ref, atol, rtol):  # the harness checks ours
            err = (c.out.float() - ref.float()).abs().max().item()
            notes.append(f"MISMATCH: {backend} output differs from aten (max abs err {err:.3g})")
            continue
        compiled[backend] = c
        runners[backend] = c.run
    if "inductor_cute" in compiled:
        ours = compiled["inductor_cute"]
        notes.append(f"ours: {describe_gemms(ours.gemms) or 'no GEMM autotuned'}; "
                     f"{ours.our_calls} GEMM call(s) of ours in output code")
    if "inductor_cute_cudagraphs" in compiled:
        notes.append(f"ours with CUDA graphs: {compiled['inductor_cute_cudagraphs'].our_calls} GEMM call(s) of ours")
    notes.append("compile " + ", ".join(f"{k} {c.seconds:.0f} s" for k, c in compiled.items()))
    stock = {k: time_us(runners[k]) for k in ("stock_default", "stock_max_autotune") if k in runners}
    if stock:
        best = min(stock, key=stock.get)
        runners["triton"] = runners[best]
        notes.append("baseline " + best + " (" + ", ".join(f"{k} {t:.1f} us" for k, t in stock.items()) + ")")
    return Case(name=case_name(block, phase), params=params, flops=flops, bytes=n_bytes, matmul=True,
                runners=runners, notes=notes, atol=atol, rtol=rtol)


def cases(quick: bool):
    """quick: the MLP block only, without the CUDA-graphs runner of ours (each runner autotunes
    every GEMM from scratch, so a runner costs minutes)."""
    blocks = ("mlp",) if quick else BLOCKS
    return [functools.partial(_case, block, phase, not quick) for block in blocks for phase in PHASES]
