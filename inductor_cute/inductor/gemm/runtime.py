"""What torch.compile'd graphs call to run our GEMM on Inductor's buffers.

Output code defines one GemmLauncher per call site in its header and calls it with the buffers,
the output after the inputs (extern.define_launcher writes both):

    icute_gemm_3 = inductor_cute.inductor.gemm.runtime.GemmLauncher(op='mm', config=(...)).launch
    ...
    icute_gemm_3(arg0_1, reinterpret_tensor(arg1_1, (1024, 2048), (1, 1024), 0), buf0)

A launcher is built from plain values, so a graph loaded from Inductor's FX cache builds it in a
fresh process (the kernel then loads from our disk cache without compiling). Its first call with
tensors of a layout goes through every check of ops.mm/bmm; later calls with that layout repeat
the launch it remembered (host.gemm.GemmLaunch): a layout key, the operand views, the GEMV's
workspace, the kernel call. A call with another layout (a dynamic size, another stride) takes the
checked path again. `gemm` (Inductor's extern kernel: what autotuning times) finds a shared
launcher by its arguments.
"""

from __future__ import annotations

import functools

import torch

from ...host import gemm as host_gemm
from ...kernels.gemm.family import from_tuple
from .buckets import MBuckets, is_table, table_of

MODULE = __name__  # what generated output code imports
BATCHED = {"bmm", "baddbmm"}
WITH_INPUT = {"addmm", "baddbmm"}
PLANS_PER_LAUNCHER = 64  # layouts one call site remembers (dynamic sizes); then it starts over


def is_bias_row(sizes, strides, n: int) -> bool:
    """Whether an input of these sizes/strides is one contiguous (N,) row broadcast over the output."""
    return (len(sizes) > 0 and sizes[-1] == n and strides[-1] == 1
            and all(size == 1 or stride == 0 for size, stride in zip(sizes[:-1], strides[:-1])))


def input_role(sizes, strides, n: int, beta: float) -> str | None:
    """How an addmm/baddbmm input reaches the kernel: "row" (our bias vector), "full" (our C
    operand, scaled by beta) or None when beta == 0 (torch ignores the input then, NaN included)."""
    if beta == 0:
        return None
    return "row" if beta == 1 and is_bias_row(sizes, strides, n) else "full"


@functools.lru_cache(maxsize=None)
def _config(params: tuple):
    """One config, or the MBuckets of a table (buckets.py) to pick from by the call's M."""
    return table_of(params) if is_table(params) else from_tuple(params)


def layout_key(sources: tuple) -> tuple:
    """What a remembered launch depends on: each tensor's shape, strides, dtype and 16-byte
    alignment, and the output's device (one call site's tensors share a device: Inductor places
    them, and the checked path that made the plan refused anything else). Spelled out for the
    common arities: a loop costs a third more, on every call."""
    if len(sources) == 3:  # mm, bmm: a, b, out
        a, b, d = sources
        return (a.shape, a.stride(), a.dtype, a.data_ptr() & 15, b.shape, b.stride(), b.dtype, b.data_ptr() & 15,
                d.shape, d.stride(), d.dtype, d.data_ptr() & 15, d.device)
    if len(sources) == 4:  # addmm, baddbmm: inp, a, b, out
        c, a, b, d = sources
        return (c.shape, c.stride(), c.dtype, c.data_ptr() & 15, a.shape, a.stride(), a.dtype, a.data_ptr() & 15,
                b.shape, b.stride(), b.dtype, b.data_ptr() & 15, d.shape, d.stride(), d.dtype, d.data_ptr() & 15,
                d.device)
    return (*[None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in sources],
            sources[2].device)  # an epilogue's a, b, out, row, full


