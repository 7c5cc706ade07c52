"""A compiled kernel's SASS, from nvdisasm (the nvidia-cuda-nvdisasm wheel, a test extra): what
ptxas made of the PTX where the PTX cannot tell, such as where it issued a wait."""

import importlib.util
import subprocess
from pathlib import Path

import pytest


def nvdisasm() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root).glob("cu*/bin/nvdisasm"))
        if found:
            return found[-1]
    return None


def sass(compiled, tmp_path: Path) -> str:
    """The SASS of `compiled` (compile_spec's result); skips the test without nvdisasm."""
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    blob = compiled.object_bytes
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(blob[blob.index(b"\x7fELF", 1):])  # the device image follows the host object's header
    return subprocess.run([str(tool), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
