"""The grouped GEMM (MoE, torch._grouped_mm forward) on the H200 against an fp32 reference: skewed
and empty groups, groups smaller than a tile, offsets that are not multiples of the tile, tokens
past the last offset, both weight layouts, every candidate config, CUDA-graph replay with new
offsets (the offsets are read on the device only). Outputs are poisoned with NaN first, so an
unwritten row shows, and a row written outside its group shows as a changed poison row."""

import dataclasses

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.grouped_gemm import grouped_mm, grouped_mm_gated
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates

pytestmark = pytest.mark.gpu

DEV = "cuda"


def offsets(sizes, device=DEV):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def weights(groups, k, n, layout, seed=0):
    """b (groups, K, N): "k" = the transposed view of an (groups, N, K) weight, "n" = row-major."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if layout == "k":
        return torch.randn(groups, n, k, device=DEV, generator=g).div_(k ** 0.5).bfloat16().transpose(1, 2)
    return torch.randn(groups, k, n, device=DEV, generator=g).div_(k ** 0.5).bfloat16()


def reference(a, b, sizes):
    out, row = [], 0
    for g, rows in enumerate(sizes):
        out.append(a[row:row + rows].float() @ b[g].float())
        row += rows
    return torch.cat(out) if out else a.new_zeros(0, b.shape[2], dtype=torch.float32)


def check(sizes, k, n, layout="k", tokens=None, config=None, seed=0):
    covered = sum(sizes)
    tokens = covered if tokens is None else tokens
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    a = torch.randn(tokens, k, device=DEV, generator=g).bfloat16()
    b = weights(len(sizes), k, n, layout, seed)
    out = torch.full((tokens, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    got = grouped_mm(a, b, offsets(sizes), out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    ref = reference(a, b, sizes)
    assert not out[:covered].isnan().any(), "rows of some group were not written"
    torch.testing.assert_close(out[:covered].float(), ref, atol=2e-2, rtol=2e-2)
    assert out[covered:].isnan().all(), "rows past the last offset were written"
    return out


SIZES = {
    "equal": [256] * 8,
    "skewed": [1, 0, 700, 3, 0, 0, 129, 64],
    "leading-trailing-empty": [0, 0, 5, 0, 300, 0, 0],
    "smaller-than-a-tile": [7, 1, 63, 2, 33],
    "unaligned-offsets": [127, 129, 255, 257, 1, 65],
    "one-group": [1000],
    "many-groups": [(i * 37) % 90 for i in range(128)],
}


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("layout", ["k", "n"])
def test_matches_fp32_reference(name, layout):
    check(SIZES[name], 512, 384, layout)


@pytest.mark.parametrize("n,k", [(8, 8), (40, 24), (1536, 2048), (264, 1000)])
def test_ragged_n_and_k(n, k):
    check([3, 130, 0, 77], k, n)


def test_tokens_past_the_last_offset_stay_untouched():
    check([100, 0, 50], 256, 256, tokens=400)


@pytest.mark.parametrize("index", range(len(candidates(GroupedProblem(), 2048, 512, 512, groups=16,
                                                                 exhaustive=True))))
def test_every_candidate_config(index):
    config = candidates(GroupedProblem(), 2048, 512, 512, groups=16, exhaustive=True)[index]
    check([0, 300, 5, 1, 700, 129, 64, 0, 250, 3, 17, 400, 0, 44, 90, 45], 512, 512, config=config)


# both cluster shapes on both tile widths: N = 384 is two 256-column tiles (1x2 pairs fill) and
# three 128-column tiles (the last 1x2 pair has an idle peer past N); odd row-tile counts leave
# 2x1 pairs with an idle peer past the group's rows
CLUSTERS = [GroupedConfig(128, 256, 64, 4, 2, cluster_m=2), GroupedConfig(128, 256, 64, 4, 2, cluster_n=2),
            GroupedConfig(128, 128, 64, 6, 2, cluster_m=2), GroupedConfig(128, 128, 64, 6, 2, cluster_n=2),
            GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, prefetch=8)]  # (the weight prefetched into L2)


# 2x2 clusters (grouped_config.CLUSTERS_2X2_OFFERED): four tiles of one group share both
# operands; odd row-tile counts and one column tile leave peers past the group's rows or past N
CLUSTERS_2X2 = [GroupedConfig(128, 256, 64, 4, 2, 2, 2, overlap_last=True, staged_partial=True),
                GroupedConfig(128, 128, 64, 6, 2, 2, 2, overlap_last=True, staged_partial=True),
                GroupedConfig(128, 256, 64, 4, 2, 2, 2, overlap_last=True, staged_partial=True, half_tiles=True),
                GroupedConfig(128, 128, 64, 6, 2, 2, 2)]


@pytest.mark.parametrize("layout", ["k", "n"])  # N-major B under 2x1 splits the multicast along K
@pytest.mark.parametrize("config", CLUSTERS + CLUSTERS_2X2, ids=lambda c: c.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", sorted(SIZES))
def test_cluster_configs(name, config, layout):
    check(SIZES[name], 512, 384, layout, config=config, seed=3)


@pytest.mark.parametrize("config", CLUSTERS + CLUSTERS_2X2, ids=lambda c: c.describe().replace(" ", "-"))
def test_cluster_configs_on_ragged_n_and_tokens_past_the_offsets(config):
    check([3, 130, 0, 277], 1000, 40, config=config)  # one column tile: every 1x2 peer idle
    check([100, 0, 300], 256, 264, tokens=700, config=config)


@pytest.mark.parametrize("config", CLUSTERS_2X2, ids=lambda c: c.describe().replace(" ", "-"))
def test_2x2_clusters_multicast_both_gate_halves(config):
    check_gated([300, 0, 5, 129, 700], 512, 384, config=config)
    check_gated([300, 0, 5, 129, 700], 512, 320, "n", config=config)  # N-major halves; a column peer past F


def test_a_wave_of_clusters_fits_on_the_gpu_at_once():
    # a persistent grid larger than the clusters that fit at once runs its last ones as a second wave
    from cutlass.utils import HardwareInfo

    from inductor_cute.kernels.common.tile_scheduler import TileScheduler

    torch.cuda.init()  # the driver's count needs a context
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for size in (1, 2, 4, 8):
        assert TileScheduler.max_clusters(True, sms, size) <= HardwareInfo().get_max_active_clusters(size), size


def test_large_moe_shape_in_clusters():
    torch.manual_seed(1)
    sizes = [int(x) for x in torch.distributions.Dirichlet(torch.ones(32)).sample().mul(8192).floor()]
    sizes[-1] += 8192 - sum(sizes)
    for config in CLUSTERS[:2] + CLUSTERS_2X2[:1]:
        check(sizes, 7168, 4096, config=config)


# overlap_last: a group's last row tile moved back to end at the group's last row (whole TMA
# stores, rows of the tile before it stored twice); plain, in both cluster shapes, 64-row tiles;
# staged_partial (the partial tiles left, through the staging buffer in 16-byte pieces) with and
# without it
EDGES = [GroupedConfig(128, 256, 64, 4, 2, overlap_last=True), GroupedConfig(128, 128, 64, 6, 2, overlap_last=True),
           GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True),
           GroupedConfig(128, 256, 64, 4, 2, cluster_n=2, overlap_last=True),
           GroupedConfig(64, 256, 64, 5, 1, overlap_last=True),
           GroupedConfig(128, 256, 64, 4, 2, staged_partial=True),
           GroupedConfig(128, 128, 64, 6, 2, cluster_n=2, overlap_last=True, staged_partial=True),
           GroupedConfig(64, 128, 64, 8, 1, overlap_last=True, staged_partial=True)]


@pytest.mark.parametrize("layout", ["k", "n"])
@pytest.mark.parametrize("config", EDGES, ids=lambda c: c.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", sorted(SIZES))
def test_partial_tile_configs(name, config, layout):
    check(SIZES[name], 512, 384, layout, config=config, seed=5)
    check([3, 130, 0, 277], 1000, 40, config=config)
    check([100, 0, 300], 256, 264, tokens=700, config=config)  # rows past the offsets stay poisoned


@pytest.mark.parametrize("config", EDGES[:3], ids=lambda c: c.describe().replace(" ", "-"))
def test_overlap_last_stores_the_values_of_the_unmoved_tile(config):
    """The rows a moved last tile stores again are bit-identical to those of the tile before it:
    the same rows computed at another place in a tile. Against the same rows in a group of whole
    tiles (384 rows: nothing moves) and the same config without overlap_last."""
    g = torch.Generator(device=DEV).manual_seed(9)
    a = torch.randn(384, 1024, device=DEV, generator=g).bfloat16()
    b = weights(1, 1024, 512, "k", seed=9)
    whole = grouped_mm(a, b, offsets([384]), config=config)
    plain = grouped_mm(a, b, offsets([300]), config=dataclasses.replace(config, overlap_last=False))
    moved = grouped_mm(a, b, offsets([300]), config=config)  # last tile: rows 172..299
    assert torch.equal(moved[:300], whole[:300]) and torch.equal(moved[:300], plain[:300])


def routed_sizes(rows: int, groups: int = 128, seed: int = 2) -> list[int]:
    return torch.bincount(torch.randint(groups, (rows,), generator=torch.Generator().manual_seed(seed)),
                          minlength=groups).tolist()


@pytest.mark.parametrize("rows", [32768, 8192, 20000])  # 256, 64 and ~156 rows per group, give or take
def test_partial_tile_configs_on_routed_moe_shapes(rows):
    """Many tiles per CTA, whole and partial mixed (a partial tile's staged stores right after whole
    tiles' TMA stores share the staging buffers)."""
    sizes = routed_sizes(rows)
    for config in EDGES:
        check(sizes, 2048, 1536, config=config)


@pytest.mark.parametrize("config", [c for c in EDGES if c.staged_partial], ids=lambda c: c.describe().replace(" ", "-"))
def test_staged_partial_stores_the_same_bits(config):
    """The same bf16 values leave the registers either way: staged and predicated stores agree bit
    for bit, on groups above and below a tile."""
    sizes = routed_sizes(20000, seed=4)
    a = torch.randn(sum(sizes), 1024, device=DEV).bfloat16()
    b, offs = weights(len(sizes), 1024, 768, "k", seed=4), offsets(sizes)
    staged = grouped_mm(a, b, offs, config=config)
    assert torch.equal(staged, grouped_mm(a, b, offs, config=dataclasses.replace(config, staged_partial=False)))


# half_tiles: a warp group whose rows all lie past its group (a half tile's second half, a cluster
# peer past the group or past N) issues no MMAs; a last tile with at most 64 of the group's rows keeps
# its place (not moved back by overlap_last) and is stored as a partial tile. Sizes whose tails are
# 1, 63, 64, 65 and 127 rows past a multiple of 128 put the boundary on both sides of the half
HALF_TILES = [GroupedConfig(128, 256, 64, 4, 2, overlap_last=True, staged_partial=True, half_tiles=True),
              GroupedConfig(128, 128, 64, 6, 2, cluster_m=2, overlap_last=True, staged_partial=True, half_tiles=True),
              GroupedConfig(128, 256, 64, 4, 2, cluster_n=2, overlap_last=True, staged_partial=True, half_tiles=True),
              GroupedConfig(128, 256, 64, 4, 2, half_tiles=True)]  # predicated partial stores, no moved tiles
HALF_TAILS = [129, 0, 191, 192, 193, 255, 64, 65, 1, 300, 320]


@pytest.mark.parametrize("layout", ["k", "n"])
@pytest.mark.parametrize("config", HALF_TILES, ids=lambda c: c.describe().replace(" ", "-"))
def test_half_tiles(config, layout):
    check(HALF_TAILS, 512, 384, layout, config=config, seed=7)
    check(HALF_TAILS, 1000, 40, layout, config=config)  # one column tile: a 1x2 peer past N
    check([100, 0, 300], 256, 264, tokens=700, config=config)  # rows past the offsets stay poisoned
    check(routed_sizes(32768), 2048, 1536, config=config)  # ~256 rows a group: the MoE block's tails


@pytest.mark.parametrize("config", HALF_TILES[:3], ids=lambda c: c.describe().replace(" ", "-"))
def test_half_tiles_store_the_same_bits_as_whole_tiles(config):
    """A half tile's rows leave the same registers as they would from a moved (whole) tile: the
    same rows computed at another place in a tile, bit for bit."""
    sizes = routed_sizes(32768, seed=6)
    a = torch.randn(sum(sizes), 1024, device=DEV).bfloat16()
    b, offs = weights(len(sizes), 1024, 768, "k", seed=6), offsets(sizes)
    half = grouped_mm(a, b, offs, config=config)
    assert torch.equal(half, grouped_mm(a, b, offs, config=dataclasses.replace(config, half_tiles=False)))


@pytest.mark.parametrize("layout", ["k", "n"])
def test_half_tiles_gated_and_gathered(layout):
    config = HALF_TILES[1]
    check_gated(HALF_TAILS, 512, 192, layout, config=config)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(700, 512, device=DEV, generator=g).bfloat16()
    rows = torch.randint(700, (sum(HALF_TAILS),), device=DEV, generator=g)
    b, offs = weights(len(HALF_TAILS), 512, 384, layout), offsets(HALF_TAILS)
    gathered = grouped_mm(x, b, offs, rows=rows, config=config)
    assert torch.equal(gathered, grouped_mm(x[rows], b, offs, config=config))


GATED_CONFIGS = [None, GroupedConfig(128, 128, 64, 6, 2), GroupedConfig(64, 128, 64, 8, 1),
                 GroupedConfig(128, 256, 64, 4, 2, cluster_m=2), GroupedConfig(128, 256, 64, 4, 2, cluster_n=2),
                 GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True),
                 GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True, staged_partial=True),
                 GroupedConfig(64, 128, 64, 8, 1, staged_partial=True)]


