"""torch.compile with inductor-cute enabled, end to end on the H200: our GEMM is offered, chosen
when it is the only GEMM backend, matches eager, and falls back cleanly where it cannot run; the
launchers that output code calls stay correct on fresh data, poisoned outputs and new layouts."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute
from inductor_cute.runtime import CompiledKernelCache

pytestmark = pytest.mark.gpu
OUR_CALL = "inductor_cute.inductor.gemm.runtime.GemmLauncher("  # one definition per call site


def compiled_kernels() -> set[str]:
    """Keys of the compiled kernel objects in our cache (a kernel's first load adds a linked
    library beside its object: that is loading, not compiling)."""
    return {e.key for e in CompiledKernelCache().entries() if e.kind == "object"}


@pytest.fixture(autouse=True)
def fresh_compile():
    # Inference only: a backward graph would add weight-gradient GEMMs whose K is the token count.
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False), torch.no_grad():
        yield
    torch._dynamo.reset()


def compiled_run(fn, *args, backends="ICUTE", mode="max-autotune-no-cudagraphs", dynamic=None):
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends=backends):
        backends_now = inductor_config.max_autotune_gemm_backends
        assert "ICUTE" in backends_now
        out, codes = run_and_get_code(torch.compile(fn, mode=mode, dynamic=dynamic), *args)
    return out, "\n".join(codes)


def assert_close(out, ref, tol=2e-2):
    assert not out.isnan().any()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def test_enable_is_off_by_default_and_undone():
    assert "ICUTE" not in inductor_config.max_autotune_gemm_backends
    with inductor_cute.enable():
        assert "ICUTE" in inductor_config.max_autotune_gemm_backends
    assert "ICUTE" not in inductor_config.max_autotune_gemm_backends


def test_linear_stack_uses_our_kernel_with_bias():
    model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024, bias=False)).cuda().bfloat16()
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    out, code = compiled_run(model, x)
    assert code.count(OUR_CALL) == 2
    assert_close(out, model(x))


@pytest.mark.parametrize("act", [F.silu, lambda t: F.gelu(t, approximate="tanh")])
def test_mlp_competes_with_aten_and_matches_eager(act, caplog):
    w1 = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16) / 20
    w2 = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) / 40

    def mlp(x):
        return F.linear(act(F.linear(x, w1)), w2)

    x = torch.randn(333, 512, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="inductor_cute"):
        out, _ = compiled_run(mlp, x, backends="ATEN,ICUTE")
    assert "inductor-cute offers" in caplog.text
    assert_close(out, mlp(x))


def test_llama_style_decoder_block():
    d, hidden, heads = 1024, 2816, 8
    lin = lambda i, o: nn.Linear(i, o, bias=False).cuda().bfloat16()  # noqa: E731
    wq, wk, wv, wo, wg, wu, wd = lin(d, d), lin(d, d), lin(d, d), lin(d, d), lin(d, hidden), lin(d, hidden), lin(hidden, d)
    norm_w = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5

    def block(x):
        b, s, _ = x.shape
        h = F.rms_norm(x, (d,), norm_w)
        q, k, v = (w(h).view(b, s, heads, d // heads).transpose(1, 2) for w in (wq, wk, wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + wo(a)
        h = F.rms_norm(x, (d,), norm_w)
        return x + wd(F.silu(wg(h)) * wu(h))

    x = torch.randn(2, 128, d, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out, code = compiled_run(block, x)
        ref = block(x)
    assert code.count(OUR_CALL) >= 5
    assert_close(out, ref)


def test_bmm_and_baddbmm_attention_shapes():
    q = torch.randn(16, 200, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(16, 64, 200, device="cuda", dtype=torch.float16)
    bias = torch.randn(16, 200, 200, device="cuda", dtype=torch.float16)

    def scores(q, k, bias):
        return torch.bmm(q, k), torch.baddbmm(bias, q, k, alpha=0.125, beta=0.5)

    (s, sb), code = compiled_run(scores, q, k, bias)
    assert code.count(OUR_CALL) == 2
    assert_close(s, torch.bmm(q.float(), k.float()))
    assert_close(sb, torch.baddbmm(bias.float(), q.float(), k.float(), alpha=0.125, beta=0.5))


def test_dynamic_tokens_one_kernel_for_every_m():
    model = nn.Linear(1024, 2048).cuda().bfloat16()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(model, mode="max-autotune-no-cudagraphs")
        _, codes = run_and_get_code(fn, x)
        kernels = compiled_kernels()
        for m in (2, 77, 256, 1500):  # dynamo specialises M == 1 into its own graph
            y = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            assert_close(fn(y), model(y))
    assert OUR_CALL in "\n".join(codes)
    assert compiled_kernels() == kernels, "a new M compiled another kernel"


def test_cuda_graphs_mode():
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512)).cuda().bfloat16()
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(model, mode="max-autotune")
        for _ in range(3):  # warm-up, record, replay
            out = fn(x)
        x.copy_(torch.randn_like(x))
        out = fn(x).clone()
    assert_close(out, model(x))


@pytest.mark.parametrize("case", ["fp32", "odd_k"])
def test_unsupported_gemms_fall_back(case):
    dtype, k = (torch.float32, 512) if case == "fp32" else (torch.bfloat16, 1001)
    model = nn.Linear(k, 256).cuda().to(dtype)
    x = torch.randn(100, k, device="cuda", dtype=dtype)
    out, code = compiled_run(model, x, backends="ATEN,ICUTE")
    assert OUR_CALL not in code
    assert_close(out, model(x), tol=2e-2 if dtype != torch.float32 else 1e-3)


WARM_SCRIPT = textwrap.dedent("""
    import json, time, torch
    import inductor_cute
    from inductor_cute.runtime import CompiledKernelCache
    from torch._dynamo.utils import counters
    inductor_cute.enable()
    torch._inductor.config.max_autotune_gemm_backends = "ICUTE"
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = torch.nn.Linear(1024, 1024).cuda().bfloat16()
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    out = torch.compile(model, mode="max-autotune-no-cudagraphs")(x)
    torch.cuda.synchronize()
    err = ((out.float() - model(x).float()).norm() / model(x).float().norm()).item()
    print(json.dumps({"seconds": time.perf_counter() - start, "kernels": len(CompiledKernelCache().entries()),
                      "fx_hits": counters["inductor"]["fxgraph_cache_hit"], "err": err}))
