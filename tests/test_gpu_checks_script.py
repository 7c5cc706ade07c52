"""benchmarks/gpu_checks.sh's two-call run of the whole GPU tier covers every GPU test file once."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _files_of_step(script: str, step: str) -> list[str]:
    body = re.search(rf"^\s*{step}\) step .*?;;", script, re.M | re.S).group(0)
    patterns = re.findall(r"tests/gpu/\S+", body.replace(";;", ""))
    # bash expands the brace lists exactly as the script's own run does
    expanded = subprocess.run(["bash", "-c", "echo " + " ".join(patterns)], capture_output=True, text=True, check=True)
    return [Path(p).name for p in expanded.stdout.split()]


def test_all_kernels_and_all_compiled_split_the_gpu_tier_without_gaps_or_overlap():
    script = (ROOT / "benchmarks" / "gpu_checks.sh").read_text()
    kernels, compiled = _files_of_step(script, "all_kernels"), _files_of_step(script, "all_compiled")
    assert not set(kernels) & set(compiled)
    assert len(kernels + compiled) == len(set(kernels + compiled))
    on_disk = {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert set(kernels) | set(compiled) == on_disk
