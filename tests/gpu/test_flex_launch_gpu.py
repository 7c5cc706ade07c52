"""Remembered flex decode launches on the H200 (inductor/flex/runtime.py): compiled decode calls
go through every check once per layout and then repeat the remembered launch, and still match an
fp64 reference on fresh data, with the caching allocator's free memory poisoned (NaN) before each
call so that partials and outputs the kernel leaves unwritten show; a changed layout (another KV
length, batch, stride, dtype) takes the checked path again; a remembered launch gives bit for bit
what ops.flex_decode gives. CPU tests of the same path: tests/test_flex_launch.py."""

import logging
import math

import pytest
import torch
from torch._inductor import config as inductor_config
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute
from inductor_cute import ops
from inductor_cute.host import flex as host_flex
from inductor_cute.inductor.flex import runtime
from inductor_cute.kernels.common.programs import score as sp

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
KV = 3000


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    runtime._LAUNCHERS.clear()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        yield
    torch._dynamo.reset()


@pytest.fixture
def launchers(monkeypatch):
    """Every FlexDecodeLauncher made from now on (output code defines one per call site)."""
    made = []
    init = runtime.FlexDecodeLauncher.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(runtime.FlexDecodeLauncher, "__init__", recording_init)
    return made


@pytest.fixture
def checked_runs(monkeypatch):
    runs = []
    checked = host_flex._checked
    monkeypatch.setattr(host_flex, "_checked", lambda *a, **k: runs.append(1) or checked(*a, **k))
    return runs


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def poison_free_memory():
    """Fill what the caching allocator will hand out next with NaN (then free it again): blocks
    of its small pool (up to 1 MiB) and of its large one."""
    blocks = [torch.empty(n, device="cuda", dtype=torch.float32) for n in (64, 1024, 16384, 262144) * 8]
    blocks.append(torch.empty(64 << 20, device="cuda", dtype=torch.float32))
    for b in blocks:
        b.fill_(float("nan"))


def reference(q, k, v, score_mod=None, block_mask=None):
    """flex_attention in fp64: (out, natural-log lse)."""
    return flex_attention(q.double(), k.double(), v.double(), score_mod=score_mod, block_mask=block_mask,
                          enable_gqa=True, return_lse=True)


