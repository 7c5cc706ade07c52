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


class KernelRecorder:
    """Stands in for every GEMM kernel: records (KernelSpec, arguments) of each launch."""

    def __init__(self):
        self.launches = []

    def kernel_for(self, spec):
        return lambda *args: self.launches.append((spec, args))

    @property
    def args(self):
        """The arguments of the last launch."""
        return self.launches[-1][1]


@pytest.fixture
def cpu_gemm_kernels(monkeypatch):
    """Our GEMM entry points on CPU tensors: device checks passed, 132 SMs, and every kernel a
    KernelRecorder; remembered kernels, fast paths and launchers are forgotten before and after."""
    from inductor_cute.host import gemm as host_gemm
    from inductor_cute.inductor.gemm import runtime

    def forget():
        host_gemm._gemm_kernel.cache_clear()
        host_gemm._FAST_PATHS.clear()
        runtime._LAUNCHERS.clear()

    recorder = KernelRecorder()
    monkeypatch.setattr(host_gemm, "check_cuda", lambda *tensors: None)
    monkeypatch.setattr(host_gemm, "sm_count", lambda index: 132)
    monkeypatch.setattr(host_gemm, "get_kernel", recorder.kernel_for)
    forget()
    yield recorder
    forget()
