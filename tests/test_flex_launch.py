"""The host path of a compiled graph's flex decode (CPU tensors, recorded kernels): a launcher's
remembered launch passes the kernel exactly what the checked path passes (views, strides,
scalars, captured-tensor and block-mask slots, the split count), computes the right attention on
new data, and any other layout goes back through the checked path. GPU runs are in
tests/gpu/test_flex_launch_gpu.py."""

import pytest
import torch

from inductor_cute import UnsupportedError
from inductor_cute.host import flex as host_flex
from inductor_cute.inductor.flex import runtime
from inductor_cute.inductor.flex.runtime import FlexDecodeLauncher
from inductor_cute.kernels.attention import flex_decode_config as fdc
from inductor_cute.kernels.common.programs import score as sp

BF16 = torch.bfloat16
SOFTCAP = sp.dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = sp.dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
                  ["o", "add", "score", "bias"]])
OFFSET = sp.dumps([["a", "load", "t0", 0], ["o", "add", "score", "a"]])
WINDOW = sp.dumps([["d", "sub", "kv", "q"], ["o", "lt", "d", 200]])  # keys less than 200 past the query
CAPTURED_CAUSAL = sp.dumps([["off", "load", "t0", "b"], ["e", "add", "q", "off"], ["o", "ge", "e", "kv"]])
NO_BLOCKS = (None, None, None, None)


def rand(*shape, dtype=BF16):
    return torch.randn(*shape).to(dtype)


