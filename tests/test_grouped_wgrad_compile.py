"""The grouped GEMM's weight-gradient form (MoE backward) compiled for sm_90a on the CPU: WGMMA and
TMA in the PTX, the boundary k-block's shared-memory mask, no spills, WGMMAs not serialized; and
its config rules. GPU runs: tests/gpu/test_grouped_wgrad_gpu.py."""

import dataclasses
import re

import pytest

from inductor_cute.kernels.gemm.config import SMEM_BUDGET
from inductor_cute.kernels.gemm.grouped_config import MAX_GROUPS, GroupedConfig, smem_bytes
from inductor_cute.kernels.gemm.grouped_wgrad_config import (WgradProblem, candidates, default_config, spec,
                                                             unsupported_reason, work_units)
from inductor_cute.runtime.compiler import compile_spec

AUTOGRAD = WgradProblem("bfloat16", "bfloat16", "m", "n")  # a = grad.t(), b = x
TOKEN_MAJOR = WgradProblem("bfloat16", "bfloat16", "k", "k")

VARIANTS = {
    "autograd-layout-default": (AUTOGRAD, default_config(AUTOGRAD, 7168, 4096, 8192, groups=32)),
    "token-major-64x128-one-warpgroup": (TOKEN_MAJOR, GroupedConfig(64, 128, 64, 8, 1)),
    "autograd-layout-whole-tile-store": (AUTOGRAD, GroupedConfig(128, 256, 64, 3, 2, store_whole_tile=True)),
    "autograd-layout-cluster-2x1": (AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)),
    "token-major-cluster-1x2-whole-tile-store": (TOKEN_MAJOR, GroupedConfig(128, 128, 64, 5, 2, cluster_n=2,
                                                                           store_whole_tile=True)),
    "autograd-layout-pingpong": (AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, pingpong=True)),
    "autograd-layout-pingpong-cluster-2x1": (AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, cluster_m=2, pingpong=True)),
    "token-major-pingpong-cluster-2x2": (TOKEN_MAJOR, GroupedConfig(128, 128, 64, 6, 2, 2, 2, pingpong=True)),
    "token-major-pingpong-whole-tile-store": (TOKEN_MAJOR, GroupedConfig(128, 128, 64, 5, 2, store_whole_tile=True,
                                                                         pingpong=True)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def compiled(request):
    problem, config = VARIANTS[request.param]
    result = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True)
    result.problem, result.config = problem, config
    return result


def test_uses_wgmma_tma_and_the_boundary_mask(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # the mask's writes, before the WGMMA reads them
    # zeros into the A and B stages (both ends of a group): 16-byte stores where tokens are not
    # contiguous, else 2-byte
    vector_zeros = len(re.findall(r"st\.shared\.v4\.b32\s+\[[^\]]+\], \{0, 0, 0, 0\}", ptx))
    scalar_zeros = len(re.findall(r"st\.shared\.b16\s+\[[^\]]+\], 0x0000", ptx))
    mn_major = [compiled.problem.a_major == "m", compiled.problem.b_major == "n"]
    assert (vector_zeros > 0, scalar_zeros > 0) == (any(mn_major), not all(mn_major))


def test_ptxas_reports_no_spills_and_no_serialized_wgmma(compiled):
    report = compiled.ptxas_report
    assert report and "Used" in report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "wgmma.mma_async instructions are serialized" not in report  # C7512 or C7519


def test_the_whole_tile_store_commits_one_group_of_stores_a_tile(compiled):
    # every subtile staged, then all of them stored at once: one commit and two epilogue barriers a
    # tile, where the subtile buffers take a commit and two barriers a subtile
    ptx = compiled.ptx
    stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx))
    commits = len(re.findall(r"cp\.async\.bulk\.commit_group", ptx))
    barriers = len(re.findall(r"bar\.sync", ptx))  # call sites (the epilogue's loop is unrolled)
    config = compiled.config
    tile_wgs = 1 if config.pingpong else config.consumer_warpgroups
    subtiles = config.tile_m // (64 * tile_wgs) * (config.tile_n // 32)
    whole = config.store_whole_tile
    # (whole: the epilogue's two, the boundary mask's and the group table's, whatever the tile; and
    # ping-pong's waits for its mainloop turn and, whole, for the shared buffer's)
    turns = config.pingpong * (1 + whole)
    assert stores > 1 and (commits == 1, barriers <= 4 + turns) == (whole, whole)
    if whole:  # after the commit: the tail's wait for the stores' reads, and ping-pong's before it hands
        # the shared buffer over (its wait moved there from before the next tile's epilogue)
        after = ptx[ptx.index("cp.async.bulk.commit_group"):]
        assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read", after)) == 1 + config.pingpong
    assert whole or barriers >= 2 * subtiles


