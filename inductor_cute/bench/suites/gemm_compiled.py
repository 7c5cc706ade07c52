"""The gemm suite's shapes through torch.compile: max-autotune with inductor-cute enabled (ATen,
Triton and ours compete) vs stock max-autotune (ATen and Triton) vs eager cuBLAS.

Every compiled runner is compiled when its case is built, inside its own Inductor config and a
fresh, empty Inductor cache (no FX-graph or autotune cache hits from earlier compiles), so its
compile time is a cold one and the enabled state cannot leak into the stock runner; the runner
then only calls the compiled function. The notes say which choice won autotuning and how long each
compile took.
Our own compiled-kernel disk cache (INDUCTOR_CUTE_CACHE_DIR) is used as found:
benchmarks/autotune_cost.py measures cold and warm compiles in fresh processes.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable
from unittest import mock

import torch
import torch.utils._pytree as pytree

from ..case import Case
from .gemm import QUICK, SHAPES, _operands

OUR_CALL = "inductor_cute.inductor.gemm.runtime.GemmLauncher("  # defined once per call site
STOCK_BACKENDS = "ATEN,TRITON"
OUR_BACKENDS = "ATEN,TRITON,ICUTE"
# no FX-graph cache and no remote caches: every compile lowers and autotunes from scratch. The local
# autotune cache stays on, as users have it: it lives in the fresh cache directory (empty at the
# start), and within one compile it is what spares a model's layers re-benchmarking a GEMM shape
# already timed (off, a 4-layer Llama step ran 29 rounds for 7 shapes, each runner).
COLD = dict(fx_graph_cache=False, fx_graph_remote_cache=False, autotune_remote_cache=False)
_CALLER_KINDS = {"CuteGemmCaller": "inductor_cute", "TritonTemplateCaller": "triton", "ExternKernelCaller": "aten"}


@dataclass
class Compiled:
    """A function compiled under one config: `run()` calls it (under no_grad) on the case's inputs."""

    run: Callable
    out: object
    seconds: float  # first call: dynamo + lowering + autotuning + kernel compiles + one run
    code: str  # Inductor's output code
    gemms: list[dict] = field(default_factory=list)  # one per autotuned GEMM, see gemm_record

    @property
    def our_calls(self) -> int:
        return self.code.count(OUR_CALL)


def choice_kind(choice) -> str:
    """Which backend an autotuning choice belongs to: inductor_cute, triton, aten, or its class name."""
    name = type(choice).__name__
    if name == "CuteGemmCaller" or str(choice).startswith("inductor_cute_gemm("):
        return "inductor_cute"
    return _CALLER_KINDS.get(name, name)


def gemm_record(timings: dict, name: str, input_nodes) -> dict:
    """What one GEMM's autotuning decided: op, (M, N, K), the winning backend, best times in us."""
    mat1, mat2 = (list(n.get_size()) for n in input_nodes[-2:])
    mnk = tuple(int(x) if getattr(x, "is_number", True) else str(x) for x in (mat1[-2], mat2[-1], mat1[-1]))
    by_kind: dict[str, float] = {}
    for choice, ms in timings.items():
        kind = choice_kind(choice)
        by_kind[kind] = min(by_kind.get(kind, float("inf")), ms * 1e3)
    winner = min(by_kind, key=by_kind.get) if by_kind else None
    return {"op": name, "mnk": mnk, "winner": winner, "us": {k: round(v, 1) for k, v in by_kind.items()}}


def describe_gemms(gemms: list[dict]) -> str:
    """`mm 128x14336x4096 inductor_cute 31.0 us (triton 35.2, aten 33.9)` per GEMM, joined by ', '."""
    parts = []
    for g in gemms:
        others = ", ".join(f"{k} {v}" for k, v in sorted(g["us"].items()) if k != g["winner"])
        shape = "x".join(map(str, g["mnk"]))
        parts.append(f"{g['op']} {shape} {g['winner']} {g['us'].get(g['winner'])} us"
                     + (f" ({others})" if others else ""))
    return ", ".join(parts)


_recording: list[list] = []


def _feedback(timings, name, input_nodes, *rest) -> None:
    if _recording:
        try:
            _recording[-1].append(gemm_record(timings, name, input_nodes))
        except Exception:  # a record is a nicety; never disturb autotuning
            pass


