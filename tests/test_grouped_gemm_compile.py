"""The grouped GEMM (MoE, torch._grouped_mm forward) compiled for sm_90a on the CPU: WGMMA and TMA
in the PTX, no spills, WGMMAs not serialized, shared memory within budget; and its config rules."""

import dataclasses
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
    "cluster-2x1-shares-the-weight": (K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)),
    "cluster-1x2-shares-the-tokens": (N_MAJOR, GroupedConfig(128, 128, 64, 6, 2, cluster_n=2)),
    "prefetch-8-2x1": (K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, prefetch=8)),
    "gated-silu": (GroupedProblem("bfloat16", "bfloat16", "k", "k", "silu"), GroupedConfig(128, 256, 64, 4, 2)),
    "gated-gelu-n-major-2x1": (GroupedProblem("bfloat16", "bfloat16", "k", "n", "gelu_tanh"),
                               GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)),
    "overlap-last-2x1": (K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True)),
    "overlap-last-gated-64x128": (GroupedProblem("bfloat16", "bfloat16", "k", "k", "silu"),
                                  GroupedConfig(64, 128, 64, 8, 1, overlap_last=True)),
    "staged-partial-128x256": (K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, overlap_last=True, staged_partial=True)),
    "gathered-int64-128x256": (GroupedProblem(rows="int64"), GroupedConfig(128, 256, 64, 4, 2)),
    "gathered-gated-int32-2x1-staged": (GroupedProblem(gate="silu", rows="int32"),
                                        GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True,
                                                      staged_partial=True)),
    "half-tiles-1x2-staged": (K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_n=2, overlap_last=True,
                                                     staged_partial=True, half_tiles=True)),
    "half-tiles-gathered-gated-2x1": (GroupedProblem(gate="silu", rows="int32"),
                                      GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True,
                                                    staged_partial=True, half_tiles=True)),
    "cluster-2x2-shares-both-staged": (N_MAJOR, GroupedConfig(128, 256, 64, 4, 2, 2, 2, overlap_last=True,
                                                              staged_partial=True)),
    "cluster-2x2-gated-half-tiles": (GroupedProblem(gate="silu"),
                                     GroupedConfig(128, 128, 64, 6, 2, 2, 2, overlap_last=True, staged_partial=True,
                                                   half_tiles=True)),
    "gathered-n-major-64x128-one-warpgroup": (GroupedProblem(b_major="n", rows="int64"), GroupedConfig(64, 128, 64, 8, 1)),
    "gate-grad-n-major-staged": (GroupedProblem(b_major="n", gate_grad="silu"),
                                 GroupedConfig(128, 256, 64, 4, 2, overlap_last=True, staged_partial=True)),
    "gate-grad-1x2-half-tiles": (GroupedProblem(gate_grad="silu"),
                                 GroupedConfig(128, 128, 64, 6, 2, 1, 2, overlap_last=True, staged_partial=True,
                                               half_tiles=True)),
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


def test_clusters_multicast_and_release_their_peers_stages(request, compiled):
    problem, config = VARIANTS[request.node.callspec.params["compiled"]]
    ptx = compiled.ptx
    multicast = re.findall(r"cp\.async\.bulk\.tensor\S*multicast::cluster", ptx)
    if config.cluster_size == 1:
        assert not multicast and "barrier.cluster" not in ptx
        return
    # one operand multicast (its load once per pipeline stage index), the other plain; 2x2 both
    # (gathered rows are not TMA loads: the weight's are all there is)
    loads = re.findall(r"cp\.async\.bulk\.tensor\S*shared\S*global\S*", ptx)
    assert (len(multicast) == len(loads)) == (config.cluster_size == 4 or bool(problem.rows))
    assert multicast and "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    assert re.search(r"mbarrier\.arrive\S*shared::cluster", ptx)  # a release to the peer CTA


def _copies(ptx: str) -> tuple[int, int]:
    """(weight boxes per token box loaded, output subtiles stored) in a grouped kernel's PTX."""
    weight = len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared\S*global", ptx))
    tokens = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared\S*global", ptx))
    return weight // tokens, len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx))


