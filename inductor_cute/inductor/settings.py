"""enable()'s settings. They travel on the CuteChoices instance the factory makes (the factory's tag
spells them, so they enter the FX-graph cache key); code that needs them while lowering or
scheduling reads `active_settings()`."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path


def _setting(tag: str, default: bool = False):
    return dataclasses.field(default=default, metadata={"tag": tag})


@dataclasses.dataclass(frozen=True)
class Settings:
    """enable()'s switches; each has a short name for the factory's tag."""

    fuse_epilogues: bool = _setting("fuse")  # a GEMM of ours takes the pointwise ops after it (our CUDA scheduling)
    flex_decode: bool = _setting("flex")  # flex_attention decoding calls may run our split-KV kernel
    flex_prefill: bool = _setting("prefill")  # longer queries (inference) may run our prefill kernel
    flex_backward: bool = _setting("bwd")  # training graphs may run our flex forward and backward kernels
    group_gemv: bool = _setting("ggemv")  # decode mm's sharing an activation become one grouped GEMV (gemm/shared_a.py)
    pdl: bool = _setting("pdl")  # Inductor's Triton kernels launch dependents early (triton.enable_pdl)
    keep_m1_mm: bool = _setting("m1mm")  # M = 1 mm's stay mm's under coordinate descent (gemm/m1.py)
    # create_block_mask(_compile=True) traced into the graph (block_masks.py)
    trace_block_masks: bool = _setting("tbm", True)
    # silu(gate) * up of a grouped_mm product becomes one gated grouped GEMM (grouped/gate.py);
    # None (enable()'s default): only in graphs that autotune with our backend (grouped/moe_pass.py)
    fuse_moe_gate: bool | None = _setting("gate")
    # a grouped_mm of gathered rows x[idx] reads x's rows through idx in its loads (grouped/gather.py); None as above
    fuse_moe_gather: bool | None = _setting("gather")
    # the MoE router's top-k and the permute's sort of its indices in cheaper forms (grouped/routing.py)
    moe_routing: bool = _setting("route")
    # accumulating scatters whose index is a sort's permutation become gathers (grouped/scatters.py)
    moe_scatters: bool = _setting("scat")

    def tag(self) -> str:
        return "-".join(f"{f.metadata['tag']}{spelled(getattr(self, f.name))}" for f in dataclasses.fields(self))


def source_hash(*modules) -> str:
    """A graph pass's uuid part: a hash of the source of the modules that decide its rewrites (a
    changed rewrite must not find graphs cached before it)."""
    return hashlib.sha256(b"".join(Path(module.__file__).read_bytes() for module in modules)).hexdigest()


def spelled(value: bool | None) -> str:
    return "a" if value is None else str(int(value))  # "a": where autotuned (see the fields)


def active_settings() -> Settings:
    """The settings of the compile under way: those of V.choices when it is ours, the defaults otherwise."""
    from torch._inductor.virtualized import V

    settings = getattr(V.choices, "settings", None)
    return settings if isinstance(settings, Settings) else Settings()