def like(t):
    """A new tensor of t's layout (strides and storage offset kept), fresh values."""
    if t is None:
        return None
    if not t.is_floating_point():
        return t.clone()  # indices and counts: the same values in new memory
    base = torch.randn(t.storage_offset() + t.untyped_storage().nbytes() // t.element_size()).to(t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def blocks(batch, heads, kv_len, block=128, full=True, dtype=torch.int32):
    """A block mask's tensors: every other KV block partial, the rest full (or absent)."""
    n = -(-kv_len // block)
    partial = torch.arange(0, n, 2, dtype=dtype).expand(batch, heads, 1, -1).contiguous()
    num = torch.full((batch, heads, 1), partial.shape[-1], dtype=dtype)
    if not full:
        return num, partial, None, None
    whole = torch.arange(1, n, 2, dtype=dtype).expand(batch, heads, 1, -1).contiguous()
    return num, partial, torch.full((batch, heads, 1), whole.shape[-1], dtype=dtype), whole


def qkv(batch=2, heads=8, kv_heads=2, q_len=1, kv_len=300, dim=64):
    return rand(batch, heads, q_len, dim), rand(batch, kv_heads, kv_len, dim), rand(batch, kv_heads, kv_len, dim)


# name -> (launcher keywords, a maker of (q, k, v, score tensors, mask tensors, block-mask tensors))
CASES = {
    "plain GQA": ({}, lambda: (*qkv(), [], [], NO_BLOCKS)),
    "MHA": ({}, lambda: (*qkv(heads=4, kv_heads=4), [], [], NO_BLOCKS)),
    "Lq 4": ({}, lambda: (*qkv(q_len=4), [], [], NO_BLOCKS)),
    "head dim 128": ({}, lambda: (*qkv(dim=128, kv_len=1000), [], [], NO_BLOCKS)),
    "softcap": ({"score_mod": SOFTCAP}, lambda: (*qkv(), [], [], NO_BLOCKS)),
    "alibi": ({"score_mod": ALIBI}, lambda: (*qkv(), [torch.rand(8)], [], NO_BLOCKS)),
    "one-element captured (stride 0)": ({"score_mod": OFFSET},
                                         lambda: (*qkv(), [torch.rand(4)[2:3].as_strided((1,), (0,))], [],
                                                  NO_BLOCKS)),
    "strided captured (copied)": ({"score_mod": ALIBI}, lambda: (*qkv(), [torch.rand(16)[::2]], [], NO_BLOCKS)),
    "mask_mod": ({"mask_mod": WINDOW}, lambda: (*qkv(), [], [], NO_BLOCKS)),
    "mask_mod and block mask": ({"mask_mod": WINDOW, "kv_block_size": 128, "q_block_size": 128},
                                lambda: (*qkv(), [], [], blocks(1, 1, 300))),
    "block mask without full blocks": ({"mask_mod": WINDOW, "kv_block_size": 128, "q_block_size": 128},
                                       lambda: (*qkv(), [], [], blocks(2, 1, 300, full=False))),
    "int64 block mask (converted)": ({"mask_mod": WINDOW, "kv_block_size": 256, "q_block_size": 128},
                                     lambda: (*qkv(heads=4, kv_heads=4), [], [],
                                              blocks(2, 4, 300, 256, dtype=torch.int64))),
    "captured mask tensor, GQA, Lq 2": ({"score_mod": ALIBI, "mask_mod": CAPTURED_CAUSAL, "kv_block_size": 128,
                                         "q_block_size": 128},
                                        lambda: (*qkv(q_len=2), [torch.rand(8)],
                                                 [torch.tensor([250, 40], dtype=torch.int32)], blocks(2, 1, 300))),
    "k sliced on the head dim (copied)": ({}, lambda: (rand(2, 8, 1, 64), rand(2, 2, 300, 68)[..., :64],
                                                       rand(2, 2, 300, 64), [], [], NO_BLOCKS)),
    "heads-inner KV cache view": ({}, lambda: (rand(2, 8, 1, 64), rand(2, 300, 2, 64).transpose(1, 2),
                                               rand(2, 300, 2, 64).transpose(1, 2), [], [], NO_BLOCKS)),
    "unaligned q (copied)": ({}, lambda: (rand(2 * 8 * 64 + 1)[1:].view(2, 8, 1, 64), *qkv()[1:], [], [],
                                          NO_BLOCKS)),
}


class Recorder:
    def __init__(self):
        self.launches = []

    def kernel_for(self, spec):
        return lambda *args: self.launches.append((spec, args))

    @property
    def args(self):
        return self.launches[-1][1]


@pytest.fixture
def cpu_flex_kernels(monkeypatch):
    """flex decode on CPU tensors: device checks passed, 132 SMs, every kernel a Recorder; kernels
    and launchers are forgotten before and after."""
    def forget():
        host_flex._flex_decode_kernel.cache_clear()
        runtime._LAUNCHERS.clear()

    recorder = Recorder()
    monkeypatch.setattr(host_flex, "check_cuda", lambda *tensors: None)
    monkeypatch.setattr(host_flex, "sm_count", lambda index: 132)
    monkeypatch.setattr(host_flex, "get_kernel", recorder.kernel_for)
    forget()
    yield recorder
    forget()


@pytest.fixture
def checked_runs(monkeypatch):
    """How many times the checked path has planned a flex decode."""
    runs = []
    checked = host_flex._checked
    monkeypatch.setattr(host_flex, "_checked", lambda *a, **k: runs.append(1) or checked(*a, **k))
    return runs


def make_launcher(kw) -> FlexDecodeLauncher:
    return FlexDecodeLauncher(kw.get("scale", 0.125), kw.get("score_mod", ""), kw.get("mask_mod", ""),
                              kw.get("kv_block_size", 0), kw.get("q_block_size", 0))


def run(launcher, tensors):
    """launcher.launch on a case's (q, k, v, score tensors, mask tensors, block-mask tensors)."""
    return launcher.launch(*tensors[:5], *tensors[5])


def sources_of(q, k, v, score, mask, block):
    return host_flex.sources(q, k, v, None, score, mask, block)


def storage_of(t, sources):
    """Which source `t` reads in place (its index), or None (a copy or conversion)."""
    for i, s in enumerate(sources):
        if isinstance(s, torch.Tensor) and t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() \
                and t.dtype == s.dtype:
            return i
    return None


def assert_same_arguments(got, want, got_sources, want_sources):
    assert len(got) == len(want) == 10 + 3 * 4
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            assert g == w, f"argument {i}: {g!r} != {w!r}"
            continue
        assert isinstance(g, torch.Tensor), f"argument {i}"
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype), f"argument {i}"
        if 4 <= i < 8:  # partials and outputs: fresh each call
            continue
        where = storage_of(w, want_sources)
        assert storage_of(g, got_sources) == where, f"argument {i}"
        if where is not None:  # a view of a caller's tensor: the same view of the same caller's tensor
            assert g.storage_offset() == w.storage_offset() and g.data_ptr() - got_sources[where].data_ptr() == \
                w.data_ptr() - want_sources[where].data_ptr(), f"argument {i}"
        assert torch.equal(g, w), f"argument {i}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_remembered_launch_passes_what_the_checked_path_passes(name, cpu_flex_kernels, checked_runs):
    kw, make = CASES[name]
    launcher = make_launcher(kw)
    first = make()
    run(launcher, first)  # checked, and remembered
    assert len(checked_runs) == 1 and len(cpu_flex_kernels.launches) == 1
    fresh = tuple(like(t) for t in first[:3]) + tuple([like(t) for t in ts] for ts in first[3:5]) + \
        (tuple(like(t) for t in first[5]),)
    out, lse = run(launcher, fresh)
    assert len(checked_runs) == 1, "a repeat took the checked path"
    spec, planned = cpu_flex_kernels.launches[-1]
    assert out is planned[6] and lse is planned[7]
    launcher.checked(sources_of(*fresh), len(fresh[3]))
    assert len(checked_runs) == 2
    checked_spec, checked = cpu_flex_kernels.launches[-1]
    assert spec is checked_spec or spec == checked_spec
    assert_same_arguments(planned, checked, sources_of(*fresh), sources_of(*fresh))
    launch, = launcher._plans.values()
    assert launch.num_splits == planned[4].shape[0]


def test_the_split_count_and_scalars_are_the_checked_ones(cpu_flex_kernels):
    q, k, v = qkv(batch=1, heads=32, kv_heads=8, kv_len=8192, dim=128)
    launcher = FlexDecodeLauncher(0.1)
    for _ in range(2):
        launcher.launch(q, k, v, [], [], *NO_BLOCKS)
        args = cpu_flex_kernels.args
        want = fdc.num_splits(1, 8, fdc.m_tiles(4, 1), 8192, 128, 132)
        assert args[4].shape == (want, 1, 32, 1, 128) and args[5].shape == (want, 1, 32, 1)
        assert args[8:10] == (pytest.approx(0.1 * 1.4426950408889634), 0.1)
        assert args[6].shape == (1, 32, 1, 128) and args[6].dtype == BF16 and args[7].dtype == torch.float32


def test_kv_len_is_converted_each_call(cpu_flex_kernels, checked_runs):
    """ops.flex_decode's kv_len (the custom op has none): remembered launches convert an int64 one."""
    q, k, v = qkv()
    for lengths in (torch.tensor([5, 300]), torch.tensor([7, 100], dtype=torch.int32)):
        _, _, launch = host_flex.run_checked(q, k, v, scale=0.125, kv_len=lengths)
        checked = cpu_flex_kernels.args
        fresh = lengths + 1
        launch(host_flex.sources(q, k, v, fresh, (), (), NO_BLOCKS))
        got = cpu_flex_kernels.args
        assert got[3].dtype == torch.int32 and torch.equal(got[3], (fresh).int())
        assert (got[3] is fresh) == (lengths.dtype == torch.int32)
        assert [a.shape for a in got[:3]] == [a.shape for a in checked[:3]]


def reference_kernel(spec):
    """A kernel computing on the CPU from exactly the arguments it is given, as the real one would."""
    problem, _ = fdc.from_params(spec.kwargs)

    def kernel(q, k, v, kv_len, o_part, lse_part, out, lse, scale_log2, scale, *slots):
        score_slots, block_slots, mask_slots = slots[:4], slots[4:8], slots[8:]
        g = q.shape[1] // k.shape[1]
        s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * scale
        if problem.score_program:
            idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
                   for d, n in enumerate(s.shape)]
            s = sp.reference(problem.score_program, s, *idx, score_slots[:len(problem.score_dtypes)])
        keep = sp.reference_keep(s.shape, problem.mask_program, mask_slots[:len(problem.mask_dtypes)],
                                 block_slots if problem.sparse_block else None, problem.sparse_block or 128, 1 << 20)
        if kv_len is not None:
            keep = keep & (torch.arange(s.shape[-1]) < kv_len[:, None, None, None])
        s = s.masked_fill(~keep, float("-inf"))
        lse.copy_(s.logsumexp(-1))
        out.copy_((s - lse[..., None]).exp().nan_to_num(0.0) @ v.float().repeat_interleave(g, 1))

    return kernel


