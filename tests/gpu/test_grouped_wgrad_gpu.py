"""The grouped GEMM's backward forms (MoE) on the H200 against fp32 references.

Weight gradient (2-D a x 2-D b, groups splitting the reduction over tokens): skewed and empty
groups (an empty group's gradient is zero), groups smaller than a k-block, offsets that are not
multiples of it, tokens past the last offset (filled with inf: a token outside every group must
not contribute, so both operands of the boundary k-block must be masked), all four operand
layouts, every candidate config, CUDA-graph replay with new offsets. Outputs are poisoned with NaN
first, so an unwritten tile shows.

Input gradient (the forward form with b the transposed weight, as autograd passes it for either
weight layout); and an MoE expert MLP's gradients through ops (a torch.autograd.Function) and
through torch.compile with only our GEMMs, against eager autograd of torch._grouped_mm."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute
from inductor_cute import ops
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig
from inductor_cute.kernels.gemm.grouped_wgrad_config import WgradProblem, candidates

pytestmark = pytest.mark.gpu

DEV = "cuda"
OUR_CALL = "inductor_cute.inductor.grouped.runtime.GroupedLauncher("


def offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)


def operands(tokens, m, n, a_major="m", b_major="n", seed=0):
    """a (M, tokens), b (tokens, N) in the layouts named as the kernel names them: a "m" is the
    transposed view of a row-major (tokens, M) (autograd's grad_out.t()), "k" tokens-contiguous;
    b "n" row-major, "k" the transposed view of a row-major (N, tokens)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(tokens, m, device=DEV, generator=g).bfloat16()
    a = a.t() if a_major == "m" else a.t().contiguous()
    b = torch.randn(tokens, n, device=DEV, generator=g).div_(tokens ** 0.5 + 1).bfloat16()
    b = b if b_major == "n" else b.t().contiguous().t()
    return a, b


def wgrad_reference(a, b, sizes):
    out, start = [], 0
    for rows in sizes:
        out.append(a[:, start:start + rows].double() @ b[start:start + rows].double())
        start += rows
    return torch.stack(out)


def check_wgrad(sizes, m, n, a_major="m", b_major="n", tokens=None, config=None, seed=0):
    covered = sum(sizes)
    tokens = covered if tokens is None else tokens
    a, b = operands(tokens, m, n, a_major, b_major, seed)
    if tokens > covered:  # tokens outside every group: must not reach any output
        a[:, covered:] = float("inf")
        b[covered:] = float("inf")
    out = torch.full((len(sizes), m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    got = ops.grouped_mm(a, b, offsets(sizes), out, config=config)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert not out.isnan().any(), "some tile was not written (or a token outside its group reached it)"
    ref = wgrad_reference(a, b, sizes)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert (out[g] == 0).all(), f"empty group {g} has a nonzero gradient"
    return out


SIZES = {
    "equal": [256] * 8,
    "skewed": [1, 0, 700, 3, 0, 0, 129, 64],
    "leading-trailing-empty": [0, 0, 5, 0, 300, 0, 0],
    "smaller-than-a-k-block": [7, 1, 63, 2, 33],
    "unaligned-offsets": [127, 129, 255, 257, 1, 65],
    "one-group": [1000],
    "many-groups": [(i * 37) % 90 for i in range(128)],
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_weight_gradient_matches_fp32(name):
    check_wgrad(SIZES[name], 384, 256)


@pytest.mark.parametrize("a_major,b_major", [("m", "n"), ("k", "k"), ("m", "k"), ("k", "n")])
def test_every_operand_layout(a_major, b_major):
    check_wgrad([3, 130, 0, 77, 206], 256, 192, a_major, b_major)  # 416 tokens: token-major rows of 16 bytes


@pytest.mark.parametrize("m,n", [(8, 8), (40, 24), (264, 1000), (1536, 2048)])
def test_ragged_m_and_n(m, n):
    check_wgrad([3, 130, 0, 77], m, n)


def test_tokens_past_the_last_offset_do_not_contribute():
    check_wgrad([100, 0, 50], 256, 256, tokens=400)  # the last group ends inside a k-block
    check_wgrad([128, 64], 128, 128, tokens=300)  # ... and at a k-block's edge


def test_all_groups_empty():
    check_wgrad([0, 0, 0], 128, 64, tokens=64)


@pytest.mark.parametrize("index", range(len(candidates(WgradProblem(), 512, 512, 2048, groups=16, exhaustive=True))))
def test_every_candidate_config(index):
    config = candidates(WgradProblem(), 512, 512, 2048, groups=16, exhaustive=True)[index]
    check_wgrad([0, 300, 5, 1, 700, 129, 64, 0, 250, 3, 17, 400, 0, 44, 90, 45], 512, 512, config=config)


# the whole-tile store (offered in these forms: grouped_wgrad_config.offers_whole_tile_store):
# tiles of one unit after another through one staging buffer each, partial tiles at M and N, empty
# groups, both operand layouts, a CTA with many units (its buffers reused while the stores drain)
WHOLE_TILE_CONFIGS = [GroupedConfig(128, 256, 64, 3, 2, store_whole_tile=True),
                      GroupedConfig(128, 128, 64, 5, 2, store_whole_tile=True),
                      GroupedConfig(64, 128, 64, 7, 1, store_whole_tile=True),
                      # the deepest 64-row forms (exhaustive candidates ran them once, unnamed)
                      GroupedConfig(64, 128, 64, 8, 1, store_whole_tile=True),
                      GroupedConfig(64, 256, 64, 4, 1, store_whole_tile=True)]


@pytest.mark.parametrize("config", WHOLE_TILE_CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("a_major,b_major,m,n", [("m", "n", 2048, 1536), ("k", "k", 264, 1000), ("m", "n", 40, 24)])
def test_the_whole_tile_store(config, a_major, b_major, m, n):
    sizes = [(i * 53) % 300 for i in range(64)]  # 0 to 299 tokens (the first group empty)
    # tokens past the last group (inf: must not reach an output), a multiple of 8 (token-major rows)
    tokens = -(-(sum(sizes) + 1) // 8) * 8
    check_wgrad(sizes, m, n, a_major, b_major, tokens=tokens, config=config)


@pytest.mark.parametrize("config", WHOLE_TILE_CONFIGS, ids=lambda c: c.describe())
def test_the_whole_tile_store_of_back_to_back_epilogues(config):
    # empty and one-k-block groups: a CTA's epilogues follow each other with (almost) no MMAs between,
    # an empty group's zero tile right after a nonzero one, each CTA reusing its buffers many times:
    # a tile written before the last one's stores have read the buffers shows as wrong blocks
    sizes = [0, 5, 0, 70, 0, 1, 0, 33] * 16
    check_wgrad(sizes, 264, 256, tokens=-(-(sum(sizes) + 1) // 8) * 8, config=config)


# clusters (grouped_wgrad_config.CLUSTERS_OFFERED): the peers share one
# operand's k-blocks by multicast; odd tile counts put one peer's tile past M (2x1) or N (1x2), where
# it must load and release as usual and store nothing; both operand layouts, the boundary mask in
# each CTA's copy of a stage, with and without the whole-tile store
CLUSTER_CONFIGS = [c for c in candidates(WgradProblem(), 512, 512, 2048, groups=16, clusters=True)
                   if c.cluster_size > 1 and not c.pingpong]  # every cooperative cluster config offered


# ping-pong (GroupedConfig.pingpong; grouped_wgrad_config.PINGPONG_GPU_CHECKED): the two consumer warp
# groups take alternate units, each skipping the other's ring stages (their count from the other
# unit's group), and take turns at their mainloops. CTAs of one unit (slot 1 idle), of odd and even
# unit counts, empty groups (no stage to skip), both layouts, with and without the whole-tile store
# (PINGPONG_WHOLE_TILE_OFFERED: the warp groups take turns at its one buffer, and a peer past M or
# N still takes and hands its turn), in 2x1, 1x2 and 2x2 clusters (PINGPONG_CLUSTERS_OFFERED)
PINGPONG_CONFIGS = list(dict.fromkeys(
    [c for c in candidates(WgradProblem(), 512, 512, 2048, groups=16, pingpong=True) if c.pingpong] +
    [GroupedConfig(128, 128, 64, 5, 2, store_whole_tile=True, pingpong=True),
     GroupedConfig(128, 128, 64, 6, 2, cluster_m=2, pingpong=True),
     GroupedConfig(128, 128, 64, 6, 2, cluster_n=2, pingpong=True),
     GroupedConfig(128, 128, 64, 6, 2, 2, 2, pingpong=True),
     GroupedConfig(128, 128, 64, 5, 2, 2, 2, store_whole_tile=True, pingpong=True)]))


@pytest.mark.parametrize("config", CLUSTER_CONFIGS + PINGPONG_CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("a_major,b_major,m,n", [("m", "n", 1536, 2048), ("m", "n", 264, 600), ("k", "k", 264, 1000),
                                                 ("m", "k", 1000, 264), ("k", "n", 40, 24)])
def test_clusters_and_pingpong(config, a_major, b_major, m, n):
    sizes = [(i * 53) % 300 for i in range(24)]  # 0 to 299 tokens (the first group empty)
    tokens = -(-(sum(sizes) + 1) // 8) * 8  # tokens past the last group (inf)
    check_wgrad(sizes, m, n, a_major, b_major, tokens=tokens, config=config)


@pytest.mark.parametrize("config", CLUSTER_CONFIGS, ids=lambda c: c.describe())
def test_clusters_of_back_to_back_epilogues_and_of_long_groups(config):
    sizes = [0, 5, 0, 70, 0, 1, 0, 33] * 16
    check_wgrad(sizes, 264, 264, tokens=-(-(sum(sizes) + 1) // 8) * 8, config=config)
    # many k-blocks a unit: each CTA waits on its peer's releases within a unit
    sizes = [3000, 5, 0, 1200]
    check_wgrad(sizes, 264, 600, tokens=-(-(sum(sizes) + 1) // 8) * 8, config=config)


@pytest.mark.parametrize("config", PINGPONG_CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("sizes", [[0, 5, 0, 70, 0, 1, 0, 33] * 16, [3000, 5, 0, 1200], [0, 17, 0], [9, 0, 0, 0, 300]],
                         ids=["back-to-back-epilogues", "long-groups", "one-unit", "empty-after"])
def test_pingpong_unit_counts_and_group_lengths(config, sizes):
    check_wgrad(sizes, 264, 264, tokens=-(-(sum(sizes) + 1) // 8) * 8, config=config)
    check_wgrad(sizes, 96, 128, config=config)  # one tile a group: few units, most CTAs with one (slot 1 idle)


@pytest.mark.parametrize("config", PINGPONG_CONFIGS, ids=lambda c: c.describe())
def test_pingpong_skips_units_longer_than_the_ring(config):
    # 12 x 16 tiles a group: ~9 units a CTA, so both slots run units of up to 47 k-blocks and each
    # passes over the other's, far more stages than the ring holds
    sizes = [3000, 5, 0, 1200, 700, 2500]
    check_wgrad(sizes, 1536, 2048, tokens=-(-(sum(sizes) + 1) // 8) * 8, config=config)


def test_weight_gradient_matches_torch_grouped_mm():
    sizes = [300, 0, 17, 1200, 64, 128]
    a, b = operands(sum(sizes), 1024, 768)
    offs = offsets(sizes)
    torch.testing.assert_close(ops.grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs), atol=3e-2, rtol=2e-2)


def test_large_weight_gradient():
    torch.manual_seed(0)
    sizes = [int(x) for x in torch.distributions.Dirichlet(torch.ones(16)).sample().mul(8192).floor()]
    sizes[-1] += 8192 - sum(sizes)
    check_wgrad(sizes, 2048, 1536)


# the default config and two in clusters (cluster peers under replay with new offsets)
@pytest.mark.parametrize("config", [None, *CLUSTER_CONFIGS[:2]], ids=lambda c: "default" if c is None else c.describe())
def test_weight_gradient_cuda_graph_replays_with_new_offsets(config):
    check_replay(config, 384, 512, [[1024, 0, 0, 0], [1, 2, 3, 1018], [0, 500, 0, 524], [0, 0, 0, 0]])


@pytest.mark.parametrize("config", PINGPONG_CONFIGS, ids=lambda c: c.describe())
def test_pingpong_cuda_graph_replays_with_new_offsets(config):
    # 12 x 8 tiles a group, 4 groups of 1024 tokens: ~3 units a CTA, so both slots run under replay
    check_replay(config, 1536, 1024, [[4096, 0, 0, 0], [1, 2, 3, 4090], [0, 2000, 0, 2096]])


def check_replay(config, m, n, new_sizes):
    """Capture the weight gradient of 4 equal groups in a CUDA graph, then replay it with each of
    `new_sizes` copied into the offsets (same token count), against fp64."""
    tokens = sum(new_sizes[0])
    a, b = operands(tokens, m, n)
    offs = offsets([tokens // 4] * 4)
    out = torch.empty(4, m, n, device=DEV, dtype=torch.bfloat16)
    ops.grouped_mm(a, b, offs, out, config=config)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.grouped_mm(a, b, offs, out, config=config)
    for sizes in new_sizes:
        offs.copy_(offsets(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double(), wgrad_reference(a, b, sizes), atol=3e-2, rtol=2e-2)


def test_weight_gradient_repeated_calls_are_identical():
    sizes = [5, 900, 0, 130]
    a, b = operands(sum(sizes), 512, 256)
    offs = offsets(sizes)
    first = ops.grouped_mm(a, b, offs)
    for _ in range(3):
        assert torch.equal(ops.grouped_mm(a, b, offs), first)


# ---- the input gradient: the forward form with b = the transposed weight

@pytest.mark.parametrize("weight", ["(E, N, K) as MoE layers store it", "(E, K, N) row-major"])
@pytest.mark.parametrize("sizes", [[256] * 4, [0, 700, 3, 0, 129, 0], [1, 1, 0, 1]], ids=["equal", "skewed", "tiny"])
def test_input_gradient_matches_fp32(weight, sizes):
    k, n, groups, tokens = 512, 384, len(sizes), sum(sizes)
    g = torch.Generator(device=DEV).manual_seed(2)
    if weight.startswith("(E, N, K)"):
        w = torch.randn(groups, n, k, device=DEV, generator=g).div_(k ** 0.5).bfloat16()
        b_fwd = w.transpose(-2, -1)  # forward b (E, K, N)
    else:
        b_fwd = torch.randn(groups, k, n, device=DEV, generator=g).div_(k ** 0.5).bfloat16()
    b_dgrad = b_fwd.transpose(-2, -1)  # what autograd passes: (E, N, K)
    grad = torch.randn(tokens, n, device=DEV, generator=g).bfloat16()
    out = torch.full((tokens, k), float("nan"), device=DEV, dtype=torch.bfloat16)
    ops.grouped_mm(grad, b_dgrad, offsets(sizes), out)
    want, start = [], 0
    for e, rows in enumerate(sizes):
        want.append(grad[start:start + rows].double() @ b_dgrad[e].double())
        start += rows
    torch.testing.assert_close(out.double(), torch.cat(want), atol=3e-2, rtol=2e-2)


# ---- an MoE expert MLP's gradients: through ops, and compiled with only our GEMMs

class OpsGroupedMM(torch.autograd.Function):
    """torch._grouped_mm's 2-D x 3-D form with both gradients through ops.grouped_mm."""

    @staticmethod
    def forward(ctx, x, b, offs):
        ctx.save_for_backward(x, b, offs)
        return ops.grouped_mm(x, b, offs)

    @staticmethod
    def backward(ctx, grad):
        x, b, offs = ctx.saved_tensors
        grad = grad.contiguous()
        return ops.grouped_mm(grad, b.transpose(-2, -1), offs), ops.grouped_mm(x.t(), grad, offs), None


def moe_mlp(x, w13, w2, offs, grouped_mm):
    gate, up = grouped_mm(x, w13.transpose(-2, -1), offs).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)


def _torch_grouped_mm(x, b, offs):
    return torch._grouped_mm(x, b, offs)


def moe_inputs(sizes, hidden=512, ffn=256, seed=3):
    g = torch.Generator(device=DEV).manual_seed(seed)
    experts, tokens = len(sizes), sum(sizes)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * ffn, hidden, device=DEV, generator=g).div_(hidden ** 0.5).bfloat16()
    w2 = torch.randn(experts, hidden, ffn, device=DEV, generator=g).div_(ffn ** 0.5).bfloat16()
    grad = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    return x, w13, w2, offsets(sizes), grad


def gradients(fn, x, w13, w2, offs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
    out = fn(*leaves, offs)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


MOE_SIZES = {"balanced": [256] * 8, "skewed": [0, 1500, 3, 0, 400, 45, 100, 0]}


@pytest.mark.parametrize("name", sorted(MOE_SIZES))
def test_moe_gradients_through_ops_match_eager_autograd(name):
    inputs = moe_inputs(MOE_SIZES[name])
    out, grads = gradients(lambda x, w13, w2, offs: moe_mlp(x, w13, w2, offs, OpsGroupedMM.apply), *inputs)
    ref_out, ref_grads = gradients(lambda x, w13, w2, offs: moe_mlp(x, w13, w2, offs, _torch_grouped_mm), *inputs)
    assert rel(out, ref_out) < 2e-2
    for mine, ref, what in zip(grads, ref_grads, ("x", "w13", "w2")):
        assert not mine.isnan().any(), what
        assert rel(mine, ref) < 3e-2, what
    for e, rows in enumerate(MOE_SIZES[name]):  # an expert without tokens gets no gradient
        if rows == 0:
            assert (grads[1][e] == 0).all() and (grads[2][e] == 0).all()


@pytest.mark.parametrize("name", sorted(MOE_SIZES))
def test_compiled_moe_training_step_uses_our_backward_gemms(name, caplog):
    torch._dynamo.reset()
    x, w13, w2, offs, grad = moe_inputs(MOE_SIZES[name])
    ref_out, ref_grads = gradients(lambda x, w13, w2, offs: moe_mlp(x, w13, w2, offs, _torch_grouped_mm),
                                   x, w13, w2, offs, grad)
    compiled = torch.compile(lambda x, w13, w2, offs: moe_mlp(x, w13, w2, offs, _torch_grouped_mm),
                             mode="max-autotune-no-cudagraphs")
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE", fx_graph_cache=False), \
            caplog.at_level("INFO", logger="inductor_cute"):
        (out, grads), codes = run_and_get_code(lambda: gradients(compiled, x, w13, w2, offs, grad))
    code = "\n".join(codes)
    # forward: 2; backward: 2 input gradients + 2 weight gradients
    assert code.count(OUR_CALL) == 6 and "extern_kernels._grouped_mm" not in code
    assert caplog.text.count("(weight gradient)") >= 2
    assert rel(out, ref_out) < 2e-2
    for mine, ref, what in zip(grads, ref_grads, ("x", "w13", "w2")):
        assert rel(mine, ref) < 3e-2, what
    torch._dynamo.reset()
