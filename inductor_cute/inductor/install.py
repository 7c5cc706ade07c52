"""Everything inductor-cute changes in torch, put in and taken out in one place.

`enable()` saves what it is about to replace, sets the Inductor config values its settings need
(`inductor_choices_class`: our factory; our token in `max_autotune_gemm_backends`;
`benchmark_epilogue_fusion` off when fusing; our graph passes (GRAPH_PASSES) in their
`post_grad_custom_*_pass` slots, None in a level without one nested in one with it; `triton.enable_pdl`)
and brings each hook in HOOKS to the state its settings ask for. `disable()` puts back the last saved state exactly, so
calls nest and `with enable(): ...` undoes itself even when the block raises.

A hook replaces one thing in torch: `install()` is idempotent and `uninstall()` puts back exactly
what `install()` replaced (a no-op when not installed). A family that wraps a stock lowering adds one
`LoweringWrapper` to HOOKS; its lowering delegates the calls it declines to `stock_lowering(op)`. One
that adds choices to a stock lowering's autotuning (grouped/) also wraps, with an
`AttributeWrapper`, the `autotune_select_algorithm` that lowering's module calls.

The settings travel on the CuteChoices instance the factory makes (the factory's tag spells them, so
they enter the FX-graph cache key); code that needs them while lowering or scheduling reads
`active_settings()`. What Inductor fixes before any lowering runs (a device's scheduling) is decided
here, at install, from the same settings.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from .gemm.extern import GEMM_KERNEL
from .grouped.extern import GATE_GRAD_KERNEL, GATED_KERNEL, GROUPED_KERNEL, ROWS_KERNEL, UNFUSED_KERNEL
from .hooks import (AttributeWrapper, DecompositionWrapper, FeedbackSaver, Hook, LoweringWrapper, ModuleHook,
                    SchedulingWrapper, _attr)
from .hooks import stock_lowering  # noqa: F401  (public here too)
from .settings import Settings, active_settings  # noqa: F401  (public here too)
from .thread_choices import track_thread_choices

log = logging.getLogger(__name__)


def choices_factory(fuse_epilogues: bool = False, flex_decode: bool = False, flex_prefill: bool = False,
                    flex_backward: bool = False) -> functools.partial:
    """The value for `config.inductor_choices_class`: a picklable factory of CuteChoices whose tag
    (our version, kernel sources and settings) enters Inductor's FX-graph cache key."""
    return _factory(Settings(fuse_epilogues, flex_decode, flex_prefill, flex_backward))


@functools.cache  # one object per settings: enabling twice leaves the config value as it was
def _factory(settings: Settings) -> functools.partial:
    import hashlib
    from pathlib import Path

    from ..version import __version__
    from ..runtime.spec import source_hash
    from .gemm.choices import CuteChoices

    h = hashlib.sha256(source_hash(f"{__package__}.gemm.runtime").encode())  # kernels + runtime calling convention
    for path in sorted(Path(__file__).parent.rglob("*.py")):  # lowering, fusion and code generation
        h.update(path.read_bytes())
    return functools.partial(CuteChoices, tag=f"inductor-cute-{__version__}-{h.hexdigest()[:16]}-{settings.tag()}",
                             settings=settings)


# ------------------------------------------------------------------------------------- hooks

def _flex_attention_hop():
    import torch

    return torch.ops.higher_order.flex_attention


def _flex_attention_backward_hop():
    import torch

    return torch.ops.higher_order.flex_attention_backward


def _grouped_mm_op():
    import torch

    return torch.ops.aten._grouped_mm.default


def _gated_op():
    from .grouped.gate import OP  # defines the op and gives it Inductor's fallback lowering

    return OP


def _gate_grad_op():
    from .grouped.gate_grad import OP  # defines the op and gives it Inductor's fallback lowering

    return OP


def _rows_op():
    from .grouped.gather import OP  # defines the op and gives it Inductor's fallback lowering

    return OP


def _mm_op():
    import torch

    return torch.ops.aten.mm.default