def check_gated(sizes, k, f, layout="k", activation="silu", tokens=None, config=None, seed=0):
    """The gated up projection against fp32: act(a @ gate) * (a @ up) per group, rows past the
    last offset untouched (NaN poison)."""
    covered = sum(sizes)
    tokens = covered if tokens is None else tokens
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    a = torch.randn(tokens, k, device=DEV, generator=g).bfloat16()
    b = weights(len(sizes), k, 2 * f, layout, seed)
    out = torch.full((tokens, f), float("nan"), device=DEV, dtype=torch.bfloat16)
    assert grouped_mm_gated(a, b, offsets(sizes), activation, out=out, config=config).data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    prod = reference(a, b, sizes)
    act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
           "relu": torch.relu}[activation]
    ref = act(prod[:, :f]) * prod[:, f:]
    assert not out[:covered].isnan().any(), "rows of some group were not written"
    torch.testing.assert_close(out[:covered].float(), ref, atol=3e-2, rtol=3e-2)
    assert out[covered:].isnan().all(), "rows past the last offset were written"


@pytest.mark.parametrize("config", GATED_CONFIGS, ids=lambda c: "default" if c is None else c.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", ["skewed", "unaligned-offsets", "many-groups", "smaller-than-a-tile"])
@pytest.mark.parametrize("layout", ["k", "n"])
def test_gated_up_projection(name, layout, config):
    check_gated(SIZES[name], 512, 192, layout, config=config)  # F = 192: a partial last column tile


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
def test_gated_activations_and_ragged_sizes(activation):
    check_gated([3, 130, 0, 77], 1000, 40, activation=activation, tokens=260)  # F = 40: one partial tile
    check_gated([100, 0, 300], 256, 264, activation=activation)


def test_gated_matches_the_unfused_moe_up_projection():
    """As transformers computes it: grouped_mm with the fused gate_up weight, chunk, silu * up."""
    sizes = [300, 0, 17, 1200, 64, 128]
    a = torch.randn(sum(sizes), 2048, device=DEV).bfloat16()
    w = torch.randn(len(sizes), 2 * 768, 2048, device=DEV).div(2048 ** 0.5).bfloat16()  # (E, 2F, K)
    offs = offsets(sizes)
    gate, up = torch._grouped_mm(a, w.transpose(-2, -1), offs).chunk(2, dim=-1)
    torch.testing.assert_close(grouped_mm_gated(a, w.transpose(-2, -1), offs),
                               torch.nn.functional.silu(gate) * up, atol=3e-2, rtol=3e-2)


def test_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not available")
    sizes = [300, 0, 17, 1200, 64, 128]
    a = torch.randn(sum(sizes), 1024, device=DEV).bfloat16()
    b = weights(len(sizes), 1024, 768, "k")
    offs = offsets(sizes)
    torch.testing.assert_close(grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs), atol=2e-2, rtol=2e-2)


