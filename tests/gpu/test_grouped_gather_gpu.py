"""The grouped GEMM with its A rows gathered through a row index (ops rows=, the MoE permute fused
into the A loads) on the GPU: against an fp32 reference of a[rows] @ b[g], bit for bit against the
same config run on the gathered copy, gated too, every candidate config, int32 and int64 indices,
tokens repeated as top-k routing repeats them, CUDA-graph replay with new rows, and an index out of
a's rows stopping the kernel with an error (in a subprocess: the error ends its CUDA context)."""

import re
import subprocess
import sys
import textwrap

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host.grouped_gemm import grouped_mm, grouped_mm_gated
from inductor_cute.kernels.gemm.grouped_config import GroupedConfig, GroupedProblem, candidates

from .test_grouped_gemm_gpu import SIZES, offsets, reference, weights

pytestmark = pytest.mark.gpu

DEV = "cuda"


def routed(sizes, tokens, seed=0, dtype=torch.int64):
    """(x (tokens, K) inputs are made by the caller) a row index of sum(sizes) rows: every token
    repeated, in a shuffled order, as a top-k router's sorted pairs index their tokens."""
    g = torch.Generator(device=DEV).manual_seed(seed + 7)
    return torch.randint(tokens, (sum(sizes),), device=DEV, generator=g).to(dtype)