def expected(kw, q, k, v, score, mask, block):
    """The reference from the caller's tensors (fp32, programs and block mask by the evaluators)."""
    g = q.shape[1] // k.shape[1]
    s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * kw.get("scale", 0.125)
    if kw.get("score_mod"):
        idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
               for d, n in enumerate(s.shape)]
        s = sp.reference(kw["score_mod"], s, *idx, [t.contiguous() for t in score])
    keep = sp.reference_keep(s.shape, kw.get("mask_mod", ""), mask, block if block[0] is not None else None,
                             kw.get("kv_block_size", 128), kw.get("q_block_size", 128))
    s = s.masked_fill(~keep, float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp().nan_to_num(0.0) @ v.float().repeat_interleave(g, 1), lse


@pytest.mark.parametrize("name", sorted(CASES))
def test_remembered_launches_compute_attention_on_new_data(name, cpu_flex_kernels, monkeypatch):
    kw, make = CASES[name]
    monkeypatch.setattr(host_flex, "get_kernel", reference_kernel)
    launcher = make_launcher(kw)
    tensors = make()
    for _ in range(3):  # checked, then remembered twice, on fresh data each time
        tensors = tuple(like(t) for t in tensors[:3]) + tuple([like(t) for t in ts] for ts in tensors[3:5]) + \
            (tuple(like(t) for t in tensors[5]),)
        out, lse = run(launcher, tensors)
        want, want_lse = expected(kw, *tensors)
        torch.testing.assert_close(out.float(), want.to(out.dtype).float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert len(launcher._plans) == 1 and None not in launcher._plans.values()


def test_another_layout_goes_back_through_the_checked_path(cpu_flex_kernels, checked_runs):
    launcher = FlexDecodeLauncher(0.125, "", WINDOW, 128, 128)
    q, k, v = qkv(kv_len=1024)
    block = blocks(1, 1, 1024)

    def launch(q, k, v, block=block, score=(), checked=False):
        before = len(checked_runs)
        launcher.launch(q, k, v, list(score), [], *block)
        assert len(checked_runs) == before + checked
        return cpu_flex_kernels.launches[-1]

    launch(q, k, v, checked=True)
    launch(q, k, v)
    _, args = launch(q, k[:, :, :700], v[:, :, :700], checked=True)  # another KV length (a dynamic size)
    assert args[1].shape[2] == 700
    launch(q, k[:, :, :700], v[:, :, :700])
    launch(q, k, v)  # both lengths are remembered
    _, args = launch(q, k, v, block=blocks(1, 1, 768), checked=True)  # fewer block columns: another split count
    spec, _ = launch(q.half(), k.half(), v.half(), checked=True)  # another dtype: another kernel
    assert spec.kwargs["dtype_name"] == "float16"
    heads_inner = k.transpose(1, 2).contiguous().transpose(1, 2)
    _, args = launch(q, heads_inner, v, checked=True)  # same shape, other strides
    assert args[1].stride() == heads_inner.stride()
    launch(q, heads_inner, v)
    shifted = torch.empty(q.numel() + 8, dtype=BF16)[8:].view(q.shape).copy_(q)  # 16 bytes on: aligned
    launch(shifted, k, v)
    skewed = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape).copy_(q)  # 2 bytes on: copied
    _, args = launch(skewed, k, v, checked=True)
    assert args[0].data_ptr() % 16 == 0 and torch.equal(args[0], q)
    _, again = launch(skewed, k, v)
    assert again[0].data_ptr() != skewed.data_ptr() and torch.equal(again[0], q)  # copied each call
    assert len(launcher._plans) == 6 and None not in launcher._plans.values()


def test_programs_and_captured_counts_are_part_of_the_key(cpu_flex_kernels, checked_runs):
    q, k, v = qkv()
    t = torch.rand(8)
    runtime.flex_decode(q, k, v, 0.125, ALIBI, [t], "", [], *NO_BLOCKS, 0, 0)
    runtime.flex_decode(q, k, v, 0.125, ALIBI, [t], "", [], *NO_BLOCKS, 0, 0)
    runtime.flex_decode(q, k, v, 0.25, ALIBI, [t], "", [], *NO_BLOCKS, 0, 0)  # another call site's scale
    assert len(checked_runs) == 2 and len(runtime._LAUNCHERS) == 2
    assert cpu_flex_kernels.args[9] == 0.25
    launcher = runtime.launcher(0.125, "", "", 0, 0)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="score_tensors were given without a score_mod"):
        launcher.launch(q, k, v, [one], [], *NO_BLOCKS)
    assert len(layouts := {runtime.layout_key((q, k, v, None, one), n) for n in (0, 1)}) == 2, layouts


