import pytest

from inductor_cute import UnsupportedError
from inductor_cute.runtime import arch


def test_env_override_selects_target(monkeypatch):
    monkeypatch.setenv(arch.ARCH_ENV, "sm_90a")
    assert arch.target_arch().name == "sm_90a"


def test_unknown_target_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(arch.ARCH_ENV, "sm_80")
    with pytest.raises(UnsupportedError, match="no inductor-cute kernels for target 'sm_80'"):
        arch.target_arch()


def test_default_without_gpu_is_hopper_not_blackwell(monkeypatch):
    import torch

    monkeypatch.delenv(arch.ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert arch.target_arch().name == "sm_90a"
    assert arch.sm_count(arch.target_arch()) == 132


def test_pre_hopper_gpu_is_refused_by_name(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(UnsupportedError) as e:
        arch.device_arch()
    assert str(e.value) == "inductor-cute needs an NVIDIA Hopper GPU (sm_90); found NVIDIA A100 (sm_80)"
