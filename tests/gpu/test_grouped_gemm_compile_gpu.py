"""torch._grouped_mm under torch.compile with inductor-cute enabled, on the H200: our grouped GEMM
is offered, chosen when it is the only GEMM backend, and matches an fp32 reference for balanced,
skewed and empty groups (one compiled graph, new offsets each call: they are device data); an
MoE block (gate/up grouped GEMM, SiLU-mul, down grouped GEMM) compiled with the default backends
runs and matches eager."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute
from inductor_cute.bench.suites.grouped_gemm import UNFUSED_CALL, gated_sites  # the gate as its op or an autotuned launcher

from .test_inductor_gpu import fresh_compile  # noqa: F401 (an autouse fixture: no_grad, fresh dynamo)

pytestmark = pytest.mark.gpu
DEV = "cuda"
OUR_CALL = "inductor_cute.inductor.grouped.runtime.GroupedLauncher("  # one definition per call site


def offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)


def reference(a, b, sizes):
    """fp32 a[group rows] @ b[g] for each group, stacked (the rows the offsets cover)."""
    out, row = [], 0
    for g, rows in enumerate(sizes):
        out.append(a[row:row + rows].double() @ b[g].double())
        row += rows
    return torch.cat(out)


def assert_close(out, ref, tol=2e-2):
    assert not out.isnan().any()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def run(fn, *args, backends="ICUTE"):
    with inductor_config.patch(max_autotune_gemm_backends=backends):
        out, codes = run_and_get_code(fn, *args)
    return out, "\n".join(codes)


def moe_up(x, w, offs):  # w (E, N, K) as MoE layers store it: b is its transposed view (K-major)
    return torch._grouped_mm(x, w.transpose(1, 2), offs)


def row_major(x, b, offs):  # b (E, K, N) row-major (N-major)
    return torch._grouped_mm(x, b, offs)


SIZES = {  # 8 groups over 2048 tokens (the last case leaves 48 rows past the last offset)
    "balanced": [256] * 8,
    "skewed": [1, 3, 1500, 64, 7, 300, 100, 73],
    "empty groups": [0, 700, 0, 0, 1300, 0, 48, 0],
    "tail": [100, 0, 900, 1, 0, 999, 0, 0],
}


@pytest.mark.parametrize("b_layout", ["row-major", "transposed"])
def test_three_d_by_three_d_runs_our_bmm_alone_and_matches_fp32(b_layout):
    # torch._grouped_mm on 3-D operands without offsets is a batched GEMM: our bmm's choices,
    # the only ones with ICUTE alone; an odd M (77) and a poisoned output
    g = torch.Generator(device=DEV).manual_seed(1)
    a = torch.randn(6, 77, 512, device=DEV, generator=g).bfloat16()
    w = torch.randn(6, 384, 512, device=DEV, generator=g).div_(512 ** 0.5).bfloat16()
    b = w.transpose(1, 2) if b_layout == "transposed" else w.transpose(1, 2).contiguous()
    torch.full((6 * 77 * 384 * 4,), float("nan"), device=DEV)  # freed: the output's memory comes back poisoned
    with inductor_cute.enable():
        out, code = run(torch.compile(lambda a, b: torch._grouped_mm(a, b), mode="max-autotune-no-cudagraphs"), a, b)
    assert "GemmLauncher(op='bmm'" in code and "extern_kernels._grouped_mm" not in code
    assert_close(out, a.double() @ b.double())


@pytest.mark.parametrize("fn,layout", [(moe_up, "k"), (row_major, "n")])
def test_our_kernel_alone_matches_fp32_for_balanced_skewed_and_empty_groups(fn, layout, caplog):
    tokens, k, n, groups = 2048, 1024, 768, 8
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(tokens, k, device=DEV, generator=g).bfloat16()
    shape = (groups, n, k) if layout == "k" else (groups, k, n)
    w = torch.randn(*shape, device=DEV, generator=g).div_(k ** 0.5).bfloat16()
    b = w.transpose(1, 2) if layout == "k" else w
    with inductor_cute.enable(), caplog.at_level("INFO", logger="inductor_cute"):
        fn_c = torch.compile(fn, mode="max-autotune-no-cudagraphs")
        for i, (name, sizes) in enumerate(SIZES.items()):
            out, code = run(fn_c, x, w, offsets(sizes))
            if i == 0:
                assert code.count(OUR_CALL) == 1 and "extern_kernels._grouped_mm" not in code
            covered = sum(sizes)
            assert_close(out[:covered], reference(x, b, sizes))
    assert f"(b {layout}-major)" in caplog.text and "dropped" not in caplog.text


def test_dynamic_tokens_match_fp32():
    k, n, groups = 512, 256, 4
    w = torch.randn(groups, n, k, device=DEV).div_(k ** 0.5).bfloat16()
    with inductor_cute.enable():
        fn_c = torch.compile(moe_up, mode="max-autotune-no-cudagraphs")
        for i, (tokens, sizes) in enumerate(((1000, [500, 0, 300, 200]), (333, [1, 330, 2, 0]), (4096, [1024] * 4))):
            x = torch.randn(tokens, k, device=DEV).bfloat16()
            torch._dynamo.mark_dynamic(x, 0)
            out, code = run(fn_c, x, w, offsets(sizes))
            if i == 0:
                assert code.count(OUR_CALL) == 1
            assert_close(out, reference(x, w.transpose(1, 2), sizes))


def moe_block(x, w13, w2, offs):
    """An expert MLP over tokens already sorted by expert: gate and up in one grouped GEMM, SiLU-mul,
    down; weights stored (E, out, in) as MoE layers keep them."""
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs)


@pytest.mark.parametrize("sizes", [[512] * 8, [0, 1800, 3, 0, 200, 45, 0, 0]], ids=["balanced", "skewed"])
def test_moe_block_with_default_backends_matches_eager(sizes, caplog):
    hidden, ffn, experts = 1024, 512, 8
    tokens = sum(sizes)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * ffn, hidden, device=DEV, generator=g).div_(hidden ** 0.5).bfloat16()
    w2 = torch.randn(experts, hidden, ffn, device=DEV, generator=g).div_(ffn ** 0.5).bfloat16()
    offs = offsets(sizes)
    # the plain products (the fusions, on by default under max-autotune, have their tests below)
    with inductor_cute.enable(fuse_moe_gate=False, fuse_moe_gather=False), \
            caplog.at_level("INFO", logger="inductor_cute"):
        backends = inductor_config.max_autotune_gemm_backends
        assert "ICUTE" in backends and "ATEN" in backends.upper()
        out = torch.compile(moe_block, mode="max-autotune-no-cudagraphs")(x, w13, w2, offs)
    assert caplog.text.count("choices for grouped_mm") == 2  # both GEMMs got our configs
    eager = moe_block(x, w13, w2, offs)
    h = reference(x, w13.transpose(1, 2), sizes).float()
    gate, up = h.chunk(2, dim=-1)
    want = reference((F.silu(gate) * up).bfloat16(), w2.transpose(1, 2), sizes)
    assert_close(eager, want)
    assert_close(out, want)
    assert_close(out, eager)




@pytest.mark.parametrize("sizes", [[512] * 8, [0, 1800, 3, 0, 200, 45, 0, 0]], ids=["balanced", "skewed"])
def test_the_fused_moe_gate_matches_eager(sizes, caplog):
    """enable(fuse_moe_gate=True): the gate/up GEMM and SiLU-mul become one gated grouped GEMM call;
    the block (down projection included) matches fp32 as the unfused one does."""
    hidden, ffn, experts = 1024, 512, 8
    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(sum(sizes), hidden, device=DEV, generator=g).bfloat16()
    w13 = torch.randn(experts, 2 * ffn, hidden, device=DEV, generator=g).div_(hidden ** 0.5).bfloat16()
    w2 = torch.randn(experts, hidden, ffn, device=DEV, generator=g).div_(ffn ** 0.5).bfloat16()
    offs = offsets(sizes)
    with inductor_cute.enable(fuse_moe_gate=True), caplog.at_level("INFO", logger="inductor_cute"):
        out, codes = run_and_get_code(torch.compile(moe_block, mode="max-autotune-no-cudagraphs"), x, w13, w2, offs)
    code = "\n".join(codes)
    # our gated kernel, or torch's unfused computation where autotuning found it faster
    assert gated_sites(code) + code.count(UNFUSED_CALL) == 1 and "fused 1 MoE gate" in caplog.text
    assert "configs of grouped_mm_gated" in caplog.text  # max-autotune with our backend: autotuned
    h = reference(x, w13.transpose(1, 2), sizes).float()
    gate, up = h.chunk(2, dim=-1)
    assert_close(out, reference((F.silu(gate) * up).bfloat16(), w2.transpose(1, 2), sizes))