HOOKS: tuple[Hook, ...] = (
    GEMM_KERNEL,
    FeedbackSaver("gemm_feedback_log", _attr(".gemm.extern", "log_timings")),
    SchedulingWrapper("cuda_scheduling", "cuda", _attr(".gemm.template", "CudaSchedulingConstructor"),
                      when=lambda settings: settings.fuse_epilogues),
    # (with traced BlockMasks alone too: a call it declines gets its captured tensors realized first)
    LoweringWrapper("flex_attention_lowering", _flex_attention_hop, _attr(".flex.lowering", "_flex_attention"),
                    when=lambda s: s.flex_decode or s.flex_prefill or s.trace_block_masks),
    # training graphs: the backward HOP of a call our forward took (flex/backward.py; the same decision)
    LoweringWrapper("flex_attention_backward_lowering", _flex_attention_backward_hop,
                    _attr(".flex.backward", "_flex_attention_backward"),
                    when=lambda s: s.flex_backward or s.trace_block_masks),
    # torch._grouped_mm: our configs join the stock lowering's autotuning (grouped/lowering.py)
    GROUPED_KERNEL,
    AttributeWrapper("grouped_mm_autotuning", "torch._inductor.kernel.mm_grouped", "autotune_select_algorithm",
                     _attr(".grouped.lowering", "joining_select")),
    LoweringWrapper("grouped_mm_lowering", _grouped_mm_op, _attr(".grouped.lowering", "grouped_mm_lowering")),
    # the fused MoE gate's op: its configs autotuned (grouped/gate_lowering.py)
    GATED_KERNEL,
    LoweringWrapper("grouped_mm_gated_lowering", _gated_op, _attr(".grouped.gate_lowering", "gated_lowering"),
                    when=lambda settings: settings.fuse_moe_gate is not False),
    # and its backward's (grouped/gate_grad.py): the down projection's input gradient with it
    GATE_GRAD_KERNEL,
    LoweringWrapper("grouped_mm_gate_grad_lowering", _gate_grad_op,
                    _attr(".grouped.gate_lowering", "gate_grad_lowering"),
                    when=lambda settings: settings.fuse_moe_gate is not False),
    # the gathered rows' op (grouped/gather.py), autotuned the same way; both fused ops' choices
    # include torch's unfused computation
    ROWS_KERNEL,
    UNFUSED_KERNEL,
    LoweringWrapper("grouped_mm_rows_lowering", _rows_op, _attr(".grouped.gate_lowering", "rows_lowering"),
                    when=lambda settings: settings.fuse_moe_gather is not False),
    # autotuning times every choice as a CUDA-graph step runs it (choice_timing.py), and so do the
    # scheduler's fusion decisions, which weigh those timings against fused kernels' timings
    AttributeWrapper("choice_timing", "torch._inductor.select_algorithm:AlgorithmSelectorCache", "benchmark_choice",
                     _attr(".choice_timing", "timed_in_graphs")),
    AttributeWrapper("fusion_timing_fused_nodes", "torch._inductor.scheduler:Scheduler", "benchmark_fused_nodes",
                     _attr(".choice_timing", "timed_in_graphs")),
    AttributeWrapper("fusion_timing_codegened_module", "torch._inductor.scheduler:Scheduler",
                     "benchmark_codegened_module", _attr(".choice_timing", "timed_in_graphs")),
    # a Triton kernel's run-time config choice (several configs, coordinate descent): at the first
    # call of a compiled graph, in the user's process; an 8 x 4096 RMSNorm's pick took 19 us a call
    # where another config takes 2.5 when stock-timed at that size
    # batch-1 decode GEMMs stay mm's instead of Inductor's mul+sum (gemm/m1.py; opt-in)
    DecompositionWrapper("m1_mm_kept", _mm_op, _attr(".gemm.m1", "keep_m1_mm"), when=lambda settings: settings.keep_m1_mm),
    AttributeWrapper("runtime_tuning_timing", "torch._inductor.runtime.triton_heuristics:CachingAutotuner",
                     "bench", _attr(".choice_timing", "run_time_tuning_in_graphs")),
    # BlockMasks that compiled code builds with create_block_mask(_compile=True) (transformers) are
    # traced into its graph instead of breaking it (block_masks.py; opt-in)
    ModuleHook("block_mask_tracing", ".block_masks", when=lambda settings: settings.trace_block_masks),
)


def hook(name: str) -> Hook:
    (found,) = [h for h in HOOKS if h.name == name]
    return found


# ---------------------------------------------------------------------------- enable / disable

@dataclasses.dataclass(frozen=True)
class _Saved:
    config: dict  # the config values enable() replaced
    installed: frozenset  # names of the hooks installed before