""")


def test_second_process_reuses_fx_graph_and_kernels(tmp_path):
    import json

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               INDUCTOR_CUTE_CACHE_DIR=str(tmp_path / "cute"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", WARM_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["kernels"] > 0 and warm["kernels"] == cold["kernels"], "the warm process compiled kernels"
    assert warm["fx_hits"] >= 1, "the warm process did not reuse the compiled graph"
    assert cold["err"] < 2e-2 and warm["err"] < 2e-2
    print(f"cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s")


EPILOGUES = {
    "linear+gelu_tanh": lambda m, x, r: F.gelu(m(x), approximate="tanh"),
    "linear+silu*2+residual": lambda m, x, r: F.silu(m(x)) * 2 + r,
    "linear+relu+residual": lambda m, x, r: torch.relu(m(x)) + r,
}


@pytest.mark.parametrize("name", sorted(EPILOGUES))
def test_pointwise_epilogues_fuse_into_our_gemm(name):
    fn = EPILOGUES[name]
    model = nn.Linear(1024, 2048).cuda().bfloat16()
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    with inductor_cute.enable(fuse_epilogues=True), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        out, codes = run_and_get_code(torch.compile(lambda x, r: fn(model, x, r), mode="max-autotune-no-cudagraphs"),
                                      x, r)
    code = "\n".join(codes)
    assert code.count(OUR_CALL) == 1 and "epilogue=" in code, code[-3000:]
    assert "triton_" not in code.split("def call(")[-1], "a pointwise kernel was left outside the GEMM"
    assert_close(out, fn(model, x, r))


def test_fusion_on_3d_activations_with_dynamic_tokens_and_cuda_graphs():
    model = nn.Linear(1024, 2048).cuda().bfloat16()
    x = torch.randn(2, 300, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(2, 300, 2048, device="cuda", dtype=torch.bfloat16)

    def block(x, r):
        return F.gelu(model(x), approximate="tanh") + r

    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(r, 1)
    with inductor_cute.enable(fuse_epilogues=True), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(block, mode="max-autotune")
        out, codes = run_and_get_code(fn, x, r)
        out = out.clone()  # a CUDA-graph output is overwritten by the next replay
        for s in (77, 300, 513):  # other token counts, replayed through CUDA graphs
            y = torch.randn(2, s, 1024, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(2, s, 2048, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                got = fn(y, q)
            assert_close(got, block(y, q))
    code = "\n".join(codes)
    assert code.count(OUR_CALL) == 1 and "epilogue=" in code
    assert_close(out, block(x, r))


def test_baddbmm_with_beta_zero_ignores_a_nan_input():
    q = torch.randn(8, 128, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(8, 64, 128, device="cuda", dtype=torch.float16)
    junk = torch.full((8, 128, 128), float("nan"), device="cuda", dtype=torch.float16)

    def scores(junk, q, k):
        return torch.baddbmm(junk, q, k, beta=0.0, alpha=0.125)

    out, _ = compiled_run(scores, junk, q, k)
    assert_close(out, 0.125 * torch.bmm(q.float(), k.float()))


# ---- the launchers output code calls: remembered launches on fresh data, poisoned outputs, new layouts

BF16 = torch.bfloat16


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def poison_allocator(*shapes, dtype=BF16):
    """Fill blocks of these sizes with NaN and free them: the caching allocator hands them to the
    next allocations of the same sizes (a compiled graph's outputs), so an unwritten output shows."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape in shapes]
    torch.cuda.synchronize()
    del blocks


def torch_reference(op, inputs, kw, out_dtype):
    f = [t.float() for t in inputs]
    alpha, beta = kw.get("alpha", 1.0), kw.get("beta", 1.0)
    if op in ("addmm", "baddbmm"):
        inp, a, b = f
        return (alpha * (a @ b) + (beta * inp if beta else 0)).to(out_dtype)
    return (f[0] @ f[1]).to(out_dtype)


LAUNCHES = {  # name -> (op, launcher keywords, inputs for M rows)
    "mm": ("mm", {}, lambda m: (rand(m, 1024), rand(1024, 2048))),
    "mm linear weight": ("mm", {}, lambda m: (rand(m, 1024), rand(2048, 1024).t())),
    "gemv": ("mm", {}, lambda m: (rand(m, 4096), rand(4096, 4096).t())),
    "addmm row": ("addmm", {}, lambda m: (rand(2048), rand(m, 1024), rand(2048, 1024).t())),
    "addmm full": ("addmm", {"alpha": 0.5, "beta": 2.0}, lambda m: (rand(m, 2048), rand(m, 1024), rand(1024, 2048))),
    "bmm": ("bmm", {}, lambda m: (rand(8, m, 128), rand(8, 128, 256))),
    "baddbmm": ("baddbmm", {"alpha": 0.125, "beta": 0.5},
                lambda m: (rand(8, m, 256), rand(8, m, 128), rand(8, 256, 128).transpose(1, 2))),
}


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_a_launcher_stays_correct_on_fresh_data_poisoned_outputs_and_new_layouts(name):
    from inductor_cute import ops
    from inductor_cute.inductor.gemm import runtime
    from inductor_cute.kernels.gemm.family import as_tuple

    op, kw, make = LAUNCHES[name]
    m0 = 8 if name == "gemv" else 300
    inputs = make(m0)
    a, b = inputs[-2:]
    extra = {}
    if op in runtime.WITH_INPUT:
        inp = inputs[0]
        extra = {"bias": inp} if inp.dim() == 1 else {"c": inp, "alpha": kw["alpha"], "beta": kw["beta"]}
    launcher = runtime.GemmLauncher(op, as_tuple(ops.gemm_plan(a, b, **extra)[1]), **kw)
    seen = set()
    for m in (m0, m0, m0 // 2, m0, m0 // 2):  # a remembered layout, a new one (as a dynamic M), both again
        seen.add(m)
        for fresh_buffers in (False, True):
            if fresh_buffers:
                inputs = make(m)
            else:
                for t in inputs:
                    t.copy_(torch.randn_like(t))
            out_shape = (*inputs[-2].shape[:-1], inputs[-1].shape[-1])
            out = torch.full(out_shape, float("nan"), device="cuda", dtype=BF16)
            launcher.launch(*inputs, out)
            assert_close(out, torch_reference(op, inputs, kw, BF16))
        assert len(launcher._plans) == len(seen)
    a, b = inputs[-2:]  # another stride: a column-major A goes back through the checked path (a copy here)
    a_cm = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    inputs = (*inputs[:-2], a_cm, b)
    out = torch.full(out_shape, float("nan"), device="cuda", dtype=BF16)
    launcher.launch(*inputs, out)
    assert_close(out, torch_reference(op, inputs, kw, BF16))


def test_an_epilogue_launcher_stays_correct_on_fresh_data_and_new_sizes():
    from inductor_cute import ops
    from inductor_cute.inductor.gemm import runtime
    from inductor_cute.kernels.common.programs.epilogue import dumps
    from inductor_cute.kernels.gemm.family import as_tuple

    program = dumps([["v0", "add", "acc", "row"], ["v1", "sigmoid", "v0"], ["v2", "mul", "v0", "v1"],
                     ["v3", "add", "v2", "full"]])  # silu(acc + row) + full
    make = lambda m: (rand(m, 1024), rand(2048, 1024).t(), rand(2048), rand(m, 2048))  # noqa: E731
    a, w, row, full = make(500)
    config = as_tuple(ops.gemm_plan(a, w, bias=row, c=full, epilogue=program)[1])
    launch = runtime.GemmLauncher("mm", config, epilogue=program).launch
    for m in (500, 500, 77, 500):
        a, w, row, full = make(m)
        out = torch.full((m, 2048), float("nan"), device="cuda", dtype=BF16)
        launch(a, w, out, row, full)
        assert_close(out, F.silu(a.float() @ w.float() + row.float()) + full.float())
    assert len(launch.__self__._plans) == 2


def test_compiled_graphs_match_eager_on_fresh_data_and_new_sizes():
    linear = nn.Linear(1024, 2048).cuda().bfloat16()
    w2 = torch.randn(512, 2048, device="cuda", dtype=BF16) / 40

    def block(x, q, k):
        h = F.linear(F.silu(linear(x)), w2)  # addmm, mm
        return h, torch.baddbmm(h[:8].unsqueeze(0).expand(2, 8, 512).contiguous(), q, k, beta=0.5, alpha=0.125)

    def inputs(m):
        return rand(m, 1024), rand(2, 8, 64), rand(2, 64, 512)

    x, q, k = inputs(300)
    torch._dynamo.mark_dynamic(x, 0)
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(block, mode="max-autotune-no-cudagraphs")
        _, codes = run_and_get_code(fn, x, q, k)
        for m in (300, 300, 129, 300, 1000, 129):
            args = inputs(m)
            poison_allocator((m, 2048), (m, 512), (2, 8, 512))
            got = fn(*args)
            for g, r in zip(got, block(*args)):
                assert_close(g, r)
    assert "\n".join(codes).count(OUR_CALL) == 3


def test_compiled_decode_gemv_matches_eager_on_fresh_data():
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.SiLU(), nn.Linear(4096, 1024)).cuda().bfloat16()
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ICUTE"):
        fn = torch.compile(model, mode="max-autotune-no-cudagraphs")
        _, codes = run_and_get_code(fn, rand(4, 4096))
        for _ in range(3):
            x = rand(4, 4096)
            poison_allocator((4, 4096), (4, 1024))
            assert_close(fn(x), model(x))
    code = "\n".join(codes)
    assert code.count(OUR_CALL) == 2, code[-3000:]
