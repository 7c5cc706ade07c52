"""The grouped GEMM (MoE, torch._grouped_mm forward) compiled for sm_90a on the CPU: WGMMA and TMA
in the PTX, no spills, WGMMAs not serialized, shared memory within budget; and its config rules."""

import re

import pytest

from inductor_cute.kernels.gemm.config import SMEM_BUDGET
from inductor_cute.kernels.gemm.grouped_config import (MAX_GROUPS, GroupedConfig, GroupedProblem, candidates,
                                                       default_config, smem_bytes, spec, unsupported_reason)
from inductor_cute.runtime.compiler import compile_spec

K_MAJOR = GroupedProblem("bfloat16", "bfloat16", "k", "k")
N_MAJOR = GroupedProblem("bfloat16", "bfloat16", "k", "n")

VARIANTS = {
    "deepseek-like-default": (K_MAJOR, default_config(K_MAJOR, 8192, 4096, 7168, groups=32)),
    "b-n-major-128x128": (N_MAJOR, GroupedConfig(128, 128, 64, 6, 2)),
    "small-groups-64x256-one-warpgroup": (K_MAJOR, default_config(K_MAJOR, 2048, 1536, 2048, groups=128)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def compiled(request):
    problem, config = VARIANTS[request.param]
    return compile_spec(spec(problem, config), "sm_90a", keep_ptx=True)


def test_uses_wgmma_tma_and_register_reallocation(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "shfl.sync.up" in ptx  # the scan of the group tile counts


def test_ptxas_reports_no_spills_and_no_serialized_wgmma(compiled):
    report = compiled.ptxas_report
    assert report and "Used" in report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "C7519" not in report  # "wgmma.mma_async instructions are serialized"


def test_variants_fit_shared_memory():
    for problem, config in VARIANTS.values():
        assert unsupported_reason(problem, config) is None
        assert smem_bytes(config) <= SMEM_BUDGET


def test_default_config_follows_group_sizes():
    assert default_config(K_MAJOR, 8192, 4096, 7168, groups=32).tile_m == 128
    small = default_config(K_MAJOR, 2048, 1536, 2048, groups=128)
    assert (small.tile_m, small.consumer_warpgroups) == (64, 1)
    cands = candidates(K_MAJOR, 16384, 1536, 2048, groups=128)
    assert cands[0] == default_config(K_MAJOR, 16384, 1536, 2048, groups=128)
    assert len(set(cands)) == len(cands) and all(unsupported_reason(K_MAJOR, c) is None for c in cands)


def test_unsupported_inputs_are_named():
    assert "bfloat16" in unsupported_reason(GroupedProblem("float16", "float16"))
    assert "row-major" in unsupported_reason(GroupedProblem(a_major="m"))
    assert "multiple of 8" in unsupported_reason(K_MAJOR, n=100)
    assert "multiple of 8" in unsupported_reason(K_MAJOR, k=12)
    assert str(MAX_GROUPS) in unsupported_reason(K_MAJOR, groups=MAX_GROUPS + 1)
    assert "shared memory" in unsupported_reason(K_MAJOR, GroupedConfig(128, 256, 128, 4, 2))
    assert "accumulator" in unsupported_reason(K_MAJOR, GroupedConfig(128, 256, 64, 3, 1))
    assert unsupported_reason(K_MAJOR, n=4096, k=7168, groups=256) is None


def test_layout_is_part_of_the_kernel_spec():
    cfg = GroupedConfig(128, 128, 64, 6, 2)
    assert spec(K_MAJOR, cfg).name != spec(N_MAJOR, cfg).name