@pytest.mark.parametrize("name", ["gated-silu", "gated-gelu-n-major-2x1"])
def test_gated_kernels_load_two_weight_boxes_and_store_half_the_columns(name):
    problem, config = VARIANTS[name]
    compiled = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True)
    plain = compile_spec(spec(dataclasses.replace(problem, gate=""), config), "sm_90a", keep_ptx=True)
    (boxes, stores), (plain_boxes, plain_stores) = _copies(compiled.ptx), _copies(plain.ptx)
    assert stores == plain_stores // 2
    if problem.b_major == "k" and config.cluster_size == 1:  # (else TMA splits boxes by other rules)
        assert boxes == 2 * plain_boxes
    # one tanh.approx per output value of the thread (the fast sigmoid of a bf16 output)
    assert compiled.ptx.count("tanh.approx") >= config.tile_m * config.tile_n // 2 // (128 * config.consumer_warpgroups)


@pytest.mark.parametrize("name", ["gate-grad-n-major-staged", "gate-grad-1x2-half-tiles"])
def test_gate_gradient_kernels_read_gate_and_up_and_store_both_halves(name):
    problem, config = VARIANTS[name]
    compiled = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True)
    plain = compile_spec(spec(dataclasses.replace(problem, gate_grad=""), config), "sm_90a", keep_ptx=True)
    (boxes, stores), (plain_boxes, plain_stores) = _copies(compiled.ptx), _copies(plain.ptx)
    assert (boxes, stores) == (plain_boxes, 2 * plain_stores)  # the same loads, two TMA stores a subtile
    values = config.tile_m * config.tile_n // (128 * config.consumer_warpgroups)  # of the thread's tile
    assert compiled.ptx.count("ld.global.b16") == 2 * values  # gate and up of each
    # the precise sigmoid (ex2 and an IEEE reciprocal: no tanh.approx, whose error silu' would magnify)
    assert compiled.ptx.count("ex2.approx") >= values and "tanh.approx" not in compiled.ptx


def test_ptxas_reports_no_spills_and_no_serialized_wgmma(compiled):
    report = compiled.ptxas_report
    assert report and "Used" in report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "wgmma.mma_async instructions are serialized" not in report  # C7512 or C7519


def test_variants_fit_shared_memory():
    for problem, config in VARIANTS.values():
        assert unsupported_reason(problem, config) is None
        assert smem_bytes(config) <= SMEM_BUDGET


def test_cluster_rules_and_candidates():
    assert unsupported_reason(K_MAJOR, GroupedConfig(cluster_m=2, cluster_n=2)) is None  # (2x2: the test below)
    assert unsupported_reason(K_MAJOR, GroupedConfig(cluster_m=4)) is not None
    assert "cluster 2x1" in GroupedConfig(cluster_m=2).describe()
    # offered by default since their GPU tests passed (CLUSTERS_GPU_CHECKED); clusters=False leaves them out
    plain = candidates(K_MAJOR, 131072, 4096, 7168, groups=256, clusters=False, half_tiles=False)
    assert all(c.cluster_size == 1 for c in plain[1:])
    both = candidates(K_MAJOR, 131072, 4096, 7168, groups=256, half_tiles=False)
    clustered = [(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) for c in both if c.cluster_size == 2]
    # the default (first) is 128x256 in 2x1 clusters; no config twice
    assert sorted(clustered) == sorted([(128, 256, 2, 1), (128, 256, 1, 2), (128, 128, 2, 1), (128, 128, 1, 2)])
    assert (both[0].tile_n, both[0].cluster_n) == (256, 2) and len(set(both)) == len(both)  # the default: 1x2
    assert all(unsupported_reason(K_MAJOR, c) is None for c in both)
    # groups of one row tile on average: no 2x1 (its second CTA would mostly idle); one column
    # tile: no 1x2
    few = candidates(K_MAJOR, 4096, 256, 2048, groups=64, clusters=True)
    assert {(c.cluster_m, c.cluster_n) for c in few if c.tile_n == 256} == {(1, 1)}
    assert {(c.cluster_m, c.cluster_n) for c in few if c.tile_n == 128} == {(1, 1), (1, 2)}


