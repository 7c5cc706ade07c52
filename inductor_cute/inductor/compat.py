"""The differences between the torch versions we run on (2.11 on the GPU machine, 2.13 in CI) that
the Inductor integration touches, each behind one function."""

from __future__ import annotations


def feedback_savers() -> list:
    """The list that holds the functions `select_algorithm.add_feedback_saver` registered (the
    public add has no matching remove). 2.13 reaches the autotuning cache through
    `get_algorithm_selector_cache()`; older versions keep it in a module global, None until the
    first autotuning or saver."""
    from torch._inductor import select_algorithm

    if hasattr(select_algorithm, "get_algorithm_selector_cache"):
        cache = select_algorithm.get_algorithm_selector_cache()
    else:
        cache = getattr(select_algorithm, "_ALGORITHM_SELECTOR_CACHE", None)
    return cache.feedback_saver_fns if cache is not None else []