def test_empty_outputs_are_never_remembered(cpu_flex_kernels, checked_runs):
    q, k, v = qkv(kv_len=0)
    launcher = FlexDecodeLauncher(0.125)
    for _ in range(2):
        out, lse = launcher.launch(q, k, v, [], [], *NO_BLOCKS)
        assert (out == 0).all() and torch.isinf(lse).all()
    assert len(checked_runs) == 2 and list(launcher._plans.values()) == [None] and not cpu_flex_kernels.launches


def test_a_launcher_is_built_from_plain_values():
    launcher = FlexDecodeLauncher(0.125, SOFTCAP, WINDOW, 128, 128)
    again = eval(repr(launcher), {"FlexDecodeLauncher": FlexDecodeLauncher})
    assert (again.scale, again.score_mod, again.mask_mod, again.kv_block_size, again.q_block_size) == \
        (0.125, SOFTCAP, WINDOW, 128, 128) and again._plans == {}


@pytest.mark.parametrize("name, converted", [
    ("plain GQA", set()), ("mask_mod and block mask", set()), ("one-element captured (stride 0)", set()),
    ("heads-inner KV cache view", set()), ("strided captured (copied)", {"_unit_stride"}),
    ("block mask without full blocks", {"_zero_counts"}), ("int64 block mask (converted)", {"_int32_contiguous"}),
    ("k sliced on the head dim (copied)", {"_copied_kv"}), ("unaligned q (copied)", {"_copied_q"})])