def test_2x2_clusters_are_offered_once_gpu_checked(monkeypatch):
    from inductor_cute.kernels.gemm import grouped_config

    assert unsupported_reason(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, 2, 2)) is None
    assert "128-row tiles" in unsupported_reason(K_MAJOR, GroupedConfig(64, 256, 64, 5, 1, 2, 2))
    assert "gathered rows" in unsupported_reason(GroupedProblem(rows="int32"), GroupedConfig(128, 256, 64, 4, 2, 2, 2))
    assert "2x2" in unsupported_reason(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, 4, 1))

    def squares(**kw):
        return [c for c in candidates(K_MAJOR, 32768, 1536, 2048, groups=128, half_tiles=False, **kw)
                if c.cluster_size == 4]

    monkeypatch.setattr(grouped_config, "CLUSTERS_2X2_OFFERED", False)
    assert squares() == [] and len(squares(clusters=True)) == 2  # 128x256 and 128x128
    monkeypatch.setattr(grouped_config, "CLUSTERS_2X2_OFFERED", True)
    assert squares() == squares(clusters=True)
    # gathered rows never (each CTA gathers its own token rows); groups of one row tile: no 2x2
    assert not [c for c in candidates(GroupedProblem(rows="int32"), 32768, 1536, 2048, groups=128, clusters=True)
                if c.cluster_size == 4]
    assert not [c for c in candidates(K_MAJOR, 4096, 1536, 2048, groups=64, clusters=True) if c.cluster_size == 4]


def test_a_wave_of_four_cta_clusters_leaves_the_gpcs_room():
    from inductor_cute.kernels.common.tile_scheduler import TileScheduler

    # 132 SMs in at most 8 GPCs: 66 clusters of 2 always fit, but of 4 only 29 on the worst floorsweeping
    # (the H100 we measured fits 30; tests/gpu checks the driver never counts fewer than we launch)
    assert [TileScheduler.max_clusters(True, 132, size) for size in (1, 2, 4, 8)] == [132, 66, 29, 10]
    assert TileScheduler.max_clusters(False, 132, 4) == 65535


def test_prefetch_asks_l2_for_the_weight_ahead():
    plain = compile_spec(spec(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)), "sm_90a", keep_ptx=True)
    ahead = compile_spec(spec(*VARIANTS["prefetch-8-2x1"]), "sm_90a", keep_ptx=True)
    assert "cp.async.bulk.prefetch.tensor" not in plain.ptx
    first = re.search(r"cp\.async\.bulk\.prefetch\.tensor\.3d\.L2\.global", ahead.ptx)  # the 3-D weight
    assert first and "elect.sync" in ahead.ptx[max(0, first.start() - 600):first.start()]  # by one lane
    assert "prefetch" not in GroupedConfig().as_params()  # older specs keep their keys
    assert GroupedConfig(*GroupedConfig(prefetch=8).as_params().values()).prefetch == 8
    assert "prefetch" in unsupported_reason(K_MAJOR, GroupedConfig(prefetch=100))
    assert "prefetch" in unsupported_reason(K_MAJOR, GroupedConfig(stages=4, prefetch=4))  # the ring does that


def test_gated_rules():
    gated = GroupedProblem(gate="silu")
    assert "tile_k must be 64" in unsupported_reason(gated, GroupedConfig(128, 128, 128, 3, 2))
    for tile_n in (64, 192):  # half tiles of 32 or 96 columns would swizzle unlike the whole
        assert "multiple of 128" in unsupported_reason(gated, GroupedConfig(128, tile_n, 64, 4, 2))
    assert "softplus" in unsupported_reason(GroupedProblem(gate="softplus"))
    assert "multiple of 16" in unsupported_reason(gated, n=200)
    assert unsupported_reason(gated, GroupedConfig(128, 256, 64, 4, 2), n=1536, k=2048, groups=128) is None
    cands = candidates(gated, 16384, 1536, 2048, groups=128, exhaustive=True)
    assert cands and all(c.tile_k == 64 for c in cands)
    assert spec(gated, GroupedConfig()).name != spec(K_MAJOR, GroupedConfig()).name