def test_clusters_multicast_the_shared_operand_and_release_their_peers_stages(compiled):
    ptx = compiled.ptx
    loads = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared\S*global\S*", ptx)
    multicast = [op for op in loads if "multicast::cluster" in op]
    if compiled.config.cluster_size == 1:
        assert not multicast and "barrier.cluster" not in ptx
        return
    # one operand's loads multicast, the other's plain (2x2: both multicast); peers meet before
    # either signals the other
    both = compiled.config.cluster_m > 1 and compiled.config.cluster_n > 1
    assert multicast and (len(multicast) == len(loads)) == both
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert re.search(r"mbarrier\.arrive\S*shared::cluster", ptx)  # a release to the peer CTA


def test_pingpong_takes_turns_and_each_warp_group_multiplies_a_whole_tile(compiled):
    ptx = compiled.ptx
    # a turn is handed over by a plain arrive (the other warp group waits on it); cooperative has none
    assert ("bar.arrive" in ptx) == compiled.config.pingpong
    # 64-row WGMMAs over 16-deep k-steps: one warp group covers a 128-row tile in two, cooperative
    # warp groups cover 64 rows each in one
    config = compiled.config
    rows_per_wg = config.tile_m if config.pingpong else config.tile_m // config.consumer_warpgroups
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == rows_per_wg // 64 * config.tile_k // 16


def test_pingpong_rules_and_candidates(monkeypatch):
    from inductor_cute.kernels.gemm import grouped_wgrad_config
    from inductor_cute.kernels.gemm.grouped_config import GroupedProblem
    from inductor_cute.kernels.gemm.grouped_config import unsupported_reason as forward_reason

    assert unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, pingpong=True)) is None
    for bad in (GroupedConfig(128, 256, 64, 4, 2, pingpong=True),  # 256 accumulator registers a thread
                GroupedConfig(64, 128, 64, 8, 1, pingpong=True),
                GroupedConfig(128, 128, 128, 3, 2, pingpong=True)):
        assert "pingpong takes 128x128x64" in unsupported_reason(AUTOGRAD, bad)
    assert unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, cluster_n=2, pingpong=True)) is None
    assert "weight gradient's" in forward_reason(GroupedProblem(), GroupedConfig(128, 128, 64, 6, 2, pingpong=True))
    # the whole-tile store: one tile's buffer, shared in turn, so as many ring stages as cooperative;
    # asked for (pingpong=True) or once GPU-checked
    whole = GroupedConfig(128, 128, 64, 5, 2, store_whole_tile=True, pingpong=True)
    assert unsupported_reason(AUTOGRAD, whole) is None
    assert smem_bytes(whole, tables=1) == smem_bytes(dataclasses.replace(whole, pingpong=False), tables=1)
    assert unsupported_reason(AUTOGRAD, dataclasses.replace(whole, stages=6)) is not None
    asked = [c for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128, pingpong=True) if c.pingpong]
    assert asked == [GroupedConfig(128, 128, 64, 6, 2, pingpong=True), whole]
    offered = [c for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128) if c.pingpong]
    assert offered == asked[:1]
    monkeypatch.setattr(grouped_wgrad_config, "PINGPONG_WHOLE_TILE_OFFERED", True)
    assert [c for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128) if c.pingpong] == asked
    monkeypatch.setattr(grouped_wgrad_config, "PINGPONG_WHOLE_TILE_OFFERED", False)
    assert "pingpong" not in GroupedConfig().as_params() and "pingpong" in offered[0].describe()
    monkeypatch.setattr(grouped_wgrad_config, "PINGPONG_GPU_CHECKED", False)
    assert not any(c.pingpong for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128))
    monkeypatch.setattr(grouped_wgrad_config, "PINGPONG_GPU_CHECKED", True)
    # in clusters once those are GPU-checked (or asked for)
    monkeypatch.setattr(grouped_wgrad_config, "PINGPONG_CLUSTERS_OFFERED", True)
    shapes = [(c.cluster_m, c.cluster_n) for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128) if c.pingpong]
    assert shapes == [(1, 1), (2, 1), (1, 2), (2, 2)]
    narrow = [(c.cluster_m, c.cluster_n) for c in candidates(AUTOGRAD, 128, 2048, 32768, groups=128) if c.pingpong]
    assert narrow == [(1, 1), (1, 2)]  # M of one row tile: no 2x1, no 2x2
    assert "ping-pong's" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, 2, 2))
    assert "2x2" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 64, 6, 2, 4, 1, pingpong=True))
    assert [c for c in candidates(AUTOGRAD, 1536, 2048, 32768, groups=128, clusters=False) if c.pingpong] == offered


def test_variants_fit_shared_memory():
    for problem, config in VARIANTS.values():
        assert unsupported_reason(problem, config) is None
        assert smem_bytes(config, tables=1) <= smem_bytes(config) <= SMEM_BUDGET


def test_default_config_gives_every_sm_a_unit():
    big = default_config(AUTOGRAD, 7168, 4096, 8192, groups=32)
    assert (big.tile_m, big.tile_n, big.consumer_warpgroups) == (128, 256, 2)
    small = default_config(AUTOGRAD, 256, 128, 100, groups=2)  # 2 groups of one 128x128 tile at most
    assert work_units(256, 128, 2, small.tile_m, small.tile_n) >= work_units(256, 128, 2, 128, 128)
    cands = candidates(AUTOGRAD, 2048, 1536, 16384, groups=128)
    assert cands[0] == default_config(AUTOGRAD, 2048, 1536, 16384, groups=128)
    assert len(set(cands)) == len(cands) and all(unsupported_reason(AUTOGRAD, c) is None for c in cands)
    assert any(c.tile_k == 128 for c in candidates(AUTOGRAD, 2048, 1536, groups=128, exhaustive=True))


