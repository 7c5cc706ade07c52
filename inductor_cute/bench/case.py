"""One benchmark case: what it computes (flops, bytes), the backends that run it, notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Case:
    name: str
    params: dict
    flops: float
    bytes: float
    # backend -> zero-argument callable returning the output: a tensor, or a tuple of tensors
    # (e.g. an attention's gradients) checked one by one
    runners: dict[str, Callable | None]
    notes: list[str] = field(default_factory=list)
    matmul: bool = False  # whether `flops` run on the tensor cores and count toward the bound
    atol: float = 2e-2
    rtol: float = 2e-2
    # atol as a fraction of each reference tensor's largest magnitude: for outputs (gradients)
    # whose scales differ by orders, so one tolerance suits them all
    atol_of_max: bool = False
    # Times the case measured itself (wall time per call, as whole-model suites need); the harness
    # then only runs each backend once for its output.
    wall_times_us: dict[str, float] | None = None
    # An untimed zero-argument callable whose output every runner's is checked against (an fp32
    # reference); without one, runners are checked against aten's output.
    reference: Callable | None = None


def named(factory: Callable, name: str) -> Callable:
    """A case factory carrying its case's name, so that a run filtered by name (`--match`) skips
    it without building it (building may compile and autotune)."""
    factory.case_name = name
    return factory
