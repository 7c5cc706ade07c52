import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Every test compiles into a private cache, never the user's; shared within the session."""
    root = tmp_path_factory.mktemp("kernel-cache")
    old = os.environ.get("INDUCTOR_CUTE_CACHE_DIR")
    os.environ["INDUCTOR_CUTE_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("INDUCTOR_CUTE_CACHE_DIR", None)
    else:
        os.environ["INDUCTOR_CUTE_CACHE_DIR"] = old


def _hopper_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _hopper_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
