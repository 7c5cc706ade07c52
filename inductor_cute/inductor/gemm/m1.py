"""Batch-1 decode GEMMs as GEMMs (opt-in: enable(keep_m1_mm=True)).

Under `coordinate_descent_tuning`, which the max-autotune modes turn on, Inductor decomposes every
mm whose M (or N) is statically 1 into `(a.unsqueeze(2) * b.unsqueeze(0)).sum(1)` before lowering
(torch/_inductor/decomposition.py, `mm`). The product then becomes a Triton reduction: autotuning
never sees an mm, so cuBLAS and our GEMV are never timed against it, and the grouping pass
(shared_a.py) finds nothing to group. With this switch, a bf16/fp16 CUDA mm with M = 1 stays an mm
and is autotuned like any other decode GEMM. Whether the reduction or the GEMV is faster at M = 1
is what turning it on in the `models` suite measures.
"""

from __future__ import annotations

import functools


def keep_m1_mm(stock_mm_decomposition):
    """Inductor's mm decomposition, except that an M = 1 bf16/fp16 CUDA product is left as it is."""
    import torch
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    @functools.wraps(stock_mm_decomposition)
    def mm(self, input2, *args, **kwargs):
        if (not args and not kwargs.get("out_dtype") and self.device.type == "cuda" and self.dim() == 2
                and input2.dim() == 2 and self.dtype in (torch.bfloat16, torch.float16) and input2.dtype == self.dtype
                and statically_known_true(self.shape[0] == 1) and not statically_known_true(input2.shape[1] == 1)):
            return NotImplemented  # no decomposition: the mm is lowered, and autotuned, as an mm
        return stock_mm_decomposition(self, input2, *args, **kwargs)

    return mm