class GemmLauncher:
    """out = alpha * a @ b (+ beta * inp for addmm/baddbmm) with one GemmConfig or GemvConfig
    (`config` as kernels.gemm.family.as_tuple makes it), or with the one of an M-bucket table
    (`config` as buckets.as_table_tuple makes it) whose range holds the call's M, picked once per
    layout on the checked path; with a fused `epilogue` program, out = program(a @ b, row, full)
    instead.

    Output code calls the bound `launch` with its tensors positionally: (a, b, out), (inp, a, b,
    out) for addmm/baddbmm, (a, b, out, row, full) with an epilogue (None for an operand it does
    not read). A bound method with positional arguments costs a fifth of an instance call with
    keywords; `launcher(*inputs, out=, row=, full=)` is the readable spelling."""

    __slots__ = ("op", "config", "alpha", "beta", "epilogue", "_plans", "_static")

    def __init__(self, op: str, config: tuple, alpha: float = 1.0, beta: float = 1.0, epilogue: str = "") -> None:
        self.op, self.config, self.alpha, self.beta, self.epilogue = op, tuple(config), alpha, beta, epilogue
        self._plans: dict[tuple, host_gemm.GemmLaunch | None] = {}  # None: this layout needs the checked path
        self._static: host_gemm.GemmLaunch | None = None

    def __repr__(self) -> str:
        return f"GemmLauncher(op={self.op!r}, config={self.config!r}, alpha={self.alpha!r}, beta={self.beta!r}, " \
               f"epilogue={self.epilogue!r})"

    def launch(self, *sources: torch.Tensor | None) -> None:
        key = layout_key(sources)
        launch = self._plans.get(key)
        if launch is None:
            self.checked(sources, key)
        else:
            launch(sources)

    def launch_static(self, *sources: torch.Tensor | None) -> None:
        """`launch` for a call site whose tensors Inductor gives static layouts (sizes, strides,
        offsets, dtypes: codegen.is_static decided it): the launch remembered from the first
        16-byte aligned call serves every later aligned one without a layout key. Alignment is
        the one property a static layout does not fix (a graph input Inductor saw misaligned is
        passed as it comes), so it is checked; a misaligned call takes the keyed path."""
        for t in sources:
            if t is not None and t.data_ptr() & 15:
                return self.launch(*sources)
        launch = self._static
        if launch is None:
            self._static = self.checked(sources)  # None again where an operand was copied: checked each call
        else:
            launch(sources)

    def __call__(self, *inputs: torch.Tensor, out: torch.Tensor, row: torch.Tensor | None = None,
                 full: torch.Tensor | None = None) -> None:
        if self.epilogue:
            self.launch(*inputs, out, row, full)
        else:
            self.launch(*inputs, out)

    def checked(self, sources: tuple, key: tuple | None = None) -> host_gemm.GemmLaunch | None:
        """Run the call on `sources` (as `launch` takes them) through every check; remember (under
        `key`) and return the launch that repeats it (None where an operand was copied)."""
        if self.epilogue:
            *inputs, out, row, full = sources
        else:
            *inputs, out = sources
        i_out = len(inputs)
        alpha, beta, bias, c = self.alpha, None, None, None
        if self.epilogue:
            (a, b), alpha, bias, c = inputs, 1.0, row, full
            origins = (0, 1, i_out, i_out + 2, i_out + 1)  # A, B, D, C, bias
        elif self.op in WITH_INPUT:
            inp, a, b = inputs
            role = input_role(inp.shape, inp.stride(), out.shape[-1], self.beta)
            if role == "row":
                bias = inp[(0,) * (inp.dim() - 1)]  # a view from inp's start: the launch remakes it from inp
            elif role == "full":
                c, beta = inp, self.beta
            origins = (1, 2, i_out, 0 if c is not None else None, 0 if bias is not None else None)
        else:
            a, b = inputs
            origins = (0, 1, i_out, None, None)
        config = _config(self.config)
        if isinstance(config, MBuckets):
            config = config.pick(out.shape[-2])
        launch = host_gemm.run_checked("bmm" if self.op in BATCHED else "mm", a, b, bias=bias, c=c, alpha=alpha,
                                       beta=beta, out=out, config=config, epilogue=self.epilogue,
                                       sources=sources, origins=origins)
        if key is not None:
            if len(self._plans) >= PLANS_PER_LAUNCHER:
                self._plans.clear()
            self._plans[key] = launch
        return launch


_LAUNCHERS: dict[tuple, GemmLauncher] = {}


def gemm(*inputs: torch.Tensor, out: torch.Tensor, op: str, config: tuple, alpha: float = 1.0,
         beta: float = 1.0, epilogue: str = "", row: torch.Tensor | None = None,
         full: torch.Tensor | None = None) -> None:
    """GemmLauncher(op, config, alpha, beta, epilogue)(*inputs, out=out, row=row, full=full), with
    one launcher (holding no tensor) per distinct set of those values: what autotuning calls back
    to back, and what output code written before launchers existed calls."""
    key = (op, config, alpha, beta, epilogue)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS.setdefault(key, GemmLauncher(op, config, alpha, beta, epilogue))
    if epilogue:
        launcher.launch(*inputs, out, row, full)
    else:
        launcher.launch(*inputs, out)
