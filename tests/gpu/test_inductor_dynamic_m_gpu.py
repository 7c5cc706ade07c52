"""A dynamic-M graph with only our GEMMs (max_autotune_gemm_backends="ICUTE") on the H200: the
M-bucket table (inductor/gemm/buckets.py) is what output code defines, every bucket's kernel is
compiled before the first call, and each call's bucket (the GEMV at 1 and 8 rows, small tiles,
the persistent large tile) matches eager on fresh data with poisoned outputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute
from inductor_cute.runtime import CompiledKernelCache

from .test_inductor_gpu import compiled_kernels, fresh_compile  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
OUR_CALL = "inductor_cute.inductor.gemm.runtime.GemmLauncher("
HIDDEN, INTERMEDIATE = 1024, 2816
MS = (1, 17, 512, 4096, 8, 4096, 1, 17)  # every bucket, then back to remembered layouts


def described(keys: set[str]) -> list:
    """What the cache's headers say about these kernels (for a failure message)."""
    return [{k: v for k, v in e.header.items() if k not in ("sha256", "created")}
            for e in CompiledKernelCache().entries() if e.key in keys]


def rand(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=BF16) * scale


def poison_allocator(*shapes):
    """NaN blocks of these sizes, freed: the caching allocator hands them to the graph's outputs."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=BF16) for shape in shapes]
    torch.cuda.synchronize()
    del blocks


def assert_close(out, ref, tol=2e-2):
    assert not out.isnan().any()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_dynamic_m_mlp_runs_every_bucket_and_matches_eager(fuse):
    up, down = nn.Linear(HIDDEN, INTERMEDIATE), nn.Linear(INTERMEDIATE, HIDDEN)
    for layer, fan_in in ((up, HIDDEN), (down, INTERMEDIATE)):  # parameters: static shapes under dynamic=True
        layer.to("cuda", BF16).requires_grad_(False)
        layer.weight.copy_(rand(*layer.weight.shape, scale=fan_in ** -0.5))
        layer.bias.copy_(rand(*layer.bias.shape, scale=0.1))

    def block(x):  # the gemm_dynamic suite's graph, smaller
        return x + down(F.gelu(up(x), approximate="tanh"))

    codes = []
    with inductor_cute.enable(fuse_epilogues=fuse), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(block, mode="max-autotune-no-cudagraphs", dynamic=True)
        for m in MS[:2]:  # dynamo specialises 1 row; the dynamic graph is made at 17
            _, code = run_and_get_code(fn, rand(m, HIDDEN))
            codes += code
        kernels = compiled_kernels()
        for m in MS:
            x = rand(m, HIDDEN)
            poison_allocator((m, HIDDEN), (m, INTERMEDIATE))
            assert_close(fn(x), block(x))
    dynamic = codes[-1]
    assert dynamic.count(OUR_CALL) == 2, dynamic[-3000:]
    assert dynamic.count("config=('m_buckets', ") == 2, "each GEMM's launcher carries its M-bucket table"
    assert "('gemv', " in dynamic  # the K-major weights let the GEMV serve M <= 16
    late = compiled_kernels() - kernels
    assert not late, f"kernels compiled at their first call: {described(late)}"


def test_dynamic_m_bmm_matches_eager_in_every_bucket():
    k = rand(8, 128, 256)

    def scores(q):
        return torch.bmm(q, k) * 0.125

    q = rand(8, 17, 128)
    torch._dynamo.mark_dynamic(q, 1)  # M only: batch, K and N stay static
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(scores, mode="max-autotune-no-cudagraphs")
        _, codes = run_and_get_code(fn, q)
        for m in (2, 17, 512, 4096, 17):
            q = rand(8, m, 128)
            poison_allocator((8, m, 256))
            assert_close(fn(q), (torch.bmm(q.float(), k.float()) * 0.125).to(BF16))
    code = "\n".join(codes)
    assert "config=('m_buckets', " in code and "('gemv', " not in code  # the GEMV is not batched
