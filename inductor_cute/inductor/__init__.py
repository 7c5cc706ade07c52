"""torch.compile integration: `enable()` makes Inductor's GEMM autotuning consider our kernels.

    import inductor_cute
    inductor_cute.enable()              # or: with inductor_cute.enable(): ...
    torch.compile(model, mode="max-autotune")

For people who configure Inductor directly, the same two settings `enable()` makes:

    torch._inductor.config.inductor_choices_class = inductor_cute.inductor.choices_factory()
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON,ICUTE"

Logs: TORCH_LOGS="+inductor_cute" (which choice won, timings, why ours were dropped).
"""

from __future__ import annotations

import functools
import logging

from .gemm.choices import BACKEND_TOKEN, CuteChoices

log = logging.getLogger(__name__)
_saved: list[tuple] = []


def choices_factory(fuse_epilogues: bool = False, flex_decode: bool = False) -> functools.partial:
    """The value for `config.inductor_choices_class`: a picklable factory whose tag (our version,
    kernel sources and settings) enters Inductor's FX-graph cache key."""
    import hashlib
    from pathlib import Path

    from .. import __version__
    from ..runtime.spec import source_hash

    h = hashlib.sha256(source_hash(f"{__name__}.gemm.runtime").encode())  # kernels + runtime calling convention
    for path in sorted(Path(__file__).parent.rglob("*.py")):  # lowering, fusion and code generation
        h.update(path.read_bytes())
    code = h.hexdigest()[:16]
    settings = f"fuse{int(fuse_epilogues)}-flex{int(flex_decode)}"
    return functools.partial(CuteChoices, tag=f"inductor-cute-{__version__}-{code}-{settings}")


def _reset_thread_choices() -> None:
    # V.choices is created once per thread from the config; drop it so the next compile re-reads.
    from torch._inductor import virtualized

    if hasattr(virtualized.threadlocal, virtualized._choices._key):
        delattr(virtualized.threadlocal, virtualized._choices._key)


class _Enabled:
    """Returned by enable(); leaving a `with` block restores the previous settings."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        disable()


def enable(fuse_epilogues: bool = False, flex_decode: bool = True) -> _Enabled:
    """Offer inductor-cute GEMMs to torch.compile's max-autotune (mm, addmm, bmm, baddbmm).

    With `fuse_epilogues`, a winning GEMM of ours takes the pointwise ops after it into its
    epilogue. That needs Inductor's `benchmark_epilogue_fusion` off (otherwise only Triton
    templates are fused), which also changes how Triton templates pick their fusions.
    With `flex_decode` (on by default), flex_attention decoding calls whose score_mod, mask_mod and
    BlockMask our split-KV kernel can take run it (inductor/flex.py); the rest take the stock lowering."""
    from torch._inductor import config

    from .gemm.extern import fusion_enabled, set_fusion
    from .flex.lowering import install as install_flex
    from .flex.lowering import installed as flex_installed
    from .gemm.template import install_scheduling

    current = config.inductor_choices_class
    if current is not None and getattr(current, "func", current) is not CuteChoices:
        raise RuntimeError(f"inductor-cute: torch._inductor.config.inductor_choices_class is already set "
                           f"({current!r}); inductor-cute needs to install its own")
    _saved.append((current, config.max_autotune_gemm_backends, config.benchmark_epilogue_fusion, fusion_enabled(),
                   flex_installed()))
    config.inductor_choices_class = choices_factory(fuse_epilogues, flex_decode)
    set_fusion(fuse_epilogues)
    if fuse_epilogues:
        install_scheduling()
        config.benchmark_epilogue_fusion = False
    backends = [b.strip() for b in config.max_autotune_gemm_backends.split(",") if b.strip()]
    if BACKEND_TOKEN not in (b.upper() for b in backends):
        config.max_autotune_gemm_backends = ",".join([*backends, BACKEND_TOKEN])
    if flex_decode:
        install_flex()
    _install_feedback_logger()
    _reset_thread_choices()
    return _Enabled()


def disable() -> None:
    """Undo the last enable(); a no-op when not enabled."""
    from torch._inductor import config

    from .gemm.extern import set_fusion
    from .flex.lowering import uninstall as uninstall_flex
    from .gemm.template import uninstall_scheduling

    if not _saved:
        return
    (config.inductor_choices_class, config.max_autotune_gemm_backends, config.benchmark_epilogue_fusion, fused,
     flex) = _saved.pop()
    set_fusion(fused)
    if not fused:
        uninstall_scheduling()
    if not flex:
        uninstall_flex()
    _reset_thread_choices()


def is_enabled() -> bool:
    from torch._inductor import config

    factory = config.inductor_choices_class
    return getattr(factory, "func", factory) is CuteChoices and BACKEND_TOKEN in config.max_autotune_gemm_backends.upper()


@functools.cache
def _install_feedback_logger() -> None:
    from torch._inductor import select_algorithm

    select_algorithm.add_feedback_saver(_log_timings)


def _log_timings(timings, name, input_nodes, choices, profiled_time_fn, precompile_times=None) -> None:
    from .gemm.extern import CuteGemmCaller

    ours = [c for c in timings if isinstance(c, CuteGemmCaller)]
    if not ours or not log.isEnabledFor(logging.INFO):
        return
    ranked = sorted(timings.items(), key=lambda kv: kv[1])
    winner, best = ranked[0]
    our_best = min(timings[c] for c in ours)
    log.info("inductor-cute %s: winner %s %.1f us; best of ours %.1f us (%+.1f%%)", name, winner,
             best * 1e3, our_best * 1e3, (our_best / best - 1) * 100 if best else 0.0)
    for choice, ms in ranked:
        log.debug("  %-60s %9.1f us", str(choice)[:60], ms * 1e3)