_saved: list[_Saved] = []


def _config_values(settings: Settings) -> dict:
    from torch._inductor import config

    from .gemm.choices import BACKEND_TOKEN

    values: dict[str, Any] = {"inductor_choices_class": _factory(settings)}
    backends = [b.strip() for b in config.max_autotune_gemm_backends.split(",") if b.strip()]
    if BACKEND_TOKEN not in (b.upper() for b in backends):
        values["max_autotune_gemm_backends"] = ",".join([*backends, BACKEND_TOKEN])
    if settings.fuse_epilogues:  # otherwise only Triton templates are fused
        values["benchmark_epilogue_fusion"] = False
    for graph_pass in GRAPH_PASSES:
        if graph_pass.asked(settings):
            values[graph_pass.slot] = graph_pass.instance(settings)
        elif graph_pass.ours(getattr(config, graph_pass.slot)):  # an outer enable()'s
            values[graph_pass.slot] = None
    if settings.pdl:
        values["triton.enable_pdl"] = True
    else:  # a level without it under an outer enable(pdl=True) gets the value from before that level
        before = next((level.config["triton.enable_pdl"] for level in _saved if "triton.enable_pdl" in level.config),
                      None)
        if before is not None:
            values["triton.enable_pdl"] = before
    return values


@dataclasses.dataclass(frozen=True)
class _GraphPass:
    """One of our Inductor graph passes: the settings that ask for it (any of them), the config
    slot it takes and where it lives (imported only when needed): the pass object, or (`factory`)
    what makes one from those settings' values."""

    settings: tuple
    slot: str
    module: str
    name: str
    factory: bool = False

    def asked(self, settings: Settings) -> bool:
        return any(getattr(settings, name) is not False for name in self.settings)  # (None: where autotuned)

    def instance(self, settings: Settings | None = None):
        made = _attr(self.module, self.name)()
        if not self.factory:
            return made
        return made(*(getattr(settings or Settings(), name) for name in self.settings))

    def ours(self, value) -> bool:
        """Whether `value` (the slot's content) is this pass, not the user's."""
        return value is not None and isinstance(value, type(self.instance()))


    def switches(self, asked: dict, on_by_default: tuple = ()) -> list:
        """This pass's switches (`asked`, by name) as enable() sets them: all off where the slot
        holds the user's pass (one set True for it raises instead), else those in `on_by_default`
        on where left None (the others' None stays: where autotuned)."""
        from torch._inductor import config

        value = getattr(config, self.slot)
        users = value is not None and not self.ours(value)
        on = [name for name, switch in asked.items() if switch]
        if users and on:
            raise RuntimeError(f"inductor-cute: torch._inductor.config.{self.slot} is already set ({value!r}); "
                               f"{' and '.join(on)} need(s) to install inductor-cute's own")
        if users:
            log.info("inductor-cute: %s is the user's; %s stay(s) off", self.slot, ", ".join(asked))
            return [False] * len(asked)
        return [True if switch is None and name in on_by_default else switch for name, switch in asked.items()]


GROUP_GEMV, MOE, SCATTERS = GRAPH_PASSES = (
    _GraphPass(("group_gemv",), "post_grad_custom_post_pass", ".gemm.shared_a", "GROUP_GEMV_PASS"),
    _GraphPass(("fuse_moe_gate", "fuse_moe_gather", "moe_routing"), "post_grad_custom_pre_pass", ".grouped.moe_pass",
               "moe_pass", factory=True),
    _GraphPass(("moe_scatters",), "joint_custom_pre_pass", ".grouped.scatters", "SCATTERS_PASS"))