def test_gate_gradient_rules():
    grad = GroupedProblem(b_major="n", gate_grad="silu")
    assert unsupported_reason(grad, GroupedConfig(128, 256, 64, 4, 2), n=768, k=2048, groups=128) is None
    assert "multiple of 32" in unsupported_reason(grad, n=784)  # a subtile would straddle the halves
    for other in (GroupedProblem(gate="silu", gate_grad="silu"), GroupedProblem(rows="int32", gate_grad="silu"),
                  GroupedProblem(gate_grad="gelu_tanh")):
        assert "the gate's gradient takes silu" in unsupported_reason(other)
    assert "gate_grad" not in GroupedProblem().as_params() and grouped_spec_name(grad) != grouped_spec_name(N_MAJOR)
    assert candidates(grad, 32768, 768, 2048, groups=128)


def grouped_spec_name(problem):
    return spec(problem, GroupedConfig()).name


def test_default_config_follows_group_sizes():
    big = default_config(K_MAJOR, 8192, 4096, 7168, groups=32)
    assert (big.tile_m, big.cluster_m, big.cluster_n) == (128, 1, 2)  # N spans 16 column tiles: 1x2
    narrow = default_config(K_MAJOR, 8192, 128, 7168, groups=32)  # one column tile, two row tiles a group: 2x1
    assert (narrow.tile_m, narrow.tile_n, narrow.cluster_m, narrow.cluster_n) == (128, 128, 2, 1)
    one_tile = default_config(K_MAJOR, 4096, 4096, 7168, groups=32)  # 128 rows per group: no 2x1
    assert (one_tile.tile_m, one_tile.cluster_size) == (128, 1)
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



