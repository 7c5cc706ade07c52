"""First speeds of the flex attention backward (issue 15) against its floor and SDPA's backward.

    python3 benchmarks/flex_backward_speed.py [--quick]

Per case: our kernels (host.flex_backward, eager; the default schedule, the overlapped ones and
the five-product dq_reduce where they compile), stock flex_attention's compiled (Triton) backward
and SDPA's backward where it expresses the case (is_causal, enable_gqa; each forward runs untimed
once and the backward is replayed with retain_graph) and the floor, the backward's 5 matmuls at the
H200's 790 TFLOP/s (flex_backward_config.backward_flops). Device times from bench.timing,
interleaved. Causal cases pass the BlockMask torch builds (both list sets) with the causal mask
program. Not a bench suite yet: no record is written.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch._functorch.config
import torch.nn.functional as F

from inductor_cute.bench.timing import time_side_by_side
from inductor_cute.host.flex_backward import flex_attention_backward
from inductor_cute.host.flex_prefill import flex_prefill
from inductor_cute.kernels.attention.flex_backward_config import (FlexBackwardProblem, backward_flops, config_error,
                                                                  default_config)
from inductor_cute.kernels.common.programs import score as sp

CEILING_TFLOPS = 790.0
CAUSAL = sp.dumps([["o", "ge", "q", "kv"]])
# a score_mod as our program and as torch's function (for stock flex_attention)
SOFTCAP = (sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]]),
           lambda score, b, h, m, n: 30 * torch.tanh(score / 30))
# (name, batch, query heads, KV heads, length, head dims (qk, v), causal, score_mod pair or None)
CASES = [
    ("B1 H16 S8192 d128", 1, 16, 16, 8192, (128, 128), False, None),
    ("B2 H32/8 S16384 d128 (issue 15's 450 TFLOP/s case)", 2, 32, 8, 16384, (128, 128), False, None),
    ("llama B1 H32/8 S4096 d128 causal", 1, 32, 8, 4096, (128, 128), True, None),
    ("llama B8 H32/8 S2048 d128 causal", 8, 32, 8, 2048, (128, 128), True, None),
    ("B1 H32 S4096 d64 causal", 1, 32, 32, 4096, (64, 64), True, None),
    ("dsv2-lite B1 H16 S8192 192/128 causal", 1, 16, 16, 8192, (192, 128), True, None),
    ("llama B1 H32/8 S4096 d128 causal softcap30 (no SDPA)", 1, 32, 8, 4096, (128, 128), True, SOFTCAP),
]
LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
         "full_q_num_blocks", "full_q_indices")


def causal_block_mask(s: int, lists=LISTS):
    """torch's causal BlockMask of s queries and keys and what our kernels take for it: (block
    mask, kwargs of the causal mask program and the `lists` tensors; LISTS[:4] for a forward)."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(lambda bb, h, m, n: m >= n, None, None, s, s, device="cuda")
    return bm, dict(mask_mod=CAUSAL, **{n: getattr(bm, n) for n in lists})


def run_case(name, b, hq, hkv, s, dims, causal, score_mod):
    from torch.nn.attention.flex_attention import flex_attention

    d, dv = dims
    q, k = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv))
    v = torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn(b, hq, s, dv, device="cuda", dtype=torch.bfloat16)
    score_program, score_fn = score_mod or ("", None)
    kwargs, bm = ({"score_mod": score_program} if score_program else {}), None
    if causal:
        bm, causal_kwargs = causal_block_mask(s)
        kwargs.update(causal_kwargs)
    fwd = {key: val for key, val in kwargs.items() if not key.startswith(("q_", "full_q_"))}
    out, lse = flex_prefill(q, k, v, return_lse=True, **fwd)
    problem = FlexBackwardProblem(d, dv, "bfloat16", CAUSAL if causal else "", (), 128 if causal else 0,
                                  score_program=score_program)
    plain, reduce = default_config(problem), default_config(problem, dq_reduce=True)
    variants = {"ours": plain,
                "ours dq_overlap": dataclasses.replace(plain, dq_overlap=True),
                "ours overlap": dataclasses.replace(plain, overlap=True, dq_overlap=True),
                "ours exp_under_dp": dataclasses.replace(plain, exp_under_dp=True),
                "ours dq_reduce": reduce,  # two dS buffers where they fit
                "ours dq_reduce one dS buffer": dataclasses.replace(reduce, ds_buffers=1),
                "ours dq_reduce exp_under_dp": dataclasses.replace(reduce, exp_under_dp=True)}
    configs = {label: c for label, c in variants.items() if config_error(c, problem) is None}
    fns = {label: (lambda c=c: flex_attention_backward(q, k, v, out, lse, grad_out, config=c, **kwargs))
           for label, c in configs.items()}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # stock flex_attention compiled (Triton), its backward replayed as SDPA's
    triton_out = torch.compile(flex_attention)(*leaves, score_mod=score_fn, block_mask=bm, enable_gqa=hq != hkv)
    fns["triton"] = lambda: torch.autograd.grad(triton_out, leaves, grad_out, retain_graph=True)
    if not score_program and d == dv:
        sdpa_out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=hq != hkv)
        fns["sdpa"] = lambda: torch.autograd.grad(sdpa_out, leaves, grad_out, retain_graph=True)
    times = time_side_by_side(fns, reps=30, rounds=3)
    flops = backward_flops(b, hq, s, s, d, dv, causal)
    floor = flops / (CEILING_TFLOPS * 1e6)
    row = ", ".join(f"{label} {t:.0f} us ({flops / t / 1e6:.0f} TFLOP/s)" for label, t in times.items())
    print(f"{name}: floor {floor:.0f} us; {row}", flush=True)


def main():
    # the Triton backward is replayed with retain_graph, which a backward compiled with donated
    # buffers refuses (they are freed by its first run)
    torch._functorch.config.donated_buffer = False
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two cases only")
    args = parser.parse_args()
    for case in CASES[:2] if args.quick else CASES:
        run_case(*case)


if __name__ == "__main__":
    main()