class _Enabled:
    """Returned by enable(); leaving a `with` block restores the previous state."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        disable()


def enable(fuse_epilogues: bool = False, flex_decode: bool = True, flex_prefill: bool = False,
           flex_backward: bool = False, group_gemv: bool | None = None, pdl: bool = False,
           keep_m1_mm: bool = False, trace_block_masks: bool = True, fuse_moe_gate: bool | None = None,
           fuse_moe_gather: bool | None = None, moe_routing: bool | None = None,
           moe_scatters: bool | None = None) -> _Enabled:
    """Offer inductor-cute GEMMs to torch.compile's max-autotune (mm, addmm, bmm, baddbmm).

    With `fuse_epilogues`, a winning GEMM of ours takes the pointwise ops after it into its
    epilogue. That needs Inductor's `benchmark_epilogue_fusion` off (otherwise only Triton
    templates are fused), which also changes how Triton templates pick their fusions.
    With `flex_decode` (on by default), flex_attention decoding calls whose score_mod, mask_mod and
    BlockMask our split-KV kernel can take run it (inductor/flex/lowering.py); the rest take the stock
    lowering. With `flex_prefill` (off by default: faster than Triton at head dims 128 and 192/128,
    level with it at 64, slower than SDPA on every measured case), inference calls
    with longer queries than the decode kernel takes run our prefill kernel, on the same terms.
    With `flex_backward` (off by default: forward + backward 1.22x Triton on causal Llama shapes but
    0.92x with document masking at 16k tokens), training
    graphs' flex_attention calls run our forward (decode, or prefill with `flex_prefill`) and our
    backward kernel when both can take the call, and both stock kernels otherwise (one decision for
    the two graphs: inductor/flex/lowering.py); without it training graphs keep the stock kernels.
    `torch._grouped_mm` calls of the MoE forward form (bf16, 2-D x 3-D with offsets) get our grouped
    GEMM's configs among their autotuning choices (inductor/grouped/lowering.py).
    With `group_gemv` (on by default), a post-grad graph pass (Inductor's
    `post_grad_custom_post_pass`) turns the 2 or 3 decode mm's (M <= 16, bf16/fp16, weights of at
    most 64 MiB) that share their activation, such as the q/k/v projections, into one call of the
    grouped GEMV (inductor/gemm/shared_a.py): 21.2 us against 28.8 us for three cuBLAS calls at
    Llama-3.1-8B's q/k/v, M = 8. The default leaves a pass the user set in place (and groups
    nothing); `group_gemv=True` asks for the pass and refuses to replace the user's.
    With `pdl` (off by default: experimental, unmeasured on its own), Inductor's Triton kernels
    use programmatic dependent launch (`triton.enable_pdl`): each lets the next kernel start its
    prologue once its loads are issued. Inductor makes a kernel wait only for accesses that depend
    on the kernel just before it, so a kernel that neither waits nor releases can let a later one
    start while an earlier one still runs; that is Inductor's scheme, and the reason this stays
    opt-in. Our decode kernels (GEMV, flex decoding) always launch
    that way and wait for the previous kernel before touching memory
    (kernels/common/dependent_launch.py).
    With `keep_m1_mm` (off by default, unmeasured), M = 1 bf16/fp16 mm's stay mm's where
    coordinate-descent tuning (the max-autotune modes) would decompose them into a mul+sum
    reduction, so they are autotuned (cuBLAS, our GEMV) and grouped like other decode GEMMs
    (inductor/gemm/m1.py).
    With `trace_block_masks` (on by default), Dynamo traces a decode-sized (at most 64 queries)
    `create_block_mask(..., _compile=True)` (how transformers builds each step's BlockMask) into
    the compiled graph as `_compile=False`, instead of breaking the graph at the deprecation
    warning that flag raises since torch 2.10 (inductor/block_masks.py): a transformers decode
    step is one graph instead of several with Python between them, with or without the 2-D
    attention mask generate() passes (transformers' check of it for zeros is traced as "it may
    have some", so the step reads the padding from it at run time). On the H200 that took the GPU's wait
    for the host from 270-1140 us to ~60 us per 4-layer Llama decode step. It applies to graphs
    Dynamo traces while it is on: enable it before the model's first compiled call.
    With `fuse_moe_gate` and `fuse_moe_gather` (default None: in graphs compiled with max-autotune
    and our backend; True: in every graph; False: never), a post-grad pass (Inductor's
    `post_grad_custom_pre_pass`) turns the MoE up projection's `silu(gate) * up` of a fused gate_up
    `torch._grouped_mm` (chunked or split in halves, as transformers' grouped_mm experts write it)
    into one grouped GEMM with the gate in its epilogue (inductor/grouped/gate.py), so the
    (tokens, 2F) product is never stored, and a `torch._grouped_mm` (or fused gate) of gathered rows
    `x[idx]`, as torchtitan-style MoE code permutes tokens to experts, into one grouped GEMM that
    reads x's rows through idx (inductor/grouped/gather.py): the (tokens * top_k, hidden) copy is
    never written and read back. Under max-autotune the fused calls' configs are autotuned against
    eager's unfused computation (inductor/grouped/gate_lowering.py; not against what stock Inductor
    fuses the unfused graph into), so a fusion is dropped where it measures slower than that; that
    is why the default leaves graphs without max-autotune, or off Hopper, alone. (H100, the
    Qwen3-30B-A3B MoE block's forward: 1.26x stock at 4096 and 16384 tokens with both, 1.15x
    without.) Training graphs keep their forward products (they save the rows and the gate for the
    backward); there `fuse_moe_gate` fuses the gate's backward instead: autograd's SiLU-and-mul
    gradient into the down projection's input gradient (inductor/grouped/gate_grad.py), so that
    product is never stored and the pointwise kernel that reads it and the saved gate goes.
    With `moe_routing` (on by default), the same pass sorts an MoE permute's top-k expert ids as
    uint8/int16 keys (one or two radix passes instead of eight) and turns a top-k over at most 512
    elements (the router's experts) into Inductor's Triton sort and a slice (inductor/grouped/
    routing.py). A pass the user set in that slot is left in place by the defaults (the MoE graphs
    are then not rewritten), and an explicit True for any of the three refuses to replace it.
    With `moe_scatters` (on by default), a joint-graph pass (Inductor's `joint_custom_pre_pass`)
    turns accumulating scatters whose index is a sort's permutation, its inverse or the
    permutation divided by top-k (an MoE permute's backward, torchtitan's scatter-add combine)
    into gathers, summing each token's k rows in a fixed order instead of atomic adds into zeros
    (inductor/grouped/scatters.py); a user's pass in that slot is treated as above."""
    from torch._inductor import config

    from .gemm.choices import CuteChoices

    current = config.inductor_choices_class
    if current is not None and getattr(current, "func", current) is not CuteChoices:
        raise RuntimeError(f"inductor-cute: torch._inductor.config.inductor_choices_class is already set "
                           f"({current!r}); inductor-cute needs to install its own")
    # the defaults: on (the MoE fusions: where autotuned), unless that would replace the user's pass
    (group_gemv,) = GROUP_GEMV.switches({"group_gemv": group_gemv}, ("group_gemv",))
    fuse_moe_gate, fuse_moe_gather, moe_routing = MOE.switches(
        {"fuse_moe_gate": fuse_moe_gate, "fuse_moe_gather": fuse_moe_gather, "moe_routing": moe_routing},
        ("moe_routing",))
    (moe_scatters,) = SCATTERS.switches({"moe_scatters": moe_scatters}, ("moe_scatters",))
    fuse_moe_gate, fuse_moe_gather = (None if f is None else bool(f) for f in (fuse_moe_gate, fuse_moe_gather))
    settings = Settings(bool(fuse_epilogues), bool(flex_decode), bool(flex_prefill), bool(flex_backward),
                        bool(group_gemv), bool(pdl), bool(keep_m1_mm), bool(trace_block_masks), fuse_moe_gate,
                        fuse_moe_gather, bool(moe_routing), bool(moe_scatters))
    values = _config_values(settings)
    saved = _Saved({key: getattr(config, key) for key in values}, frozenset(h.name for h in HOOKS if h.installed()))
    try:
        for key, value in values.items():
            setattr(config, key, value)
        for h in HOOKS:
            _set(h, h.when(settings))
    except BaseException:
        _restore(saved)
        raise
    _saved.append(saved)
    return _Enabled()


def disable() -> None:
    """Undo the last enable(); a no-op when not enabled."""
    if _saved:
        _restore(_saved.pop())


def _restore(saved: _Saved) -> None:
    from torch._inductor import config

    for key, value in saved.config.items():
        setattr(config, key, value)
    for h in reversed(HOOKS):
        _set(h, h.name in saved.installed)


def _set(h: Hook, installed: bool) -> None:
    if installed:
        h.install()
    else:
        h.uninstall()


def is_enabled() -> bool:
    from torch._inductor import config

    from .gemm.choices import BACKEND_TOKEN, CuteChoices

    factory = config.inductor_choices_class
    ours = getattr(factory, "func", factory) is CuteChoices
    return ours and BACKEND_TOKEN in config.max_autotune_gemm_backends.upper()


# From this import on, each thread's V.choices follows the config (thread_choices.py). A handler set
# before it is unknown: one of the stock class is then taken for one Inductor built, and rebuilt
# under enable().
track_thread_choices()
