"""The Hopper GEMM on the H200 against an fp32 reference: layouts, dtypes, odd sizes, epilogues,
batches; every output poisoned first so an unwritten element shows."""

import pytest
import torch
import torch.nn.functional as F

from inductor_cute import UnsupportedError, ops
from inductor_cute.host import gemm as host_gemm
from inductor_cute.kernels.gemm.config import GemmConfig

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 2e-4}
SHAPES = [(1, 1000, 1000), (7, 3000, 1000), (65, 1000, 3000), (127, 3000, 1000), (1000, 1000, 3000),
          (3000, 3000, 1000), (8191, 1000, 1000),
          (4096, 8, 2048), (7, 8, 2048), (4093, 128, 2048)]  # MoE routers: 8 and 128 experts (16-byte rows)
ODD_K = [(1000, 1000, 7), (1000, 3000, 63), (136, 1000, 65), (3000, 1000, 127)]
ACTS = {"identity": lambda x: x, "relu": F.relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_erf": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def operand_a(m, k, major, dtype):
    if major == "k":
        return torch.randn(m, k, device="cuda", dtype=dtype)
    return torch.randn(k, m, device="cuda", dtype=dtype).t()  # column-major


def operand_b(k, n, major, dtype):
    if major == "n":
        return torch.randn(k, n, device="cuda", dtype=dtype)
    return torch.randn(n, k, device="cuda", dtype=dtype).t()  # an nn.Linear weight, transposed


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def check(out, ref, dtype):
    assert not out.isnan().any(), "unwritten (poisoned) or NaN elements in the output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def reference(a, b, bias=None, c=None, alpha=1.0, beta=1.0, act="identity"):
    x = alpha * (a.float() @ b.float())
    if bias is not None:
        x = x + bias.float()
    if c is not None:
        x = x + beta * c.float()
    return ACTS[act](x)


def cases():
    for dtype in (torch.bfloat16, torch.float16):
        for am in ("k", "m"):
            for bm in ("n", "k"):
                for m, n, k in SHAPES:
                    if am == "m" and m % 8:
                        continue
                    yield dtype, am, bm, m, n, k
        for m, n, k in ODD_K:
            yield dtype, "m", "n", m, n, k


CASES = list(cases())

PINGPONG = {
    "128x128-cluster2x1": GemmConfig(128, 128, 64, 2, 1, 6, 2, True, True),
    "64x256": GemmConfig(64, 256, 64, 1, 1, 5, 2, True, True),
    "128x96": GemmConfig(128, 96, 64, 1, 1, 5, 2, True, True),
}
# (config, A/B dtype, out dtype, a_major, b_major, m, n, k, epilogue). On 132 SMs most shapes give
# each CTA 2-4 tiles, so both consumer warp groups alternate; M=65 leaves the second one idle.
PINGPONG_CASES = [
    ("128x128-cluster2x1", torch.bfloat16, torch.bfloat16, "k", "k", 3000, 2048, 4096, "plain"),
    ("128x128-cluster2x1", torch.bfloat16, torch.bfloat16, "m", "n", 1000, 3000, 1000, "bias+residual+silu"),
    ("128x128-cluster2x1", torch.float16, torch.float16, "k", "n", 3000, 2048, 4096, "bias+gelu_tanh"),
    ("64x256", torch.bfloat16, torch.bfloat16, "k", "k", 3000, 2048, 4096, "residual"),
    ("64x256", torch.bfloat16, torch.bfloat16, "k", "n", 65, 4096, 4096, "bias+gelu_tanh"),
    ("64x256", torch.float16, torch.float16, "m", "k", 3000, 2048, 1000, "plain"),
    ("128x96", torch.float16, torch.float32, "m", "n", 3000, 1000, 127, "bias+silu"),
    ("128x96", torch.float16, torch.float16, "m", "n", 3000, 1000, 127, "bias+residual+silu"),
    ("128x96", torch.bfloat16, torch.bfloat16, "m", "n", 3000, 1000, 4095, "plain"),
]


def epilogue_args(kind, m, n, dtype):
    """ops.mm keyword arguments for one epilogue kind (bias and C in `dtype`)."""
    kw = {}
    if "bias" in kind:
        kw["bias"] = torch.randn(n, device="cuda", dtype=dtype)
    if "residual" in kind:
        kw.update(c=torch.randn(m, n, device="cuda", dtype=dtype), alpha=0.5, beta=-2.0)
    kw["activation"] = kind.split("+")[-1] if kind.split("+")[-1] in ACTS else "identity"
    return kw


def c_operand_config(pingpong):
    return GemmConfig(128, 128, 64, 1, 1, 5, 2, True, pingpong)


def pingpong_inputs(case):
    name, dtype, out_dtype, am, bm, m, n, k, kind = case
    a, b = operand_a(m, k, am, dtype), operand_b(k, n, bm, dtype)
    return a, b, epilogue_args(kind, m, n, out_dtype), dict(config=PINGPONG[name], out_dtype=out_dtype)


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every kernel this module uses in parallel worker processes first."""
    from inductor_cute.runtime import precompile

    specs = {}
    for dtype, am, bm, m, n, k in CASES:
        a, b = operand_a(m, k, am, dtype), operand_b(k, n, bm, dtype)
        specs[ops.gemm_spec_for(a, b)] = True
    a, b = operand_a(1000, 1000, "k", torch.bfloat16), operand_b(1000, 1000, "k", torch.bfloat16)
    bias, c = torch.randn(1000, device="cuda", dtype=torch.bfloat16), torch.randn(1000, 1000, device="cuda")
    for act in ACTS:
        specs[ops.gemm_spec_for(a, b, bias=bias, activation=act)] = True
    specs[ops.gemm_spec_for(a, b, c=c.bfloat16(), alpha=0.5, beta=-2.0)] = True
    specs[ops.gemm_spec_for(a, b, bias=bias, c=c, out_dtype=torch.float32, activation="silu")] = True
    for case in PINGPONG_CASES:
        a, b, epi, opts = pingpong_inputs(case)
        specs[ops.gemm_spec_for(a, b, **epi, **opts)] = True
    for pingpong in (False, True):
        a, b = operand_a(3000, 1024, "k", torch.bfloat16), operand_b(1024, 2048, "k", torch.bfloat16)
        specs[ops.gemm_spec_for(a, b, c=torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16),
                                config=c_operand_config(pingpong))] = True
    failed = [r for r in precompile(list(specs)) if r.status == "failed"]
    assert not failed, failed[0].error


@pytest.mark.parametrize("dtype,a_major,b_major,m,n,k", CASES,
                         ids=[f"{str(c[0])[6:]}-A{c[1]}-B{c[2]}-{c[3]}x{c[4]}x{c[5]}" for c in CASES])
def test_layouts_dtypes_and_sizes(dtype, a_major, b_major, m, n, k):
    a, b = operand_a(m, k, a_major, dtype), operand_b(k, n, b_major, dtype)
    out = ops.mm(a, b, out=poisoned((m, n), dtype))
    check(out, reference(a, b), dtype)


@pytest.mark.parametrize("act", list(ACTS))
def test_bias_and_activation_epilogues(act):
    a, b = operand_a(1000, 1000, "k", torch.bfloat16), operand_b(1000, 1000, "k", torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    out = ops.mm(a, b, bias=bias, activation=act, out=poisoned((1000, 1000), torch.bfloat16))
    check(out, reference(a, b, bias=bias, act=act), torch.bfloat16)


def test_residual_with_alpha_beta():
    a, b = operand_a(1000, 1000, "k", torch.bfloat16), operand_b(1000, 1000, "k", torch.bfloat16)
    c = torch.randn(1000, 1000, device="cuda", dtype=torch.bfloat16)
    out = ops.mm(a, b, c=c, alpha=0.5, beta=-2.0, out=poisoned((1000, 1000), torch.bfloat16))
    check(out, reference(a, b, c=c, alpha=0.5, beta=-2.0), torch.bfloat16)


def test_fp32_output_with_bias_residual_and_silu():
    a, b = operand_a(1000, 1000, "k", torch.bfloat16), operand_b(1000, 1000, "k", torch.bfloat16)
    bias, c = torch.randn(1000, device="cuda"), torch.randn(1000, 1000, device="cuda")
    out = ops.mm(a, b, bias=bias, c=c, out_dtype=torch.float32, activation="silu",
                 out=poisoned((1000, 1000), torch.float32))
    check(out, reference(a, b, bias=bias, c=c, act="silu"), torch.float32)


def test_batched_with_strided_and_broadcast_batches():
    big = torch.randn(3, 512 + 64, 1024, device="cuda", dtype=torch.bfloat16)
    a = big[:, :512, :]  # batch stride larger than the matrix
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = w.t().unsqueeze(0).expand(3, -1, -1)  # one weight for every batch (stride 0)
    out = ops.bmm(a, b, out=poisoned((3, 512, 1024), torch.bfloat16))
    check(out, torch.bmm(a.float(), b.float()), torch.bfloat16)


def test_nan_and_inf_propagate_like_torch():
    a, b = operand_a(256, 1024, "k", torch.float16), operand_b(1024, 512, "k", torch.float16)
    a[3, 5] = float("nan")
    a[7, 9] = float("inf")
    ours, theirs = ops.mm(a, b), torch.mm(a, b)
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ops.mm(a, b, activation="relu").isnan(), torch.relu(theirs).isnan())


def test_unaligned_sizes_are_refused():
    a = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        ops.mm(a, torch.randn(1000, 1001, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(UnsupportedError, match="multiple of 8"):
        ops.mm(torch.randn(64, 1001, device="cuda", dtype=torch.bfloat16),
               torch.randn(1001, 64, device="cuda", dtype=torch.bfloat16).t().contiguous().t())
    with pytest.raises(UnsupportedError, match="bfloat16 or float16"):
        ops.mm(torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"))


@pytest.mark.parametrize("case", PINGPONG_CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-{str(c[2])[6:]}-A{c[3]}-B{c[4]}-{c[5]}x{c[6]}x{c[7]}-{c[8]}"
                              for c in PINGPONG_CASES])
def test_pingpong_schedule(case):
    a, b, epi, opts = pingpong_inputs(case)
    m, n, out_dtype = a.shape[0], b.shape[1], opts["out_dtype"]
    out = ops.mm(a, b, **epi, **opts, out=poisoned((m, n), out_dtype))
    check(out, reference(a, b, bias=epi.get("bias"), c=epi.get("c"), alpha=epi.get("alpha", 1.0),
                         beta=epi.get("beta", 1.0), act=epi["activation"]), out_dtype)


@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "pingpong"])
def test_c_operand_streams_through_its_own_producer_warp(pingpong):
    """Several tiles per CTA, each with a C tile to load while A/B of the next tile stream in."""
    a, b = operand_a(3000, 1024, "k", torch.bfloat16), operand_b(1024, 2048, "k", torch.bfloat16)
    c = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16)
    out = ops.mm(a, b, c=c, alpha=0.5, beta=-2.0, config=c_operand_config(pingpong),
                 out=poisoned((3000, 2048), torch.bfloat16))
    check(out, reference(a, b, c=c, alpha=0.5, beta=-2.0), torch.bfloat16)


def test_pingpong_config_is_checked():
    a, b = operand_a(256, 256, "k", torch.bfloat16), operand_b(256, 256, "k", torch.bfloat16)
    with pytest.raises(UnsupportedError, match="pingpong needs persistent"):
        ops.mm(a, b, config=GemmConfig(128, 128, 64, 1, 1, 4, 2, False, True))
    with pytest.raises(UnsupportedError, match="fp32 C operand"):
        ops.mm(a, b, c=torch.randn(256, 256, device="cuda"), out_dtype=torch.float32,
               config=GemmConfig(128, 96, 64, 1, 1, 4, 2, True, True))


def test_repeat_calls_take_the_fast_path_and_stay_correct():
    host_gemm._FAST_PATHS.clear()
    a, b = operand_a(1000, 1024, "k", torch.bfloat16), operand_b(1024, 2048, "k", torch.bfloat16)
    bias, c = torch.randn(2048, device="cuda", dtype=torch.bfloat16), torch.randn(1000, 2048, device="cuda",
                                                                                 dtype=torch.bfloat16)
    out = poisoned((1000, 2048), torch.bfloat16)
    ops.mm(a, b, bias=bias, c=c, out=out)
    assert len(host_gemm._FAST_PATHS) == 1
    for t in (a, b, bias, c):  # fresh values in the same buffers, then a poisoned output
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    ops.mm(a, b, bias=bias, c=c, out=out)
    assert len(host_gemm._FAST_PATHS) == 1
    check(out, reference(a, b, bias=bias, c=c), torch.bfloat16)
    # an operand that must be copied (odd row stride) never takes the fast path
    wide = torch.randn(1000, 1027, device="cuda", dtype=torch.bfloat16)[:, :1024]
    ops.mm(wide, b, out=out)
    assert len(host_gemm._FAST_PATHS) == 1
    check(out, reference(wide, b), torch.bfloat16)


def test_epilogue_program_with_row_and_full_operands():
    from inductor_cute.kernels.common.programs.epilogue import dumps

    program = dumps([["v0", "add", "acc", "row"], ["v1", "sigmoid", "v0"], ["v2", "mul", "v0", "v1"],
                     ["v3", "maximum", "v2", "full"], ["v4", "gt", "v0", 0.5], ["v5", "where", "v4", "v3", "full"]])
    a, b = operand_a(1000, 1024, "k", torch.bfloat16), operand_b(1024, 2048, "k", torch.bfloat16)
    row, full = torch.randn(2048, device="cuda", dtype=torch.bfloat16), torch.randn(1000, 2048, device="cuda",
                                                                                  dtype=torch.bfloat16)
    full[3, 7] = float("nan")  # maximum propagates NaN like torch
    out = ops.mm(a, b, bias=row, c=full, epilogue=program, out=poisoned((1000, 2048), torch.bfloat16))
    x = a.float() @ b.float() + row.float()
    ref = torch.where(x > 0.5, torch.maximum(F.silu(x), full.float()), full.float())
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert ((out.float()[keep] - ref[keep]).norm() / ref[keep].norm()).item() < TOL[torch.bfloat16]