def test_cuda_graph_replays_with_new_offsets():
    a = torch.randn(1024, 256, device=DEV).bfloat16()
    b = weights(4, 256, 256, "k")
    offs = offsets([256, 256, 256, 256])
    out = torch.empty(1024, 256, device=DEV, dtype=torch.bfloat16)
    grouped_mm(a, b, offs, out=out)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mm(a, b, offs, out=out)
    for sizes in ([1024, 0, 0, 0], [1, 2, 3, 1018], [0, 500, 0, 524]):
        offs.copy_(offsets(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(a, b, sizes), atol=2e-2, rtol=2e-2)


def test_large_moe_shape():
    torch.manual_seed(0)
    sizes = [int(x) for x in torch.distributions.Dirichlet(torch.ones(32)).sample().mul(8192).floor()]
    sizes[-1] += 8192 - sum(sizes)
    check(sizes, 7168, 4096)


def test_strided_tokens_and_an_unaligned_weight_are_handled():
    sizes = [40, 0, 200, 9]
    wide = torch.randn(sum(sizes), 520, device=DEV).bfloat16()
    a = wide[:, :512]  # rows 1040 bytes apart: TMA-able as is
    flat = torch.randn(4 * 512 * 256 + 1, device=DEV).bfloat16()
    b = flat[1:].view(4, 512, 256)  # 2 bytes past an aligned address: copied
    out = grouped_mm(a, b, offsets(sizes))
    torch.testing.assert_close(out.float(), reference(a, b, sizes), atol=2e-2, rtol=2e-2)


def test_repeated_calls_are_identical():
    sizes = [5, 900, 0, 130]
    a = torch.randn(sum(sizes), 512, device=DEV).bfloat16()
    b, offs = weights(4, 512, 256, "n"), offsets(sizes)
    first = grouped_mm(a, b, offs)
    for _ in range(3):
        assert torch.equal(grouped_mm(a, b, offs), first)


def test_inputs_are_checked():
    a = torch.randn(64, 64, device=DEV).bfloat16()
    b = weights(2, 64, 64, "k")
    offs = offsets([32, 32])
    with pytest.raises(UnsupportedError, match="bfloat16"):
        grouped_mm(a.half(), b, offs)
    with pytest.raises(UnsupportedError, match="K=64 but b has K=32"):
        grouped_mm(a, b[:, :32], offs)
    with pytest.raises(UnsupportedError, match="int32"):
        grouped_mm(a, b, offs.long())
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        grouped_mm(torch.randn(64, 60, device=DEV).bfloat16(), weights(2, 60, 64, "k"), offs)
    with pytest.raises(UnsupportedError, match="out must be"):
        grouped_mm(a, b, offs, out=torch.empty(64, 64, device=DEV, dtype=torch.bfloat16).t())