@functools.cache
def _install_feedback() -> None:
    from torch._inductor import select_algorithm

    select_algorithm.add_feedback_saver(_feedback)


@contextlib.contextmanager
def capture(codes: list, gemms: list):
    """Collect the output code of every graph lowered, and the autotuning result of every GEMM."""
    from torch._inductor.graph import GraphLowering

    _install_feedback()
    _recording.append(gemms)
    try:
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            yield
    finally:
        _recording.pop()


def _fresh_cache():
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    return fresh() if fresh else contextlib.nullcontext()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compile_now(fn, args, *, mode: str | None, ours: bool, backends: str | None = None,
                dynamic: bool = False) -> Compiled:
    """torch.compile `fn` and call it once on `args`, inside its own config: inductor-cute enabled
    (backends ATEN,TRITON,ICUTE) or not (ATEN,TRITON), cold caches, no_grad. Later calls must not
    recompile (they would not see this config): this checks that they do not."""
    import inductor_cute
    from torch._inductor import config, list_mode_options

    from ...inductor import is_enabled

    backends = backends or (OUR_BACKENDS if ours else STOCK_BACKENDS)
    codes: list[str] = []
    gemms: list[dict] = []
    enabled = inductor_cute.enable() if ours else contextlib.nullcontext()
    with enabled, config.patch(max_autotune_gemm_backends=backends, **COLD), _fresh_cache(), \
            capture(codes, gemms), torch.no_grad():
        if is_enabled() != ours:
            raise RuntimeError(f"inductor-cute enabled={is_enabled()} while compiling a runner with ours={ours}")
        # mode as options, with the backends: torch.compile calls with equal options share
        # dynamo's compiled code, so ours and stock must differ in them
        options = {**(list_mode_options(mode) if mode else {}), "max_autotune_gemm_backends": backends}
        compiled = torch.compile(fn, options=options, dynamic=dynamic)
        start = time.perf_counter()
        out = compiled(*args)
        _sync()
        seconds = time.perf_counter() - start
        # a copy: CUDA-graph trees reuse an output's memory in later runs
        out = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def run():
        with torch.no_grad():
            return compiled(*args)

    late: list[str] = []
    with capture(late, []):
        for _ in range(2):  # outside the config now; with CUDA graphs this also records and replays
            run()
    _sync()
    if late:
        raise RuntimeError("the compiled function recompiled outside its config")
    return Compiled(run, out, seconds, "\n".join(codes), gemms)


def winner_note(label: str, c: Compiled) -> str:
    code_says = "our kernel in output code" if c.our_calls else "no kernel of ours in output code"
    gemms = describe_gemms(c.gemms) or "no GEMM autotuned"
    return f"{label}: {gemms}; {code_says}; compile {c.seconds:.1f} s"


def case_name(m: int, n: int, k: int, b_major: str) -> str:
    return f"{m}x{n}x{k} B {b_major.upper()}-major compiled"


def _mm(a, b):
    return torch.mm(a, b)


def _case(m: int, n: int, k: int, b_major: str) -> Case:
    torch._dynamo.reset()
    a, b = _operands(m, n, k, b_major)
    runners, notes = {"aten": lambda: torch.mm(a, b)}, []
    for backend, ours in (("inductor_cute", True), ("triton", False)):
        try:
            c = compile_now(_mm, (a, b), mode="max-autotune-no-cudagraphs", ours=ours)
        except Exception as e:  # the harness records a null time for a runner that does not exist
            from ...errors import first_line

            runners[backend] = None
            notes.append(f"{backend} compile failed: {first_line(e)[:160]}")
            continue
        runners[backend] = c.run
        notes.append(winner_note("ours" if ours else "stock", c))
    return Case(name=case_name(m, n, k, b_major), params={"M": m, "N": n, "K": k, "b_major": b_major},
                flops=2 * m * n * k, bytes=2 * (m * k + k * n + m * n), matmul=True, notes=notes, runners=runners)


def cases(quick: bool):
    return [functools.partial(_case, m, n, k, major) for m, n, k in (QUICK if quick else SHAPES) for major in ("n", "k")]
