"""The MoE post-grad graph pass (Inductor's `post_grad_custom_pre_pass`): with
enable(moe_routing=True) (the default) the router's top-k and the permute's sort made cheap
(routing.py), with enable(fuse_moe_gate=...) the gate fusion (gate.py) and its backward's
(gate_grad.py), with
enable(fuse_moe_gather=...) the row-gather fusion (gather.py), in that order, so a fused gate
whose rows are gathered becomes one gathered, gated call. A fusion set True is made in every
graph; set None (enable()'s default) only where the graph autotunes with our backend
(max-autotune) on a GPU our kernels run on, where the fused op's choices include torch's unfused
computation (in eager's form: the GEMM, then the gate's or the gather's own kernels, not what
stock Inductor would fuse them into), so a fusion is dropped where it measures slower than that;
elsewhere our kernel would run its untuned heuristic config unopposed, or (another GPU) the op
would run eager's unfused computation where stock Inductor fuses its pointwise part."""

from __future__ import annotations

import functools
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ...kernels.gemm import grouped_config
from ..settings import source_hash, spelled
from . import gate, gate_grad, gather, lowering, nodes, routing


class MoePass(CustomGraphPass):
    """One object per set of settings (`moe_pass`); its uuid (the modules that decide a rewrite
    and which rewrites it makes) enters the FX graph cache key."""

    def __init__(self, fuse_gate: bool | None, fuse_gather: bool | None, routing: bool = False) -> None:
        self.fuse_gate, self.fuse_gather, self.routing = fuse_gate, fuse_gather, routing

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.routing:
            routing.rewrite_routing(graph)
        if _wanted(self.fuse_gate, graph):
            gate.fuse_grouped_gates(graph)
            gate_grad.fuse_gate_grads(graph)
        if _wanted(self.fuse_gather, graph):
            gather.fuse_row_gathers(graph)

    def uuid(self) -> str:
        # (where a fusion depends on max-autotune and the GPU, Inductor's own key holds both)
        return (f"{_SOURCE_HASH}-gate{spelled(self.fuse_gate)}-gather{spelled(self.fuse_gather)}"
                f"-route{spelled(self.routing)}")


def _wanted(fusion: bool | None, graph: torch.fx.Graph) -> bool:
    """Whether a fusion set so is made in `graph` (module docstring)."""
    if fusion is None:
        from ..gemm.choices import backend_requested

        return backend_requested() and kernels_run_on(graph)
    return fusion


def kernels_run_on(graph: torch.fx.Graph) -> bool:
    """Whether the graph's CUDA inputs are all on GPUs our kernels run on (Hopper)."""
    devices = {v.device for n in graph.nodes if n.op == "placeholder"
               for v in [n.meta.get("val")] if isinstance(v, torch.Tensor) and v.device.type == "cuda"}
    return bool(devices) and all(lowering.device_reason(device) is None for device in devices)


# what decides a rewrite: this pass (their order), the routing rewrites, the fusions, their node helpers, the
# grouped lowering's decline reasons, the kernel's limits
_SOURCE_HASH = source_hash(sys.modules[__name__], routing, gate, gate_grad, gather, nodes, lowering, grouped_config)


@functools.cache  # enabling twice leaves the config value as it was
def moe_pass(fuse_gate: bool | None, fuse_gather: bool | None, routing: bool = False) -> MoePass:
    return MoePass(fuse_gate, fuse_gather, routing)
