"""benchmarks/gpu_checks.sh's three-call run of the whole GPU tier covers every GPU test file once."""

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


def test_the_three_calls_split_the_gpu_tier_without_gaps_or_overlap():
    script = (ROOT / "benchmarks" / "gpu_checks.sh").read_text()
    files = [f for step in ("all_kernels", "all_grouped", "all_compiled") for f in _files_of_step(script, step)]
    assert len(files) == len(set(files))  # no file in two calls
    assert set(files) == {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
