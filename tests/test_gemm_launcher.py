"""The host path of a compiled graph's GEMM (CPU tensors, recorded kernels): a GemmLauncher's
remembered launch passes the kernel exactly what the checked path passes (views, strides,
scalars, GEMV workspace sizes), and any other layout goes back through the checked path."""

import pytest
import torch

from inductor_cute import ops
from inductor_cute.host import gemm as host_gemm
from inductor_cute.inductor.gemm import runtime
from inductor_cute.inductor.gemm.runtime import GemmLauncher
from inductor_cute.kernels.common.programs.epilogue import dumps, reference
from inductor_cute.kernels.gemm.family import as_tuple
from inductor_cute.kernels.gemm.gemv_config import GemvConfig, splits, workspace_sizes

BF16 = torch.bfloat16
ROW_AND_FULL = dumps([["v0", "add", "acc", "row"], ["v1", "sigmoid", "v0"], ["v2", "mul", "v1", "full"]])
FULL_ONLY = dumps([["v0", "add", "acc", "full"]])
ACC_ONLY = dumps([["v0", "relu", "acc"]])


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, dtype=dtype)


def like(t):
    """A new tensor of t's layout (strides, broadcasts and storage offset kept), fresh values."""
    if t is None:
        return None
    base = torch.randn(t.storage_offset() + t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


# name -> (op, launcher keywords, a maker of the tensors as `launch` takes them)
CASES = {
    "mm": ("mm", {}, lambda: (rand(64, 128), rand(128, 256), rand(64, 256))),
    "mm K-major weight": ("mm", {}, lambda: (rand(200, 128), rand(256, 128).t(), rand(200, 256))),
    "mm M-major A": ("mm", {}, lambda: (rand(128, 64).t(), rand(128, 256), rand(64, 256))),
    "gemv": ("mm", {}, lambda: (rand(8, 4096), rand(512, 4096).t(), rand(8, 512))),
    "gemv one row": ("mm", {}, lambda: (rand(1, 512), rand(256, 512).t(), rand(1, 256))),
    "addmm row (2.13)": ("addmm", {}, lambda: (rand(256), rand(64, 128), rand(128, 256), rand(64, 256))),
    "addmm row (2.11)": ("addmm", {}, lambda: (rand(256).expand(64, 256), rand(64, 128), rand(128, 256),
                                              rand(64, 256))),
    "addmm full": ("addmm", {"alpha": 2.0, "beta": 0.5}, lambda: (rand(64, 256), rand(64, 128), rand(128, 256),
                                                                 rand(64, 256))),
    "addmm beta 0": ("addmm", {"beta": 0.0}, lambda: (torch.full((64, 256), float("nan"), dtype=BF16),
                                                     rand(64, 128), rand(128, 256), rand(64, 256))),
    "gemv addmm row": ("addmm", {}, lambda: (rand(512), rand(4, 1024), rand(512, 1024).t(), rand(4, 512))),
    "bmm": ("bmm", {}, lambda: (rand(4, 64, 128), rand(4, 128, 256), rand(4, 64, 256))),
    "bmm transposed B": ("bmm", {}, lambda: (rand(4, 64, 128), rand(4, 256, 128).transpose(1, 2),
                                             rand(4, 64, 256))),
    "baddbmm row": ("baddbmm", {}, lambda: (rand(256).expand(4, 64, 256), rand(4, 64, 128), rand(4, 128, 256),
                                            rand(4, 64, 256))),
    "baddbmm full": ("baddbmm", {"alpha": 0.125, "beta": 0.5},
                     lambda: (rand(4, 64, 256), rand(4, 64, 128), rand(4, 128, 256), rand(4, 64, 256))),
    "epilogue row and full": ("mm", {"epilogue": ROW_AND_FULL},
                              lambda: (rand(64, 128), rand(256, 128).t(), rand(64, 256), rand(256), rand(64, 256))),
    "epilogue full only": ("mm", {"epilogue": FULL_ONLY},
                           lambda: (rand(64, 128), rand(128, 256), rand(64, 256), None, rand(64, 256))),
    "epilogue fp32 out": ("mm", {"epilogue": ACC_ONLY},
                          lambda: (rand(64, 128), rand(128, 256), rand(64, 256, dtype=torch.float32), None, None)),
    "bmm epilogue": ("bmm", {"epilogue": FULL_ONLY},
                     lambda: (rand(4, 64, 128), rand(4, 128, 256), rand(4, 64, 256), None, rand(4, 64, 256))),
}


def launcher_for(op, kw, sources) -> GemmLauncher:
    """The launcher output code would define for these tensors: their GEMM's default config."""
    if kw.get("epilogue"):
        a, b, out, row, full = sources
        plan = ops.gemm_plan(a, b, bias=row, c=full, out=out, epilogue=kw["epilogue"])
    else:
        *inputs, out = sources
        a, b = inputs[-2:]
        bias = c = None
        if op in runtime.WITH_INPUT:
            role = runtime.input_role(inputs[0].shape, inputs[0].stride(), out.shape[-1], kw.get("beta", 1.0))
            bias = inputs[0][(0,) * (inputs[0].dim() - 1)] if role == "row" else None
            c = inputs[0] if role == "full" else None
        plan = ops.gemm_plan(a, b, bias=bias, c=c, out=out, alpha=kw.get("alpha", 1.0),
                             beta=kw.get("beta") if c is not None else None)
    return GemmLauncher(op, as_tuple(plan[1]), **kw)


@pytest.fixture
def checked_runs(monkeypatch):
    """How many times the checked path has planned a GEMM."""
    runs = []
    prepare = host_gemm._prepare_gemm
    monkeypatch.setattr(host_gemm, "_prepare_gemm", lambda *a, **k: runs.append(1) or prepare(*a, **k))
    return runs


def assert_same_arguments(got, want):
    assert len(got) == len(want)
    gemv = len(want) == 9  # A, B, D, C, bias, partials, counters, alpha, beta
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            assert g == w, f"argument {i}: {g!r} != {w!r}"
            continue
        assert isinstance(g, torch.Tensor), f"argument {i}"
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype), f"argument {i}"
        if gemv and i in (5, 6):  # the workspace: fresh each launch
            if i == 6 and not w.any():
                assert not g.any(), "the split counters must start at zero"
            continue
        assert (g.data_ptr(), g.storage_offset()) == (w.data_ptr(), w.storage_offset()), f"argument {i}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_remembered_launch_passes_what_the_checked_path_passes(name, cpu_gemm_kernels, checked_runs):
    op, kw, make = CASES[name]
    first = make()
    launcher = launcher_for(op, kw, first)
    runs = len(checked_runs)
    launcher.launch(*first)  # checked, and remembered
    assert len(checked_runs) == runs + 1 and len(cpu_gemm_kernels.launches) == 1
    fresh = tuple(like(t) for t in first)  # same layouts, other memory
    launcher.launch(*fresh)
    assert len(checked_runs) == runs + 1, "a repeat took the checked path"
    planned = cpu_gemm_kernels.args
    launcher.checked(fresh)
    assert len(checked_runs) == runs + 2
    assert_same_arguments(planned, cpu_gemm_kernels.args)
    assert cpu_gemm_kernels.launches[-1][0] == cpu_gemm_kernels.launches[-2][0]  # one kernel
    if name == "addmm beta 0":
        assert planned[3] is None and planned[4] is None  # torch ignores the input (and its NaNs)