def check(sizes, k, n, layout="k", tokens=300, config=None, dtype=torch.int64, seed=0, spare=5):
    """Poisoned output with `spare` rows past the last offset; returns (out, x, rows, b, offs)."""
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = torch.randn(tokens, k, device=DEV, generator=g).bfloat16()
    covered = sum(sizes)
    rows = torch.cat([routed(sizes, tokens, seed, dtype), torch.zeros(spare, device=DEV, dtype=dtype)])
    b = weights(len(sizes), k, n, layout, seed)
    offs = offsets(sizes)
    out = torch.full((covered + spare, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    got = grouped_mm(x, b, offs, out=out, config=config, rows=rows)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    ref = reference(x[rows[:covered]], b, sizes)
    assert not out[:covered].isnan().any(), "rows of some group were not written"
    torch.testing.assert_close(out[:covered].float(), ref, atol=2e-2, rtol=2e-2)
    assert out[covered:].isnan().all(), "rows past the last offset were written"
    return out, x, rows, b, offs


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("layout", ["k", "n"])
def test_matches_fp32_reference(name, layout):
    check(SIZES[name], 512, 384, layout)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,k", [(8, 8), (40, 24), (264, 1000)])
def test_index_dtypes_and_ragged_sizes(dtype, n, k):
    check([3, 130, 0, 77], k, n, dtype=dtype, tokens=17)


GATHERED = GroupedProblem(rows="int64")
CONFIGS = candidates(GATHERED, 2048, 512, 512, groups=16, exhaustive=True, clusters=True) + [
    GroupedConfig(128, 256, 64, 4, 2, cluster_m=2, overlap_last=True, staged_partial=True),
    GroupedConfig(64, 128, 64, 8, 1, overlap_last=True, staged_partial=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe().replace(" ", "-"))
@pytest.mark.parametrize("name", ["skewed", "unaligned-offsets", "many-groups", "equal"])
def test_every_candidate_config_is_bit_identical_to_the_gathered_copy(name, config):
    out, x, rows, b, offs = check(SIZES[name], 512, 512, config=config)
    covered = sum(SIZES[name])
    copy = torch.full_like(out, float("nan"))
    grouped_mm(x[rows], b, offs, out=copy, config=config)
    assert torch.equal(out[:covered], copy[:covered])


@pytest.mark.parametrize("config", [None, GroupedConfig(128, 256, 64, 4, 2, cluster_m=2)],
                         ids=["default", "2x1"])
@pytest.mark.parametrize("layout", ["k", "n"])
def test_gated_is_bit_identical_to_the_gathered_copy(layout, config):
    sizes = SIZES["skewed"]
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(250, 256, device=DEV, generator=g).bfloat16()
    rows = routed(sizes, 250)
    b = weights(len(sizes), 256, 512, layout)
    offs = offsets(sizes)
    got = grouped_mm_gated(x, b, offs, "silu", config=config, rows=rows)
    want = grouped_mm_gated(x[rows], b, offs, "silu", config=config)
    gate, up = reference(x[rows], b, sizes).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, atol=3e-2, rtol=3e-2)
    assert torch.equal(got, want)


def test_moe_routing_shape():
    """Qwen3-30B-A3B's up projection at 4096 tokens: 32768 rows over 128 experts, each token 8 times."""
    tokens, experts, top_k = 4096, 128, 8
    g = torch.Generator(device=DEV).manual_seed(11)
    ids = torch.randint(experts, (tokens * top_k,), device=DEV, generator=g)
    order = torch.argsort(ids, stable=True)
    sizes = torch.bincount(ids, minlength=experts).tolist()
    x = torch.randn(tokens, 2048, device=DEV, generator=g).bfloat16()
    b = weights(experts, 2048, 1536, "k")
    offs = offsets(sizes)
    got = grouped_mm(x, b, offs, rows=order // top_k)
    want = torch._grouped_mm(x[order // top_k], b, offs=offs)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_cuda_graph_replays_with_new_rows():
    sizes = [100, 0, 37, 260]
    x = torch.randn(90, 128, device=DEV).bfloat16()
    b = weights(len(sizes), 128, 256, "k")
    offs = offsets(sizes)
    rows = routed(sizes, 90, seed=1)
    out = torch.empty(sum(sizes), 256, device=DEV, dtype=torch.bfloat16)
    grouped_mm(x, b, offs, out=out, rows=rows)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_mm(x, b, offs, out=out, rows=rows)
    for seed in (2, 3):
        rows.copy_(routed(sizes, 90, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), reference(x[rows], b, sizes), atol=2e-2, rtol=2e-2)


def test_inputs_are_checked():
    x = torch.randn(10, 64, device=DEV).bfloat16()
    b = weights(2, 64, 64, "k")
    offs = offsets([3, 4])
    with pytest.raises(UnsupportedError, match="rows must be a 1-D int32 or int64"):
        grouped_mm(x, b, offs, rows=torch.zeros(7, device=DEV))
    with pytest.raises(UnsupportedError, match="a has none"):
        grouped_mm(x[:0], b, offs, rows=torch.zeros(7, device=DEV, dtype=torch.int64))
    with pytest.raises(UnsupportedError, match="tile_k must be 64"):
        grouped_mm(x, b, offs, rows=torch.zeros(7, device=DEV, dtype=torch.int64),
                   config=GroupedConfig(128, 128, 128, 4, 2))


@pytest.mark.parametrize("bad", [10, -11])
def test_an_index_outside_the_tokens_stops_the_kernel(bad):
    script = textwrap.dedent(f"""
        import torch
        from inductor_cute.host.grouped_gemm import grouped_mm
        x = torch.randn(10, 64, device="cuda").bfloat16()
        b = torch.randn(2, 64, 64, device="cuda").bfloat16()
        offs = torch.tensor([3, 7], device="cuda", dtype=torch.int32)
        rows = torch.tensor([0, 1, 2, 3, 9, -10, 6], device="cuda")  # -10: a's first row, as torch counts
        torch.testing.assert_close(grouped_mm(x, b, offs, rows=rows).float(),
                                   torch._grouped_mm(x[rows], b, offs=offs).float(), atol=2e-2, rtol=2e-2)
        print("valid rows ran", flush=True)
        rows[4] = {bad}
        out = grouped_mm(x, b, offs, rows=rows)
        torch.cuda.synchronize()
        print("no error", out.float().sum().item())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "valid rows ran" in done.stdout, done.stderr[-2000:]
    assert done.returncode != 0 and "no error" not in done.stdout, done.stdout
    # the trap ends the launch: reported as an unspecified launch failure (or illegal instruction)
    assert re.search(r"unspecified launch failure|illegal instruction", done.stderr.lower()), done.stderr[-2000:]


def test_index_entries_past_the_last_offset_are_never_read():
    """A capacity-sized index whose tail (past offs[-1]) holds garbage, as a static buffer may."""
    sizes = [5, 0, 130, 9]
    x = torch.randn(50, 64, device=DEV).bfloat16()
    b = weights(len(sizes), 64, 128, "k")
    rows = torch.cat([routed(sizes, 50), torch.full((200,), -(10 ** 9), device=DEV, dtype=torch.int64)])
    out = torch.full((rows.numel(), 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    grouped_mm(x, b, offsets(sizes), out=out, rows=rows)
    torch.cuda.synchronize()
    covered = sum(sizes)
    torch.testing.assert_close(out[:covered].float(), reference(x[rows[:covered]], b, sizes), atol=2e-2, rtol=2e-2)
    assert out[covered:].isnan().all()


def test_k_not_a_multiple_of_the_tile_reads_nothing_past_a_row():
    """K = 72 in rows 80 elements apart whose padding is NaN: the last k-tile's pieces past K are
    zero-filled, not read (a NaN there would reach every output of the row)."""
    sizes = [40, 0, 77]
    padded = torch.full((60, 80), float("nan"), device=DEV, dtype=torch.bfloat16)
    padded[:, :72] = torch.randn(60, 72, device=DEV).bfloat16()
    x = padded[:, :72]
    b = weights(len(sizes), 72, 64, "n")
    rows = routed(sizes, 60)
    out = grouped_mm(x, b, offsets(sizes), rows=rows)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(x[rows], b, sizes), atol=2e-2, rtol=2e-2)