def test_gated_half_tiles_address_each_stage_as_the_whole_tile_does():
    """The gated kernel's producer writes the weight through a layout of half tiles with twice the
    stages, its WGMMA reads the whole tile's layout: for every gated config the two must give each
    (column, k, stage) element the same swizzled smem offset, in both weight majors."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    mismatches = []

    @cute.jit
    def compare(tile_n: cutlass.Constexpr, major: cutlass.Constexpr):
        layout = LayoutEnum.ROW_MAJOR if major == "k" else LayoutEnum.COL_MAJOR
        whole = sm90_utils.make_smem_layout_b(layout, (128, tile_n, 64), cutlass.BFloat16, 2)
        halves = sm90_utils.make_smem_layout_b(layout, (128, tile_n // 2, 64), cutlass.BFloat16, 4)
        bad = 0
        for stage in cutlass.range_constexpr(2):
            for h in cutlass.range_constexpr(2):
                for n in cutlass.range_constexpr(0, tile_n // 2, 5):
                    for k in cutlass.range_constexpr(0, 64, 3):
                        if cutlass.const_expr(whole((h * (tile_n // 2) + n, k, stage)) != halves((n, k, 2 * stage + h))):
                            bad += 1
        mismatches.append((tile_n, major, bad))

    gated = GroupedProblem(gate="silu")
    widths = {c.tile_n for c in candidates(gated, 16384, 1536, 2048, groups=128, exhaustive=True, clusters=True)}
    assert widths == {128, 256}
    for tile_n in sorted(widths):
        for major in ("k", "n"):
            compare(tile_n, major)
    assert mismatches and all(bad == 0 for _, _, bad in mismatches), mismatches


def test_overlap_last_is_a_kernel_of_its_own_offered_once_gpu_checked(monkeypatch):
    from inductor_cute.kernels.gemm import grouped_config

    assert "overlap_last" not in GroupedConfig().as_params()  # older specs keep their keys
    assert spec(K_MAJOR, GroupedConfig(overlap_last=True)).name != spec(K_MAJOR, GroupedConfig()).name
    assert "overlap-last" in GroupedConfig(overlap_last=True).describe()
    from inductor_cute.kernels.gemm import grouped_sm90

    kernel, _ = grouped_sm90.build(**spec(K_MAJOR, GroupedConfig(overlap_last=True)).kwargs)
    assert kernel.grouped_cfg.overlap_last  # the spec's field reaches the kernel
    monkeypatch.setattr(grouped_config, "OVERLAP_LAST_GPU_CHECKED", False)
    monkeypatch.setattr(grouped_config, "STAGED_PARTIAL_GPU_CHECKED", False)
    assert not any(c.overlap_last for c in candidates(K_MAJOR, 32768, 1536, 2048, groups=128))
    monkeypatch.setattr(grouped_config, "OVERLAP_LAST_GPU_CHECKED", True)
    cands = candidates(K_MAJOR, 32768, 1536, 2048, groups=128)
    assert cands and all(c.overlap_last and not c.staged_partial for c in cands) and len(set(cands)) == len(cands)
    assert default_config(K_MAJOR, 32768, 1536, 2048, groups=128).overlap_last
    monkeypatch.setattr(grouped_config, "STAGED_PARTIAL_GPU_CHECKED", True)
    assert all(c.overlap_last and c.staged_partial for c in candidates(K_MAJOR, 32768, 1536, 2048, groups=128))


def test_half_tiles_are_a_kernel_of_their_own_offered_once_gpu_checked(monkeypatch):
    from inductor_cute.kernels.gemm import grouped_config, grouped_sm90

    half = GroupedConfig(half_tiles=True)
    assert "half_tiles" not in GroupedConfig().as_params()  # older specs keep their keys
    assert spec(K_MAJOR, half).name != spec(K_MAJOR, GroupedConfig()).name and "half-tiles" in half.describe()
    kernel, _ = grouped_sm90.build(**spec(K_MAJOR, half).kwargs)
    assert kernel.grouped_cfg.half_tiles  # the spec's field reaches the kernel
    assert "two consumer warp groups" in unsupported_reason(K_MAJOR, GroupedConfig(64, 256, 64, 5, 1, half_tiles=True))
    assert "128-row tiles" in unsupported_reason(K_MAJOR, GroupedConfig(256, 128, 64, 4, 2, half_tiles=True))
    from inductor_cute.kernels.gemm.grouped_wgrad_config import WgradProblem
    from inductor_cute.kernels.gemm.grouped_wgrad_config import unsupported_reason as wgrad_reason
    assert "half_tiles" in wgrad_reason(WgradProblem(), half)
    monkeypatch.setattr(grouped_config, "HALF_TILES_GPU_CHECKED", False)
    plain = candidates(K_MAJOR, 32768, 1536, 2048, groups=128)
    assert not any(c.half_tiles for c in plain)
    monkeypatch.setattr(grouped_config, "HALF_TILES_GPU_CHECKED", True)
    both = candidates(K_MAJOR, 32768, 1536, 2048, groups=128)
    # every config of two consumer warp groups gets a half-tile twin, after the others
    assert both[:len(plain)] == plain and len(set(both)) == len(both)
    assert both[len(plain):] == [dataclasses.replace(c, half_tiles=True) for c in plain
                                 if c.consumer_warpgroups == 2 and c.tile_m == 128]


def test_half_tiles_branch_around_the_mma_and_place_tiles_in_both_roles():
    full = compile_spec(spec(*VARIANTS["staged-partial-128x256"]), "sm_90a", keep_ptx=True).ptx
    half = compile_spec(spec(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, overlap_last=True, staged_partial=True,
                                                    half_tiles=True)), "sm_90a", keep_ptx=True).ptx
    # the same MMAs, under one more predicated branch; the tile's first row placed with the half
    # rule by producer and consumers (one more compare each)
    assert len(re.findall(r"wgmma\.mma_async", half)) == len(re.findall(r"wgmma\.mma_async", full))
    assert len(re.findall(r"@%p\d+ bra", half)) > len(re.findall(r"@%p\d+ bra", full))
    # the branch's predicate joins the row test and the column test (a tile past N skips too)
    assert len(re.findall(r"and\.pred", half)) > len(re.findall(r"and\.pred", full))
    assert len(re.findall(r"setp\.\w+\.s32", half)) > len(re.findall(r"setp\.\w+\.s32", full))


def test_staged_partial_stores_16_byte_pieces_instead_of_2_byte_values():
    plain = compile_spec(spec(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, overlap_last=True)), "sm_90a", keep_ptx=True)
    staged = compile_spec(spec(*VARIANTS["staged-partial-128x256"]), "sm_90a", keep_ptx=True)
    stores = lambda ptx, kind: len(re.findall(rf"st\.global\.{kind}\b", ptx))  # noqa: E731
    # 128 x 256 outputs of 256 threads: 128 values each, or 16 pieces of 8
    assert stores(plain.ptx, "b16") == 128 and stores(plain.ptx, "v4.b32") == 0
    assert stores(staged.ptx, "b16") == 0 and stores(staged.ptx, "v4.b32") == 16
    assert len(re.findall(r"ld\.shared\.v4\.b32", staged.ptx)) >= 16  # read back from the staging buffer
    assert "staged_partial" not in GroupedConfig().as_params()  # older specs keep their keys
    assert spec(K_MAJOR, GroupedConfig(staged_partial=True)).name != spec(K_MAJOR, GroupedConfig()).name


def test_overlap_last_changes_the_tile_rows_in_the_ptx():
    plain = compile_spec(spec(K_MAJOR, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)), "sm_90a", keep_ptx=True)
    moved = compile_spec(spec(*VARIANTS["overlap-last-2x1"]), "sm_90a", keep_ptx=True)
    # the first row's min/max against the group's end, in producer and consumers
    count = lambda ptx: len(re.findall(r"\b(min|max)\.s32\b", ptx))  # noqa: E731
    assert count(moved.ptx) >= count(plain.ptx) + 2


def test_config_tuples_of_every_version_restore():
    """Output code holds a config as a plain tuple (inductor/grouped/runtime.as_tuple); tuples of
    the versions before prefetch (7 fields) and before overlap_last (8) restore too."""
    from inductor_cute.inductor.grouped.runtime import GroupedLauncher, as_tuple

    for cfg in (GroupedConfig(), GroupedConfig(prefetch=8), GroupedConfig(cluster_m=2, overlap_last=True),
                GroupedConfig(staged_partial=True)):
        assert GroupedLauncher(as_tuple(cfg))._config == cfg
    assert GroupedLauncher((128, 128, 64, 6, 2, 2, 1))._config == GroupedConfig(128, 128, 64, 6, 2, 2, 1)
    assert GroupedLauncher((128, 256, 64, 4, 2, 2, 1, 8))._config.prefetch == 8


@pytest.mark.parametrize("name", [n for n in VARIANTS if n.startswith("gathered")])
def test_gathered_rows_come_by_cp_async_and_the_weight_by_tma(name):
    problem, config = VARIANTS[name]
    ptx = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True).ptx
    assert not re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared\S*global", ptx)  # no token box by TMA
    assert re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared\S*global", ptx)  # the weight's
    # 16-byte pieces, arriving on the stage's barrier as they land; the consumers' proxy fence
    # before WGMMA reads them; a trap for a row index outside a's rows
    # (the source size a register: 16, or 0 past K, which zero-fills)
    pieces = re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 16, %r\d+;", ptx)
    rows_per_pass = 128 // (config.tile_k // 8)
    assert len(pieces) >= config.tile_m // rows_per_pass
    assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    assert "trap;" in ptx
    if problem.rows == "int64":  # one 8-byte load per index, not two halves
        assert re.search(r"ld\.global\S*\.b64\b", ptx)


def test_gathered_rules():
    gathered = GroupedProblem(rows="int64")
    assert "tile_k must be 64" in unsupported_reason(gathered, GroupedConfig(128, 128, 128, 3, 2))
    assert "clusters 1x1 or 2x1" in unsupported_reason(gathered, GroupedConfig(128, 128, 64, 6, 2, cluster_n=2))
    assert "int16" in unsupported_reason(GroupedProblem(rows="int16"))
    # the default takes 2x1 where the plain problem takes 1x2; no candidate is 1x2
    assert default_config(K_MAJOR, 8192, 4096, 7168, groups=32).cluster_n == 2
    assert (default_config(gathered, 8192, 4096, 7168, groups=32).cluster_m,
            default_config(gathered, 8192, 4096, 7168, groups=32).cluster_n) == (2, 1)
    cands = candidates(gathered, 32768, 1536, 2048, groups=128, exhaustive=True)
    assert cands and all(c.cluster_n == 1 and c.tile_k == 64 for c in cands)
    assert spec(gathered, GroupedConfig()).name != spec(K_MAJOR, GroupedConfig()).name
    assert "rows" not in spec(K_MAJOR, GroupedConfig()).name  # the specs before it keep their names
