"""The prefill's opt-in levers side by side with the device default (issue 13's d64 goal):
exponentials on the FMA pipes (FlexPrefillConfig.poly_exps: does taking load off MUFU.EX2 speed
up the softmax-heavy d64 case?) and the next tile's S_0 under the last P V (overlap_tiles: does
hiding a tile's first block and epilogue pay at 8 blocks per tile?).

    python3 benchmarks/prefill_levers.py

Per case: the device's default config, then with poly_exps 4, 8, 12 and 16 of each row's 32
values per KV block, overlap_tiles, and both, persistent CTAs with and without dynamic_tiles
(where the config fits the case), device times from
bench.timing (interleaved), TFLOP/s of the unmasked work and the output's largest difference from
the default's. Not a bench suite: no record is written; the perf notes keep the numbers.
"""

from __future__ import annotations

import dataclasses

import torch

from inductor_cute.bench.timing import time_side_by_side
from inductor_cute.host.common import sm_count
from inductor_cute.host.flex_prefill import flex_prefill
from inductor_cute.kernels.attention import flex_prefill_config as fpc

from flex_backward_speed import CAUSAL, LISTS, causal_block_mask  # (benchmarks/ is the script's path)

VARIANTS = {"default": {}, **{f"poly_exps {n}": dict(poly_exps=n) for n in (4, 8, 12, 16)},
            "overlap_tiles": dict(overlap_tiles=True),
            "overlap_tiles poly_exps 8": dict(overlap_tiles=True, poly_exps=8),
            # issue 13's MLA lever: persistent CTAs that claim causal tiles longest first
            "persistent": dict(persistent_ctas=-1), "dynamic_tiles": dict(persistent_ctas=-1, dynamic_tiles=True)}
# (name, batch, query heads, KV heads, length, head dims, causal): issue 13's d64 case, then two
# whose softmax is a smaller share of the block (d128, MLA)
CASES = [
    ("vit B32 H16 S1024 d64", 32, 16, 16, 1024, (64, 64), False),
    ("llama B4 H32/8 S4096 d128 causal", 4, 32, 8, 4096, (128, 128), True),
    ("dsv3-mla B1 H128 S4096 192/128 causal", 1, 128, 128, 4096, (192, 128), True),
]


def run_case(name, b, hq, hkv, s, dims, causal):
    d, dv = dims
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16)
    kwargs = causal_block_mask(s, LISTS[:4])[1] if causal else {}
    problem = fpc.FlexPrefillProblem(d, dv, "bfloat16", mask_program=CAUSAL if causal else "",
                                     sparse_block=128 if causal else 0)
    base = fpc.default_config(problem, sm_count(0))
    ctas = sm_count(0)  # -1 above: one CTA per SM
    configs = {label: dataclasses.replace(base, **{k: ctas if v == -1 else v for k, v in changes.items()})
               for label, changes in VARIANTS.items()}
    configs = {label: c for label, c in configs.items() if fpc.config_error(c, problem) is None}
    fns = {label: (lambda c=c: flex_prefill(q, k, v, config=c, **kwargs)) for label, c in configs.items()}
    reference = fns["default"]().float()
    diffs = {label: (fn().float() - reference).abs().max().item() for label, fn in fns.items()}
    times = time_side_by_side(fns, reps=50, rounds=5)
    flops = fpc.attention_flops(b, hq, s, s, d, dv, causal)
    print(f"{name}: default {base}", flush=True)
    for label, t in times.items():
        print(f"  {label}: {t:.1f} us ({flops / t / 1e6:.0f} TFLOP/s), max |out - default| {diffs[label]:.2e}",
              flush=True)


def main():
    for case in CASES:
        run_case(*case)


if __name__ == "__main__":
    main()
