"""Configs by M range for a GEMM whose M is dynamic: one compiled kernel per range, picked at run time.

Our kernels take M as a runtime size, so one config serves any M, but a tile tuned for 4096 rows
wastes most of its work on one row (and the GEMV serves only M <= 16). For a symbolic M we offer
a table instead: (M upper bound, config) buckets, each config the heuristic's
(family.default_config) for the bucket's upper bound and the static N, K, so every config is one
the eager path would run at that M. Adjacent buckets with the same config merge.

In output code a table is plain values, as family.as_tuple spells one config:

    ("m_buckets", (8, ("gemv", 8, 512, 8, 1)), (64, (64, 256, 64, ...)), ..., (None, (128, 256, ...)))

the last bound None (any larger M). DSL-free; imports nothing of torch.
"""

from __future__ import annotations

import bisect
import functools

from ...kernels.gemm import family
from ...kernels.gemm.config import SM_COUNT, GemmConfig, GemmProblem
from ...kernels.gemm.gemv_config import GemvConfig

TABLE_TAG = "m_buckets"
# Upper bounds of the M ranges: 8 and 16 are the GEMV's (one or two 8-row tiles), 64 the small
# tile's, then the tile counts that change the heuristic's pick on Hopper-sized N.
M_BOUNDS = (8, 16, 64, 128, 256, 512, 1024, 2048)
LARGEST_M = 8192  # the M the last (unbounded) bucket's config is picked for


def bucket_configs(problem: GemmProblem, n: int, k: int, batch: int = 1,
                   num_sms: int = SM_COUNT) -> tuple[tuple[int | None, GemmConfig | GemvConfig], ...]:
    """((M upper bound, config), ...) covering every M, the last bound None; the GEMV serves the
    first buckets where the problem allows it (K-major B, one matrix, a K it can split)."""
    table: list[tuple[int | None, GemmConfig | GemvConfig]] = []
    for bound, m in [*((b, b) for b in M_BOUNDS), (None, LARGEST_M)]:
        cfg = family.default_config(problem, m, n, k, batch, num_sms)
        if table and table[-1][1] == cfg:
            table[-1] = (bound, cfg)  # the larger range keeps the same kernel
        else:
            table.append((bound, cfg))
    return tuple(table)


def as_table_tuple(table) -> tuple:
    """A bucket table as plain values, for generated code (and back with `MBuckets.from_tuple`)."""
    return (TABLE_TAG, *((bound, family.as_tuple(cfg)) for bound, cfg in table))


def is_table(values: tuple) -> bool:
    return bool(values) and values[0] == TABLE_TAG


def describe(table) -> str:
    parts = [f"M<={bound}: {cfg.describe()}" if bound is not None else f"larger: {cfg.describe()}"
             for bound, cfg in table]
    return f"m_buckets({'; '.join(parts)})"


class MBuckets:
    """A table's configs and bounds, for picking at run time: `pick(m)` is one bisect of a tuple."""

    __slots__ = ("bounds", "configs")

    def __init__(self, bounds: tuple[int, ...], configs: tuple) -> None:
        self.bounds, self.configs = bounds, configs  # len(configs) == len(bounds) + 1

    @classmethod
    def from_tuple(cls, values: tuple) -> "MBuckets":
        rows = values[1:]
        assert rows and rows[-1][0] is None and all(b is not None for b, _ in rows[:-1]), values
        return cls(tuple(b for b, _ in rows[:-1]), tuple(family.from_tuple(c) for _, c in rows))

    def pick(self, m: int) -> GemmConfig | GemvConfig:
        return self.configs[bisect.bisect_left(self.bounds, m)]


def configs_of(values: tuple) -> list[GemmConfig | GemvConfig]:
    """Every config a launcher of `values` (one config's tuple or a table's) may run."""
    return list(table_of(values).configs) if is_table(values) else [family.from_tuple(values)]


def with_configs(values: tuple, configs: list) -> tuple:
    """`values` (one config's tuple or a table's) with its configs replaced by `configs`, in
    configs_of's order."""
    if not is_table(values):
        (config,) = configs
        return family.as_tuple(config)
    return (TABLE_TAG, *((bound, family.as_tuple(cfg)) for (bound, _), cfg in zip(values[1:], configs, strict=True)))


@functools.lru_cache(maxsize=None)
def table_of(values: tuple) -> MBuckets:
    return MBuckets.from_tuple(values)
