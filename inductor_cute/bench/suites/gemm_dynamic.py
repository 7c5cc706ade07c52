"""GEMMs in a dynamic-shape graph (issue 11): Linear(4096, 11008) + GELU + Linear(11008, 4096) +
residual, compiled once with dynamic=True and called at every M, as a server batching requests
of varying size calls it.

Runners:
  inductor_cute  torch.compile(dynamic=True, max-autotune-no-cudagraphs), inductor-cute enabled
  triton         the same, stock (ATen and Triton)
  aten           stock torch.compile compiled static for that M (what a graph specialised to the
                 size would run)
The dynamic graphs are called first with 1 row, then 17 (dynamo specialises a size of 1, so the
dynamic graph is made and autotuned at 17), then at every M of the suite; all of that inside the
runner's config, so timing never recompiles. Device time per call (the harness's timing).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ..case import Case

HIDDEN, INTERMEDIATE = 4096, 11008
ROWS = (1, 17, 512, 4096, 16384)
QUICK_ROWS = (17, 4096)
FIRST_ROWS = (1, 17)  # the sizes a dynamic graph meets before the suite's


def case_name(m: int) -> str:
    return f"mlp {HIDDEN}x{INTERMEDIATE} dynamic M={m}"


class Block(torch.nn.Module):
    """The MLP as a model holds it: weights are parameters, so a dynamic=True compile keeps their
    shapes static (dynamo's force_parameter_static_shapes) and only the rows vary. Weights passed
    as graph inputs would be dynamic too, and no GEMM kernel of ours (nor a tuned Triton one)
    serves a symbolic K or N."""

    def __init__(self, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, device="cuda",
                 dtype=torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator(device=device).manual_seed(0)

        def weight(*shape, scale):
            values = torch.randn(*shape, device=device, dtype=dtype, generator=g) * scale
            return torch.nn.Parameter(values, requires_grad=False)

        self.up, self.up_bias = weight(intermediate, hidden, scale=hidden ** -0.5), weight(intermediate, scale=0.1)
        self.down, self.down_bias = weight(hidden, intermediate, scale=intermediate ** -0.5), weight(hidden, scale=0.1)

    def forward(self, x):
        hidden = F.gelu(F.linear(x, self.up, self.up_bias), approximate="tanh")
        return x + F.linear(hidden, self.down, self.down_bias)


@functools.cache
def _block() -> Block:
    return Block()


def _inputs(m: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(m)
    return torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)


def compile_for(ours: bool, dynamic: bool, rows: tuple[int, ...]):
    """The MLP compiled in its own config and cold caches, called at each of `rows` inside it (so
    later calls at those sizes do not recompile); returns (compiled fn, compile seconds)."""
    import time

    import inductor_cute
    from torch._inductor import config, list_mode_options

    from .gemm_compiled import COLD, OUR_BACKENDS, STOCK_BACKENDS, _fresh_cache

    backends = OUR_BACKENDS if ours else STOCK_BACKENDS
    options = {**list_mode_options("max-autotune-no-cudagraphs"), "max_autotune_gemm_backends": backends}
    enabled = inductor_cute.enable() if ours else contextlib.nullcontext()
    # every runner's graphs are cache entries of the MLP's forward: more than dynamo's default 8
    many = torch._dynamo.config.patch(cache_size_limit=64, accumulated_cache_size_limit=1024)
    with enabled, many, config.patch(max_autotune_gemm_backends=backends, **COLD), _fresh_cache(), torch.no_grad():
        # the static runner compiles its own entry: dynamo keeps compiled graphs per code object and
        # options, and the stock dynamic runner's graph (same options) would serve its calls too
        compiled = torch.compile(_block() if dynamic else StaticEntry(_block()), options=options, dynamic=dynamic)
        start = time.perf_counter()
        for m in rows:
            compiled(_inputs(m))
        torch.cuda.synchronize()
        return compiled, time.perf_counter() - start


class StaticEntry(torch.nn.Module):
    """The MLP behind a forward of its own (another code object for dynamo's cache)."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)


@functools.cache
def _dynamic(ours: bool, rows: tuple[int, ...]):
    # No dynamo reset here: it would drop the other runner's compiled graph, which would then
    # recompile when timed, outside its config (stock); cases() resets once per suite run.
    return compile_for(ours, dynamic=True, rows=FIRST_ROWS + rows)


def _case(m: int, rows: tuple[int, ...]) -> Case:
    x = _inputs(m)
    flops = 2 * m * HIDDEN * INTERMEDIATE * 2
    n_bytes = 2 * (2 * HIDDEN * INTERMEDIATE + 2 * m * HIDDEN + INTERMEDIATE + HIDDEN)
    runners, notes = {}, []
    for backend, ours in (("inductor_cute", True), ("triton", False)):
        fn, seconds = _dynamic(ours, rows)
        runners[backend] = functools.partial(_call, fn, x)
        notes.append(f"{backend} dynamic compile (all sizes) {seconds:.0f} s")
    static, seconds = compile_for(False, dynamic=False, rows=(m,))
    runners["aten"] = functools.partial(_call, static, x)
    notes.append(f"aten (stock static) compile {seconds:.0f} s")
    from .gemm_compiled import capture

    late: list[str] = []
    with capture(late, []):
        for fn in runners.values():
            fn()
    if late:
        raise RuntimeError("a runner recompiled outside its config")
    return Case(name=case_name(m), params={"M": m, "hidden": HIDDEN, "intermediate": INTERMEDIATE,
                                           "dtype": "bfloat16"},
                flops=flops, bytes=n_bytes, matmul=True, runners=runners, notes=notes, atol=5e-2, rtol=5e-2)


def _call(fn, x):
    with torch.no_grad():
        return fn(x)


def cases(quick: bool):
    torch._dynamo.reset()
    _dynamic.cache_clear()
    rows = QUICK_ROWS if quick else ROWS
    return [functools.partial(_case, m, rows) for m in rows]