def test_only_what_the_checked_path_copies_is_converted_each_call(name, converted, cpu_flex_kernels):
    kw, make = CASES[name]
    launcher = make_launcher(kw)
    run(launcher, make())
    launch, = launcher._plans.values()
    assert {op[4].__name__ for op in launch.operands if op[4] is not None} == converted


def test_the_op_keeps_the_schema_output_code_calls():
    """Output code in Inductor's FX cache calls the op positionally: its schema must not change
    (it is the one torch.library.custom_op inferred when the op was defined with it)."""
    from inductor_cute.inductor.flex import lowering

    schema = str(torch.ops.inductor_cute.flex_decode.default._schema)
    assert schema == (
        "inductor_cute::flex_decode(Tensor q, Tensor k, Tensor v, float scale, str score_mod, Tensor[] score_tensors, "
        "str mask_mod, Tensor[] mask_tensors, Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "
        "Tensor? full_kv_indices, SymInt kv_block_size, SymInt q_block_size) -> (Tensor, Tensor)")
    assert torch.Tag.pt2_compliant_tag in torch.ops.inductor_cute.flex_decode.default.tags
    assert lowering.SCHEMA in schema


def test_a_static_call_site_repeats_its_first_aligned_launch_without_a_key(cpu_flex_kernels, checked_runs,
                                                                            monkeypatch):
    q, k, v = qkv()
    launcher = FlexDecodeLauncher(0.125, ALIBI)
    t = torch.rand(8)
    args = lambda q: (q, k, v, 0.125, ALIBI, [t], "", [], *NO_BLOCKS, 0, 0)  # noqa: E731 (the op's order)
    out, lse = launcher.call_static(*args(q))
    first = cpu_flex_kernels.args
    keys = []
    monkeypatch.setattr(runtime, "layout_key", lambda *a: keys.append(a) or ("key",))
    for _ in range(3):
        q2 = like(q)
        launcher.call_static(*args(q2))
        assert cpu_flex_kernels.args[0].data_ptr() == q2.data_ptr() and cpu_flex_kernels.args[8:] == first[8:]
    assert len(checked_runs) == 1 and not keys  # no layout key once the static launch is known
    skewed = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape).copy_(q)  # misaligned: the keyed path
    launcher.call_static(*args(skewed))
    assert keys and len(checked_runs) == 2 and cpu_flex_kernels.args[0].data_ptr() % 16 == 0


def test_output_code_calls_a_launcher_per_call_site(cpu_flex_kernels):
    launcher = FlexDecodeLauncher(0.125)
    q, k, v = qkv()
    out, lse = launcher.call(q, k, v, 0.125, "", [], "", [], *NO_BLOCKS, 0, 0)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and len(launcher._plans) == 1
    assert not runtime._LAUNCHERS  # the header's own launcher, not the op's shared ones
