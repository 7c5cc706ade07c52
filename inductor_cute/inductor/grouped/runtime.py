"""What torch.compile'd graphs call to run our grouped GEMM on Inductor's buffers.

Output code defines one GroupedLauncher per call site in its header and calls it with the buffers,
the output last (extern.CuteGroupedOut writes both):

    icute_grouped_mm_2 = inductor_cute.inductor.grouped.runtime.GroupedLauncher(config=(...)).launch
    ...
    icute_grouped_mm_2(arg0_1, reinterpret_tensor(arg1_1, (8, 2048, 768), (1572864, 1, 2048), 0), arg2_1, buf0)

A launcher is built from plain values, so a graph loaded from Inductor's FX cache builds it in a
fresh process (the kernel then loads from our disk cache without compiling). Each call goes
through ops.grouped_mm with the launcher's config, parsed once; the offsets stay on the device.
`grouped_mm` is Inductor's extern kernel (what autotuning times).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F

from ...errors import UnsupportedError
from ...host import grouped_gemm as host_grouped
from ...kernels.gemm.grouped_config import GroupedConfig

MODULE = __name__  # what generated output code imports
log = logging.getLogger(__name__)


def as_tuple(config: GroupedConfig) -> tuple:
    """A config as plain values for output code and autotuning keys; GroupedConfig(*t) undoes it."""
    return dataclasses.astuple(config)  # every field in order (as_params leaves some out)


class GroupedLauncher:
    """out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g] (or, for a 2-D b, the weight gradient
    out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]) with one GroupedConfig (as `as_tuple`
    spells it); with an `activation`, the gated up projection act(a @ b_gate) * (a @ b_up)
    (ops.grouped_mm_gated). Output code calls the bound `launch` with (a, b, offs, out) positionally."""

    __slots__ = ("config", "activation", "_config")

    def __init__(self, config: tuple, activation: str = "") -> None:
        self.config, self.activation = tuple(config), activation
        self._config = GroupedConfig(*self.config)

    def __repr__(self) -> str:
        gate = f", activation={self.activation!r}" if self.activation else ""
        return f"GroupedLauncher(config={self.config!r}{gate})"

    def launch(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
        if not self.activation:
            host_grouped.grouped_mm(a, b, offs, out, config=self._config)
            return
        fused_product(a, b, offs, self.activation, out=out, config=self._config)

    def launch_rows(self, a: torch.Tensor, rows: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                    out: torch.Tensor) -> None:
        """The product of a's rows picked by `rows` (gather.py's op), gated when an activation is set."""
        fused_product(a, b, offs, self.activation, rows=rows, out=out, config=self._config)

    def launch_gate_grad(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor,
                         up: torch.Tensor, out: torch.Tensor) -> None:
        """The gate's gradient at the saved gate and up for the output gradient a @ b (gate_grad.py's op)."""
        fused_gate_grad(a, b, offs, gate, up, self.activation, out=out, config=self._config)


def fused_product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, activation: str, *,
                  rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  config: GroupedConfig | None = None) -> torch.Tensor:
    """A fused MoE op's computation by our kernel (the gated product where `activation` names one,
    of a's rows picked by `rows` when given; the ops, gate.py and gather.py, and their launchers);
    what only real tensors show the kernel cannot take (an unaligned pointer) is computed unfused."""
    try:
        if activation:
            return host_grouped.grouped_mm_gated(a, b, offs, activation, out, config=config, rows=rows)
        return host_grouped.grouped_mm(a, b, offs, out, config=config, rows=rows)
    except UnsupportedError as e:
        log.debug("grouped_mm%s: %s; unfused instead", "_rows" if rows is not None else "_gated", e)
    return unfused_product(a, b, offs, activation, rows, out=out)


def unfused_product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, activation: str,
                    rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_product`'s computation by torch's kernels (into `out` when given: the gate's product
    straight into it)."""
    a_rows = a if rows is None else a[rows]
    if activation:
        return unfused_gate(a_rows, b, offs, activation, out=out)
    result = torch._grouped_mm(a_rows, b, offs=offs)
    return result if out is None else out.copy_(result)


# the gate activations as torch computes them (grouped_config.GATES)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}


def fused_gate_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    activation: str, *, out: torch.Tensor | None = None,
                    config: GroupedConfig | None = None) -> torch.Tensor:
    """gate_grad.py's op by our kernel; what only real tensors show it cannot take runs unfused."""
    try:
        return host_grouped.grouped_mm_gate_grad(a, b, offs, gate, up, activation, out, config=config)
    except UnsupportedError as e:
        log.debug("grouped_mm_gate_grad: %s; unfused instead", e)
    return unfused_gate_grad(a, b, offs, gate, up, activation, out=out)