def test_work_units_count_empty_groups():
    assert work_units(200, 300, 3, 128, 256) == 3 * 2 * 2


def test_unsupported_inputs_are_named():
    assert "bfloat16" in unsupported_reason(WgradProblem("float16", "float16"))
    assert "a_major" in unsupported_reason(WgradProblem(a_major="n"))
    assert "M=100" in unsupported_reason(AUTOGRAD, m=100)
    assert "N=12" in unsupported_reason(AUTOGRAD, n=12)
    assert str(MAX_GROUPS) in unsupported_reason(AUTOGRAD, groups=MAX_GROUPS + 1)
    assert "shared memory" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 128, 4, 2))
    assert unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)) is None
    assert "cluster" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, cluster_n=2))
    assert "overlap_last" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, overlap_last=True))
    assert "staged_partial" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, staged_partial=True))
    assert unsupported_reason(AUTOGRAD, m=7168, n=4096, groups=256) is None


def test_layout_is_part_of_the_kernel_spec():
    cfg = GroupedConfig(128, 128, 64, 6, 2)
    assert spec(AUTOGRAD, cfg).name != spec(TOKEN_MAJOR, cfg).name
    assert spec(AUTOGRAD, cfg).module.endswith("grouped_wgrad_sm90")


def test_the_whole_tile_store_is_the_weight_gradients_and_must_fit():
    whole = GroupedConfig(128, 256, 64, 3, 2, store_whole_tile=True)
    assert unsupported_reason(AUTOGRAD, whole) is None
    assert smem_bytes(whole, tables=1) - smem_bytes(GroupedConfig(128, 256, 64, 3, 2), tables=1) == 128 * 256 * 2 - \
        2 * 128 * 32 * 2  # the whole tile where two subtiles were
    assert "shared memory" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 256, 64, 4, 2, store_whole_tile=True))
    assert "tile_k 64" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 128, 2, 2, store_whole_tile=True))
    from inductor_cute.kernels.gemm.grouped_config import GroupedProblem
    from inductor_cute.kernels.gemm.grouped_config import unsupported_reason as forward_reason
    assert "weight gradient" in forward_reason(GroupedProblem(), whole)
    assert "whole-tile-store" in whole.describe() and whole.as_params()["store_whole_tile"] is True
    assert "store_whole_tile" not in GroupedConfig(128, 256, 64, 3, 2).as_params()  # older specs keep their keys


def test_the_whole_tile_store_is_offered_only_in_its_gpu_checked_forms():
    for exhaustive in (False, True):
        offered = candidates(AUTOGRAD, 2048, 1536, 32768, groups=128, exhaustive=exhaustive)
        whole = [c for c in offered if c.store_whole_tile]
        assert whole and len(whole) < len(offered)
        assert all(c.tile_m == 128 and c.tile_k == 64 for c in whole)
        # each is the twin of an offered config that stores by subtiles
        assert all(any(o.tile_m == c.tile_m and o.tile_n == c.tile_n and o.tile_k == c.tile_k
                       and not o.store_whole_tile for o in offered) for c in whole)


def test_clusters_are_offered_once_gpu_checked(monkeypatch):
    from inductor_cute.kernels.gemm import grouped_wgrad_config

    def clustered(**kw):  # cooperative ones (ping-pong's have their own flag)
        return [c for c in candidates(AUTOGRAD, 2048, 1536, 32768, groups=128, **kw)
                if c.cluster_size > 1 and not c.pingpong]

    assert clustered(clusters=False) == []
    offered = clustered(clusters=True)
    assert {(c.cluster_m, c.cluster_n) for c in offered} == {(2, 1), (1, 2)}
    assert all(c.tile_m == 128 and c.tile_k == 64 and unsupported_reason(AUTOGRAD, c) is None for c in offered)
    # a cluster only where both of its tiles can hold output: M of one row tile gets no 2x1
    narrow = [c for c in candidates(AUTOGRAD, 128, 1536, 32768, groups=128, clusters=True) if c.cluster_size > 1]
    assert narrow and all((c.cluster_m, c.cluster_n) == (1, 2) for c in narrow)
    assert "128-row tiles" in unsupported_reason(AUTOGRAD, GroupedConfig(64, 256, 64, 4, 1, cluster_m=2))
    assert "128-row tiles" in unsupported_reason(AUTOGRAD, GroupedConfig(128, 128, 128, 3, 2, cluster_n=2))
    monkeypatch.setattr(grouped_wgrad_config, "CLUSTERS_OFFERED", False)
    assert clustered() == []
    monkeypatch.setattr(grouped_wgrad_config, "CLUSTERS_OFFERED", True)
    assert clustered() == offered
