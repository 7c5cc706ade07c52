"""Bad input to the public API: one clear line, never a traceback from inside the DSL."""

import subprocess
import sys

import pytest
import torch

from inductor_cute import DSLUnavailableError, UnsupportedError, ops


def test_cpu_tensors_are_refused():
    x = torch.randn(4, 64)
    with pytest.raises(UnsupportedError, match="^rmsnorm: tensors must be on a CUDA device, got cpu$"):
        ops.rmsnorm(x, torch.randn(64))


def test_non_tensor_is_refused():
    with pytest.raises(UnsupportedError, match="expected torch.Tensor"):
        ops.rmsnorm([1.0, 2.0], torch.randn(2))


def test_unsupported_sizes_and_dtypes_are_named():
    from inductor_cute.kernels.norm import rmsnorm_config

    assert "dtype" in rmsnorm_config.unsupported_reason(4096, "int32")
    assert rmsnorm_config.unsupported_reason(4096, "bfloat16") is None
    assert rmsnorm_config.unsupported_reason(rmsnorm_config.MAX_N * 2, "bfloat16")


def test_missing_dsl_is_one_clear_line():
    code = (
        "import sys; sys.modules['cutlass'] = None\n"
        "from inductor_cute.runtime.dsl import import_cute\n"
        "from inductor_cute import DSLUnavailableError\n"
        "try:\n    import_cute('sm_90a')\n"
        "except DSLUnavailableError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("the CuTe DSL is not usable") and "pip install" in line and "\n" not in line
    assert issubclass(DSLUnavailableError, ImportError)
