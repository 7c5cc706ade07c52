"""The Hopper GEMM compiled for sm_90a on the CPU: every schedule class and layout, checked in PTX
and in ptxas's resource report."""

import re

import pytest

from inductor_cute.kernels.gemm.config import (GemmConfig, GemmProblem, default_config, smem_bytes, spec,
                                               unsupported_reason)
from inductor_cute.runtime.compiler import compile_spec

BF16 = GemmProblem("bfloat16", "bfloat16", "k", "k")
SMALL = GemmConfig(128, 128, 64, 1, 1, 3, 2, False)

VARIANTS = {
    "large-persistent-cluster2x1": (BF16, default_config(BF16, 8192, 8192, 8192)),
    "small-m-one-warpgroup": (BF16, default_config(BF16, 16, 4096, 4096)),
    "a-col-major-b-n-major": (GemmProblem("bfloat16", "bfloat16", "m", "n"), SMALL),
    "a-row-major-b-n-major": (GemmProblem("float16", "float16", "k", "n"), SMALL),
    "a-col-major-b-k-major": (GemmProblem("float16", "float32", "m", "k"), SMALL),
    "bias-residual-gelu": (GemmProblem("bfloat16", "bfloat16", "k", "k", True, True, "gelu_tanh"), SMALL),
    "pingpong-cluster2x1": (BF16, GemmConfig(128, 128, 64, 2, 1, 6, 2, True, True)),
    "pingpong-64x256": (BF16, GemmConfig(64, 256, 64, 1, 1, 5, 2, True, True)),
    "pingpong-fp16-fp32-out-a-col-major-b-n-major": (GemmProblem("float16", "float32", "m", "n"),
                                                     GemmConfig(128, 128, 64, 1, 1, 5, 2, True, True)),
    "pingpong-bias-residual-gelu": (GemmProblem("bfloat16", "bfloat16", "k", "k", True, True, "gelu_tanh"),
                                    GemmConfig(128, 128, 64, 1, 1, 5, 2, True, True)),
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


def test_ptxas_reports_no_spills_and_no_stack(compiled):
    report = compiled.ptxas_report
    assert report and "Used" in report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "wgmma.mma_async instructions are serialized" not in report  # C7512/C7519: no overlap left


def test_cluster_variant_multicasts():
    problem, config = VARIANTS["large-persistent-cluster2x1"]
    assert config.cluster_m == 2
    ptx = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True).ptx
    assert ".multicast::cluster" in ptx


def test_pingpong_warp_groups_hand_turns_over():
    problem, config = VARIANTS["pingpong-bias-residual-gelu"]
    ptx = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True).ptx
    # slot 1 hands slot 0 its first mainloop (barrier 3) and epilogue (barrier 5) turns
    assert re.search(r"bar\.arrive\s+3, 256;", ptx) and re.search(r"bar\.arrive\s+5, 256;", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_default_configs_fit_and_follow_the_shape():
    big, small = default_config(BF16, 8192, 8192, 8192), default_config(BF16, 16, 4096, 4096)
    assert (big.tile_m, big.tile_n, big.persistent) == (128, 256, True)
    assert small.tile_m == 64 and small.consumer_warpgroups == 1
    for cfg in (big, small):
        assert unsupported_reason(BF16, cfg) is None
        assert smem_bytes(cfg, 2, 2, False) <= 227 * 1024


def test_invalid_configs_are_named():
    assert "shared memory" in unsupported_reason(BF16, GemmConfig(128, 256, 128, 1, 1, 8, 2, True))
    assert "tile_m" in unsupported_reason(BF16, GemmConfig(96, 128, 64, 1, 1, 4, 2, True))
    assert "cluster" in unsupported_reason(BF16, GemmConfig(128, 128, 64, 4, 4, 4, 2, True))


def test_invalid_pingpong_configs_are_named():
    assert "consumer_warpgroups=2" in unsupported_reason(BF16, GemmConfig(128, 128, 64, 1, 1, 4, 1, True, True))
    assert "persistent" in unsupported_reason(BF16, GemmConfig(128, 128, 64, 1, 1, 4, 2, False, True))
    assert "tile_m" in unsupported_reason(BF16, GemmConfig(256, 64, 64, 1, 1, 4, 2, True, True))
    assert "accumulator" in unsupported_reason(BF16, GemmConfig(128, 256, 64, 1, 1, 3, 2, True, True))
    # each ping-pong warp group stages its own D subtiles: twice what one 64-row warp group needs
    fp32_out = GemmProblem("bfloat16", "float32", "k", "k")
    assert unsupported_reason(fp32_out, GemmConfig(64, 256, 64, 1, 1, 5, 1, True)) is None
    assert "shared memory" in unsupported_reason(fp32_out, GemmConfig(64, 256, 64, 1, 1, 5, 2, True, True))
    for tile in ((128, 128), (64, 256), (64, 192), (128, 96), (64, 128)):
        assert unsupported_reason(BF16, GemmConfig(*tile, 64, 1, 1, 4, 2, True, True)) is None
    fp32_residual = GemmProblem("float16", "float32", "m", "n", has_c=True)
    assert "fp32 C operand" in unsupported_reason(fp32_residual, GemmConfig(128, 96, 64, 1, 1, 4, 2, True, True))


def test_pingpong_is_part_of_the_kernel_spec():
    plain, pingpong = GemmConfig(128, 128, 64, 1, 1, 4, 2, True), GemmConfig(128, 128, 64, 1, 1, 4, 2, True, True)
    assert spec(BF16, plain).name != spec(BF16, pingpong).name


def test_mm_refuses_cpu_tensors():
    import torch

    from inductor_cute import UnsupportedError, ops

    with pytest.raises(UnsupportedError, match="^mm: tensors must be on a CUDA device, got cpu$"):
        ops.mm(torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16))