def assert_matches(out, lse, ref, ref_lse, dtype):
    empty = torch.isinf(ref_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    assert (out.double() - ref).abs().max().item() < TOL[dtype]
    assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() < 2e-3 * max(1.0, ref_lse.abs().max().item())


SLOPES = torch.exp2(-torch.arange(1, 33, dtype=torch.float32))


_GPU_SLOPES = []  # ALiBi slopes on the GPU, captured by the score_mod as a model holds them


@pytest.fixture(autouse=True)
def slopes_on_gpu():
    """Made outside the compiled region: a `.cuda()` inside a score_mod is a device copy that no
    flex lowering compiles, stock included."""
    _GPU_SLOPES[:] = [SLOPES.cuda()]


def softcap(score, b, h, m, n):
    return 30 * torch.tanh(score / 30)


def alibi(score, b, h, m, n):
    return score + _GPU_SLOPES[0][h] * (n - m)


def sliding(b, h, m, n):
    return (m + KV - 4 >= n) & (m + KV - 4 - n < 700)


CASES = {  # name -> (batch, q heads, kv heads, q len, head dim, score_mod, mask_mod)
    "plain GQA": (4, 32, 8, 1, 128, None, None),
    "MHA Lq 4": (2, 8, 8, 4, 64, None, None),
    "softcap": (4, 32, 8, 1, 128, softcap, None),
    "alibi (captured tensor)": (2, 32, 8, 1, 128, alibi, None),
    "sliding window block mask, Lq 4": (4, 16, 2, 4, 128, None, sliding),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_calls_repeat_the_remembered_launch_and_match(name, dtype, checked_runs, launchers):
    batch, heads, kv_heads, q_len, dim, score_mod, mask_mod = CASES[name]
    block_mask = create_block_mask(mask_mod, batch, None, q_len, KV) if mask_mod else None
    compiled = torch.compile(flex_attention)
    with inductor_cute.enable(flex_decode=True):
        for step in range(4):  # the first call is checked, the others repeat it: fresh data each time
            q = rand(batch, heads, q_len, dim, dtype=dtype)
            k, v = rand(batch, kv_heads, KV, dim, dtype=dtype), rand(batch, kv_heads, KV, dim, dtype=dtype)
            poison_free_memory()
            out, lse = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True,
                                return_lse=True)
            assert_matches(out, lse, *reference(q, k, v, score_mod, block_mask), dtype)
    # one checked call per compiled graph; every repeat takes the remembered launch. Dynamo may
    # compile the call twice (seen once on the H200 under xdist, fp16 plain GQA: two launchers, one
    # checked call each, every output right), so the count is per launcher
    assert launchers and len(launchers) <= 2
    assert len(checked_runs) == len(launchers), "a repeat took the checked path"
    assert all(launcher._static is not None for launcher in launchers), \
        "a static call site repeats its first launch without a key"


def test_layout_changes_take_the_checked_path_and_match(checked_runs, caplog):
    """A KV cache (batch, max_len, heads, dim) sliced to the current length (dynamic), another
    batch, a contiguous cache: every call ours and matching; a layout met before (in the same
    graph) repeats its launch, so only a new layout (or a recompiled graph) is checked."""
    cache = rand(4, 4096, 8, 128), rand(4, 4096, 8, 128)
    compiled = torch.compile(flex_attention, dynamic=True)
    steps = [(4, 1000, "view"), (4, 1000, "view"), (4, 1537, "view"), (4, 1000, "view"), (2, 1537, "view"),
             (4, 1537, "contiguous"), (4, 1537, "contiguous"), (2, 1537, "view")]
    caplog.set_level(logging.DEBUG, logger="inductor_cute.inductor.flex.lowering")
    seen = set()
    with inductor_cute.enable(flex_decode=True):
        for step in steps:
            batch, kv_len, kind = step
            k, v = (c[:batch, :kv_len].transpose(1, 2) for c in cache)
            if kind == "contiguous":
                k, v = k.contiguous(), v.contiguous()
            q = rand(batch, 32, 1, 128)
            poison_free_memory()
            before = len(checked_runs)
            out, lse = compiled(q, k, v, enable_gqa=True, return_lse=True)
            assert_matches(out, lse, *reference(q, k, v), torch.bfloat16)
            assert step not in seen or len(checked_runs) == before, f"{step} was checked again"
            seen.add(step)
    declined = [r.getMessage() for r in caplog.records if "stock lowering" in r.getMessage()]
    assert not declined
    assert 3 <= len(checked_runs) <= 5, [r.getMessage() for r in caplog.records if "inductor-cute" in r.getMessage()]


def test_a_remembered_launch_is_bitwise_the_checked_call():
    q, k, v = rand(2, 32, 1, 128), rand(2, 8, 5000, 128), rand(2, 8, 5000, 128)
    program = sp.dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
                        ["o", "add", "score", "bias"]])
    slopes = SLOPES.cuda()
    launcher = runtime.FlexDecodeLauncher(0.1, program)
    launcher.launch(q, k, v, [slopes], [], None, None, None, None)
    poison_free_memory()
    out, lse = launcher.launch(q, k, v, [slopes], [], None, None, None, None)
    want, want_lse = ops.flex_decode(q, k, v, scale=0.1, return_lse=True, score_mod=program, score_tensors=(slopes,))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    (launch,) = launcher._plans.values()
    assert launch.num_splits > 1  # the partials and the combine are exercised


def test_int64_block_mask_and_kv_views_that_need_copies(checked_runs):
    """What the checked path converts (int64 block tensors, a head-dim slice of k) is converted
    again on each remembered call, never read stale."""
    block_mask = create_block_mask(sliding, 2, None, 1, KV)
    num, idx, full_num, full_idx = (t.long() for t in (block_mask.kv_num_blocks, block_mask.kv_indices,
                                                       block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    window = sp.dumps([["e", "add", "q", KV - 4], ["after", "ge", "e", "kv"], ["d", "sub", "e", "kv"],
                       ["near", "lt", "d", 700], ["o", "and", "after", "near"]])
    launcher = runtime.FlexDecodeLauncher(1 / math.sqrt(128), "", window, 128, 128)
    for _ in range(3):
        q = rand(2, 16, 1, 128)
        k, v = rand(2, 2, KV, 132)[..., :128], rand(2, 2, KV, 128)  # rows of 132: not streamable, copied
        poison_free_memory()
        out, lse = launcher.launch(q, k, v, [], [], num, idx, full_num, full_idx)
        assert_matches(out, lse, *reference(q, k, v, block_mask=block_mask), torch.bfloat16)
    assert len(checked_runs) == 1