def reference_kernel(spec):
    """A kernel computing on the CPU from exactly the views it is given, as the real one would."""
    epilogue = spec.kwargs["epilogue"]

    def kernel(*args):
        if len(args) == 9:  # the GEMV: 2-D A, W, D, C, then bias, its workspace, the scalars
            a, b, d, c = (t.unsqueeze(-1) if t is not None else None for t in args[:4])
            bias, alpha, beta = args[4], *args[7:]
        else:  # the GEMM: (M, K, L), (N, K, L), (M, N, L), (M, N, L), (N,)
            a, b, d, c, bias, alpha, beta = args
        lmn = lambda t: t.permute(2, 0, 1).float()  # noqa: E731
        acc = lmn(a) @ lmn(b).transpose(1, 2)
        row = bias.float() if bias is not None else None
        full = lmn(c) if c is not None else None
        if epilogue:
            y = reference(epilogue, acc, row, full)
        else:
            y = alpha * acc + (row if row is not None else 0) + (beta * full if full is not None else 0)
        d.permute(2, 0, 1).copy_(y)

    return kernel


def expected(op, kw, sources):
    f = [t.float() if t is not None else None for t in sources]
    if kw.get("epilogue"):
        a, b, _, row, full = f
        return reference(kw["epilogue"], a @ b, row, full)
    alpha, beta = kw.get("alpha", 1.0), kw.get("beta", 1.0)
    if op in runtime.WITH_INPUT:
        inp, a, b, _ = f
        return alpha * (a @ b) + (beta * inp if beta else 0)
    return f[0] @ f[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_remembered_launches_compute_the_gemm_on_new_data(name, cpu_gemm_kernels, monkeypatch):
    op, kw, make = CASES[name]
    monkeypatch.setattr(host_gemm, "get_kernel", reference_kernel)
    sources = make()
    launcher = launcher_for(op, kw, sources)
    i_out = 2 if kw.get("epilogue") else len(sources) - 1
    for _ in range(3):  # checked, then remembered twice: fresh data and a poisoned output each time
        sources = tuple(like(t) for t in sources)
        sources[i_out].fill_(float("nan"))
        launcher.launch(*sources)
        want = expected(op, kw, sources)
        torch.testing.assert_close(sources[i_out].float(), want.to(sources[i_out].dtype).float(),
                                   atol=0.05, rtol=0.02)
    assert len(launcher._plans) == 1


def test_gemv_workspace_matches_the_config(cpu_gemm_kernels, checked_runs):
    op, kw, make = CASES["gemv"]
    sources = make()
    launcher = launcher_for(op, kw, sources)
    config = runtime._config(launcher.config)
    assert isinstance(config, GemvConfig) and splits(4096, config) > 1
    runs = len(checked_runs)
    for _ in range(2):
        launcher.launch(*sources)
        args = cpu_gemm_kernels.args
        n_partials, n_counters = workspace_sizes(512, 4096, config)
        assert args[5].shape == (n_partials,) and args[5].dtype == torch.float32
        assert args[6].shape == (n_counters,) and args[6].dtype == torch.int32 and not args[6].any()
    assert len(checked_runs) == runs + 1


def test_another_layout_goes_back_through_the_checked_path(cpu_gemm_kernels, checked_runs):
    op, kw, make = CASES["mm"]
    a, b, out = make()
    launcher = launcher_for(op, kw, (a, b, out))
    runs = len(checked_runs)

    def launch(*sources, checked: bool):
        before = len(checked_runs)
        launcher.launch(*sources)
        assert len(checked_runs) == before + checked
        return cpu_gemm_kernels.launches[-1]

    launch(a, b, out, checked=True)
    launch(a, b, out, checked=False)
    _, args = launch(a[:40], b, out[:40], checked=True)  # another M (a dynamic size)
    assert args[0].shape[0] == 40 and args[2].shape[0] == 40
    launch(a[:40], b, out[:40], checked=False)
    launch(a, b, out, checked=False)  # both sizes are remembered
    spec, _ = launch(a.t().contiguous().t(), b, out, checked=True)  # same shape, column-major
    assert spec.kwargs["a_major"] == "m"
    spec, _ = launch(a.half(), b.half(), out.half(), checked=True)  # another dtype
    assert spec.kwargs["dtype_name"] == "float16"
    assert len(launcher._plans) == 4 and None not in launcher._plans.values()
    assert len(checked_runs) == runs + 4


def test_copied_operands_are_never_remembered(cpu_gemm_kernels, checked_runs):
    a, b, out = CASES["mm"][2]()
    launcher = launcher_for("mm", {}, (a, b, out))
    skewed = torch.randn(1 + a.numel(), dtype=BF16)[1:].view(a.shape)  # 2 bytes past an aligned address
    runs = len(checked_runs)
    for _ in range(2):
        launcher.launch(skewed, b, out)
        assert cpu_gemm_kernels.args[0].data_ptr() != skewed.data_ptr()  # a copy, every time
    assert len(checked_runs) == runs + 2 and list(launcher._plans.values()) == [None]
    # a scaled 1-D addmm input is C broadcast along M: TMA cannot read a zero row stride
    row, a, b, out = CASES["addmm row (2.13)"][2]()
    scaled = launcher_for("addmm", {"beta": 0.5}, (row, a, b, out))
    for _ in range(2):
        scaled.launch(row, a, b, out)
        assert torch.equal(cpu_gemm_kernels.args[3][:, :, 0], row.expand(64, 256))
    assert list(scaled._plans.values()) == [None]


def test_eager_repeats_take_the_fast_path(cpu_gemm_kernels, checked_runs):
    a, w, bias = rand(64, 128), rand(256, 128), rand(256)
    runs = len(checked_runs)
    out = ops.mm(a, w.t(), bias=bias)  # out=None: remembered with its shape
    checked = cpu_gemm_kernels.args
    again = ops.mm(a, w.t(), bias=bias)
    assert len(checked_runs) == runs + 1 and again.shape == out.shape and again.data_ptr() != out.data_ptr()
    assert_same_arguments(cpu_gemm_kernels.args[:2] + cpu_gemm_kernels.args[3:], checked[:2] + checked[3:])
    assert cpu_gemm_kernels.args[2].data_ptr() == again.data_ptr()
    ops.mm(a, w.t(), bias=bias, out=out)  # with out: another key
    ops.mm(a, w.t(), bias=bias, out=out)
    assert len(checked_runs) == runs + 2 and len(host_gemm._FAST_PATHS) == 2
    assert_same_arguments(cpu_gemm_kernels.args, checked)
    ops.mm(a, w.t(), bias=bias.float(), out=out)  # a cast bias is a copy: checked, not remembered
    assert len(checked_runs) == runs + 3 and len(host_gemm._FAST_PATHS) == 2


def test_runtime_gemm_shares_one_launcher_per_call(cpu_gemm_kernels, checked_runs):
    a, b, out = CASES["mm"][2]()
    config = launcher_for("mm", {}, (a, b, out)).config
    runs = len(checked_runs)
    for _ in range(3):
        runtime.gemm(a, b, out=out, op="mm", config=config)
    runtime.gemm(a, b, out=out, op="mm", config=config, alpha=2.0)
    assert len(runtime._LAUNCHERS) == 2 and len(checked_runs) == runs + 2
    assert cpu_gemm_kernels.launches[-1][1][5:] == (2.0, 0.0)


def test_a_launcher_is_built_from_plain_values_and_plans_on_first_call():
    import pickle

    launcher = GemmLauncher("addmm", [128, 128, 64, 1, 1, 6, 2, True, False], alpha=2.0, beta=0.5)
    assert launcher.config == (128, 128, 64, 1, 1, 6, 2, True, False) and launcher._plans == {}
    assert eval(repr(launcher), {"GemmLauncher": GemmLauncher}).config == launcher.config
    assert pickle.loads(pickle.dumps(launcher.config)) == launcher.config
