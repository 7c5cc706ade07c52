"""The GEMM configurations worth timing for one problem (autotuning), DSL-free."""

from __future__ import annotations

import dataclasses
import itertools

from .config import GemmConfig, GemmProblem, config_error, default_config

MAX_STAGES = 8


def _deepest(cfg: GemmConfig, p: GemmProblem) -> GemmConfig | None:
    """`cfg` with the most pipeline stages (<= MAX_STAGES) that fit, or None if none does."""
    for stages in range(MAX_STAGES, 1, -1):
        candidate = dataclasses.replace(cfg, stages=stages)
        if config_error(candidate, p) is None:
            return candidate
    return None


def _tiles(m: int, n: int, tile_m: int, tile_n: int, batch: int) -> int:
    return -(-m // tile_m) * -(-n // tile_n) * batch


def candidate_configs(m: int, n: int, problem: GemmProblem, batch: int = 1, num_sms: int = 132,
                      exhaustive: bool = False) -> list[GemmConfig]:
    """Valid configs for an (m, n) output: the heuristic default first, then alternates.

    The small set varies what the heuristic cannot predict (tile shape against wave
    quantization, cluster orientation, persistence); `exhaustive` walks the whole space."""
    if exhaustive:
        shapes = [(tm, tn, wg) for tm in (64, 128, 256) for tn in (32, 64, 96, 128, 192, 256)
                  for wg in (1, 2) if tm % (64 * wg) == 0]
        clusters = [(1, 1), (2, 1), (1, 2)]
        persistence = (True, False)
    elif m <= 64:
        shapes, clusters, persistence = [(64, 256, 1), (64, 128, 1), (64, 64, 1), (64, 32, 1)], [(1, 1)], (False,)
    elif m <= 128:
        shapes = [(128, 128, 2), (128, 64, 2), (128, 32, 2), (64, 128, 1)]
        clusters, persistence = [(1, 1)], (False,)
    else:
        shapes = [(128, 256, 2), (256, 128, 2), (128, 192, 2), (128, 128, 2)]
        clusters, persistence = [(2, 1), (1, 2)], (True,)
    out = [default_config(m, n, problem, batch, num_sms)]
    for (tm, tn, wg), (cm, cn), persistent in itertools.product(shapes, clusters, persistence):
        if cm * cn > 1 and _tiles(m, n, tm, tn, batch) < 2 * num_sms:
            cm = cn = 1  # clusters pay off only with several waves of tiles
        cfg = _deepest(GemmConfig(tm, tn, 64, cm, cn, MAX_STAGES, wg, persistent), problem)
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out