def unfused_gate_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_gate_grad`'s computation by torch's kernels, as autograd computes it: the product,
    then act(gate) * up's backward (into `out` when given)."""
    if activation != "silu":
        raise ValueError(f"the gate's gradient of {activation!r} is not implemented (silu is)")
    y = torch._grouped_mm(a, b, offs=offs)
    return torch.cat([torch.ops.aten.silu_backward(y * up, gate), y * F.silu(gate)], dim=1, out=out)


def unfused_gate(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, activation: str,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up of torch._grouped_mm(a, b, offs) with b's columns [gate | up]: the fused
    kernel's computation without it (into `out` when given)."""
    gate, up = torch._grouped_mm(a, b, offs).chunk(2, dim=-1)
    return torch.mul(ACTIVATIONS[activation](gate), up, out=out)


_LAUNCHERS: dict[tuple, GroupedLauncher] = {}


def _launcher(config: tuple, activation: str = "") -> GroupedLauncher:
    launcher = _LAUNCHERS.get((config, activation))
    if launcher is None:
        launcher = _LAUNCHERS.setdefault((config, activation), GroupedLauncher(config, activation))
    return launcher


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor, config: tuple) -> None:
    """GroupedLauncher(config).launch(a, b, offs, out), one launcher per config: what autotuning
    calls back to back."""
    _launcher(config).launch(a, b, offs, out)


def grouped_mm_gated(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor, config: tuple,
                     activation: str) -> None:
    """The gated form of `grouped_mm` (the extern kernel of the fused MoE gate's autotuning)."""
    _launcher(config, activation).launch(a, b, offs, out)


def grouped_mm_rows(a: torch.Tensor, rows: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, out: torch.Tensor,
                    config: tuple, activation: str) -> None:
    """The gathered form of `grouped_mm` (the extern kernel of gather.py's op's autotuning)."""
    _launcher(config, activation).launch_rows(a, rows, b, offs, out)


def grouped_mm_gate_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                         *, out: torch.Tensor, config: tuple, activation: str, gate_grad: bool = True) -> None:
    """The gate's gradient form of `grouped_mm` (the extern kernel of gate_grad.py's op's autotuning;
    `gate_grad` marks its choices)."""
    _launcher(config, activation).launch_gate_grad(a, b, offs, gate, up, out)


def grouped_mm_unfused(*inputs: torch.Tensor, out: torch.Tensor, activation: str, gate_grad: bool = False) -> None:
    """The fused ops' computation by torch's own kernels, into `out`: (a, b, offs) gated, or
    (a, rows, b, offs) gathered (and gated when an activation is named), or with `gate_grad` (a, b,
    offs, gate, up) the gate's gradient. The autotuning choice beside our fused configs (gate_lowering.py):
    a fusion is taken only where it measures faster."""
    if gate_grad:
        unfused_gate_grad(*inputs, activation, out=out)
        return
    a, *rows, b, offs = inputs
    unfused_product(a, b, offs, activation, *rows, out=out)


def even_offsets(tokens: int, groups: int, alignment: int, device, dtype=torch.int32) -> torch.Tensor:
    """Cumulative ends of `groups` groups splitting `tokens` evenly, the inner ends rounded to
    `alignment` as torch's create_offsets rounds them."""
    ends = [min(tokens, round(tokens * (g + 1) / groups / alignment) * alignment) for g in range(groups - 1)]
    return torch.tensor([*ends, tokens], dtype=dtype, device=device)


def token_count(a: torch.Tensor, b: torch.Tensor) -> int:
    """The extent the offsets split: a's rows in the forward form, b's rows (the reduction) in the
    weight-gradient form (2-D b)."""
    return b.shape[0] if b.dim() == 2 else a.shape[0]


def valid_offsets(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """`offs` itself when it holds cumulative group ends (non-decreasing, from 0 up to at most
    `tokens`), else an even split of `tokens` over its groups, on its device. Reads `offs` on the
    host: for benchmarking inputs only, never on a graph's path."""
    ends = offs.tolist()
    if all(0 <= lo <= hi for lo, hi in zip([0, *ends], ends)) and (not ends or ends[-1] <= tokens):
        return offs
    groups = len(ends)
    even = torch.arange(1, groups + 1, dtype=torch.int64) * tokens // max(groups, 1)
    return even.to(device=offs.device, dtype=offs.dtype)


def valid_rows(rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """`rows` itself when every index lies in [0, tokens), else seeded random indices there of its
    shape and dtype, on its device (the gathered kernel traps on an index outside). Reads `rows` on
    the host: for benchmarking inputs only, never on a graph's path."""
    if rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < tokens):
        return rows
    return random_rows(rows.numel(), tokens, rows.dtype, rows.device)


def random_rows(count: int, tokens: int, dtype, device) -> torch.Tensor:
    """`count` seeded row indices in [0, tokens): each routed row's token, for timing choices."""
    picks = torch.randint(max(tokens, 1), (count,), generator=torch.Generator().manual_seed(1))
    return picks.to(dtype=dtype, device=device)


ROUTED_OFFSETS_VERSION = 1  # in our choices' autotuning cache keys (extern.py): raise it when routed_offsets changes


def routed_offsets(even: torch.Tensor | None, alignment: int) -> torch.Tensor | None:
    """Offsets for timing choices, from the even split torch's lowering makes (its create_offsets:
    every group the same size, a multiple of `alignment` rows): the same groups and total with the
    spread a balanced router gives (each row's group drawn uniformly, seeded), the ends rounded to
    `alignment` as torch rounds them. An even split of whole tiles flatters every tiled kernel, ours
    most: it never meets a group's last, partial tile (grouped_routing.py measured our kernel ahead
    of eager on even splits and 5-25% behind it on routed ones)."""
    if even is None or even.numel() == 0:
        return even
    end, groups = int(even[-1]), even.numel()
    picks = torch.randint(groups, (max(end, 0),), generator=torch.Generator().manual_seed(0))
    ends = torch.bincount(picks, minlength=groups).cumsum(0).to(torch.float64)
    ends[:-1] = ((ends[:-1] / alignment).round() * alignment).clamp(max=end)
    ends[-1] = end
    return ends.to(dtype=even.dtype, device=even.device)
