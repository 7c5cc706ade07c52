"""The prefill kernel's custom op for compiled graphs, `torch.ops.inductor_cute.flex_prefill`: what
lowering.py puts in the graph for an inference call whose query is longer than the decode kernel
takes, once enable(flex_prefill=True) offers our prefill kernel.

Its arguments and outputs are the decode op's (lowering.SCHEMA), so one output-code call serves
both: output code calls a runtime.FlexPrefillLauncher defined per call site; through the
dispatcher (tests' CPU stand-ins) the op runs `runtime.flex_prefill`.
"""

from __future__ import annotations

import torch

from . import runtime as _runtime

SCHEMA = ("flex_prefill(Tensor q, Tensor k, Tensor v, float scale, str score_mod, Tensor[] score_tensors, "
          "str mask_mod, Tensor[] mask_tensors, Tensor? kv_num_blocks, Tensor? kv_indices, "
          "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, SymInt kv_block_size, SymInt q_block_size) "
          "-> (Tensor, Tensor)")
_LIBRARY = torch.library.Library("inductor_cute", "FRAGMENT")  # owns the registrations while imported
_LIBRARY.define(SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def register_kernel(device_type: str, fn) -> None:
    """Run `fn` (runtime.flex_prefill's signature) for the op's calls on `device_type` ("cpu" for tests)."""
    _LIBRARY.impl("flex_prefill", fn, torch._C._dispatch_key_for_device(device_type))


register_kernel("cuda", _runtime.flex_prefill)


@torch.library.register_fake("inductor_cute::flex_prefill", lib=_LIBRARY)
def _flex_prefill_fake(q, k, v, scale, *programs_and_block_mask):
    """out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) fp32 in natural-log units."""
    batch, heads, q_len, _ = q.shape
    return q.new_empty(batch, heads, q_len, v.shape[-1]), q.new_empty(batch, heads, q_len, dtype=torch.float32)
