"""The MoE row-gather fusion (inductor/grouped/gather.py) on the CPU: on graphs traced as Inductor
traces them, a torch._grouped_mm (or fused gate) of rows gathered by x[idx] becomes one
grouped_mm_rows call where the kernel serves it, and nothing changes where it does not;
torch.compile with enable(fuse_moe_gather=True) emits the call (with fuse_moe_gate too: one
gathered, gated call). CPU tensors stand in for CUDA ones (gate.DEVICE_TYPES patched), and the op
then computes unfused, so results are compared with the function as written.
GPU runs of the kernel: tests/gpu/test_grouped_gather_gpu.py."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config

import inductor_cute
from inductor_cute.host import grouped_gemm as host_grouped
from inductor_cute.inductor.grouped import gate, gather
from inductor_cute.inductor.grouped.moe_pass import moe_pass

from test_grouped_gate import BF16, K, inputs, targets, traced

TOP_K = 2


@pytest.fixture
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(gate, "DEVICE_TYPES", ("cuda", "cpu"))


def routed(x, w, offs):
    """torchtitan's permute: each token's TOP_K rows (here a fixed order), then the experts' GEMM."""
    order = torch.arange(x.shape[0] * TOP_K, device=x.device).flip(0)
    return torch._grouped_mm(x[order // TOP_K], w.transpose(-2, -1), offs)


def routed_gated(x, w, offs):
    order = torch.arange(x.shape[0] * TOP_K, device=x.device).flip(0)
    gate_, up = torch._grouped_mm(x[order // TOP_K], w.transpose(-2, -1), offs).chunk(2, dim=-1)
    return F.silu(gate_) * up


def routed_inputs(**kwargs):
    x, w, _ = inputs(tokens=20, **kwargs)
    experts = w.shape[0]
    return x, w, torch.tensor([12] * (experts - 1) + [40], dtype=torch.int32)  # 40 routed rows


def test_a_grouped_mm_of_gathered_rows_becomes_one_call(cpu_counts_as_cuda):
    x, w, offs = routed_inputs()
    gm = traced(routed, x, w, offs)
    assert gather.fuse_row_gathers(gm.graph) == 1
    gm.recompile()
    assert gather.OP in targets(gm)
    assert torch.ops.aten._grouped_mm.default not in targets(gm) and torch.ops.aten.index.Tensor not in targets(gm)
    torch.testing.assert_close(gm(x, w, offs), routed(x, w, offs))


def test_a_fused_gate_of_gathered_rows_becomes_one_gathered_gated_call(cpu_counts_as_cuda):
    x, w, offs = routed_inputs()
    gm = traced(routed_gated, x, w, offs)
    assert gate.fuse_grouped_gates(gm.graph) == 1
    assert gather.fuse_row_gathers(gm.graph) == 1
    gm.recompile()
    (call,) = [n for n in gm.graph.nodes if n.target is gather.OP]
    assert call.args[-1] == "silu" and gate.OP not in targets(gm)
    torch.testing.assert_close(gm(x, w, offs), routed_gated(x, w, offs))


def test_the_op_runs_our_kernel_with_the_index(cpu_counts_as_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(host_grouped, "grouped_mm", lambda *a, **kw: calls.append((a, kw)) or "ours")
    x, w, offs = routed_inputs()
    idx = torch.arange(40) // TOP_K
    assert gather.grouped_mm_rows_op(x, idx, w.transpose(-2, -1), offs, "") == "ours"
    assert calls[0][0][0] is x and calls[0][1]["rows"] is idx


def test_what_our_kernel_refuses_falls_back_unfused(cpu_counts_as_cuda, monkeypatch):
    def refuse(*args, **kwargs):
        raise inductor_cute.UnsupportedError("unaligned")

    monkeypatch.setattr(host_grouped, "grouped_mm_gated", refuse)
    x, w, offs = routed_inputs()
    assert torch.equal(gather.grouped_mm_rows_op(x, torch.arange(40).flip(0) // TOP_K, w.transpose(-2, -1), offs,
                                                 "silu"), routed_gated(x, w, offs))


def torchtitan_w1_w3(x, w, offs):
    """torchtitan's experts: the same gathered rows times w1 and w3 apart, silu(h1) * h3."""
    rows = x[torch.arange(40, device=x.device).flip(0) // TOP_K]
    half = w.shape[1] // 2
    h1 = torch._grouped_mm(rows, w[:, :half].transpose(-2, -1), offs)
    h3 = torch._grouped_mm(rows, w[:, half:].transpose(-2, -1), offs, out_dtype=torch.bfloat16)
    return F.silu(h1) * h3


def test_rows_feeding_two_products_become_two_gathered_calls(cpu_counts_as_cuda):
    x, w, offs = routed_inputs()
    gm = traced(torchtitan_w1_w3, x, w, offs)
    assert gather.fuse_row_gathers(gm.graph) == 2
    gm.recompile()
    assert targets(gm).count(gather.OP) == 2 and torch.ops.aten.index.Tensor not in targets(gm)
    torch.testing.assert_close(gm(x, w, offs), torchtitan_w1_w3(x, w, offs))


def keeps_rows(x, w, offs):
    rows = x[torch.arange(40, device=x.device) // TOP_K]
    return torch._grouped_mm(rows, w.transpose(-2, -1), offs), rows  # rows used again (saved for a backward)


def two_index_dims(x, w, offs):
    i = torch.arange(40, device=x.device) // TOP_K
    return torch._grouped_mm(x[i, :][:, torch.arange(K)], w.transpose(-2, -1), offs)


def bool_mask(x, w, offs):
    keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    return torch._grouped_mm(x[keep], w.transpose(-2, -1), offs)


@pytest.mark.parametrize("fn,args", [
    (keeps_rows, routed_inputs()),
    (two_index_dims, routed_inputs()),
    (bool_mask, inputs(tokens=40)),
    (routed, routed_inputs(experts=600)),  # more groups than the kernel's tables hold
])
def test_everything_else_is_left_as_it_is(cpu_counts_as_cuda, fn, args):
    gm = traced(fn, *args)
    before = targets(gm)
    assert gather.fuse_row_gathers(gm.graph) == 0
    assert targets(gm) == before


def test_nothing_is_fused_off_cuda():
    gm = traced(routed, *routed_inputs())
    assert gather.fuse_row_gathers(gm.graph) == 0


def test_declines_name_their_reason(cpu_counts_as_cuda):
    x, w, offs = routed_inputs()
    b = w.transpose(-2, -1)
    assert "row gather" in gather.rows_decline_reason(x, torch.zeros(4, 2, dtype=torch.int64), b, offs, "")
    assert "no rows" in gather.rows_decline_reason(x[:0], torch.zeros(40, dtype=torch.int64), b, offs, "")
    unaligned = torch.randn(20, K + 4).to(x.dtype)[:, :K]  # rows 68 elements apart
    assert "strides" in gather.rows_decline_reason(unaligned, torch.zeros(40, dtype=torch.int64), b, offs, "")
    assert gather.rows_decline_reason(x, torch.zeros(40, dtype=torch.int32), b, offs, "silu") is None
    assert "index is on meta" in gather.rows_decline_reason(x, torch.zeros(40, dtype=torch.int64, device="meta"), b,
                                                            offs, "")


@pytest.mark.parametrize("gate_too", [False, True])
def test_torch_compile_emits_the_gathered_call(cpu_counts_as_cuda, gate_too):
    from torch._inductor.utils import run_and_get_code

    fn = routed_gated if gate_too else routed
    x, w, offs = routed_inputs()
    torch._dynamo.reset()
    with inductor_cute.enable(fuse_moe_gate=gate_too, fuse_moe_gather=True):
        assert inductor_config.post_grad_custom_pre_pass is moe_pass(gate_too, True, True)
        out, (code, *_) = run_and_get_code(torch.compile(fn), x, w, offs)
    assert "inductor_cute.grouped_mm_rows" in code and "grouped_mm_gated" not in code
    torch.testing.assert_close(out, fn(x, w, offs))
    assert inductor_config.post_grad_custom_pre_pass is None  # removed with disable


def test_each_setting_pair_is_one_pass_with_its_own_cache_key():
    assert moe_pass(True, True) is moe_pass(True, True)
    keys = {moe_pass(g, r).uuid() for g in (False, True, None) for r in (False, True, None)}
    assert len(keys) == 9


@pytest.mark.parametrize("autotuned,hopper", [(False, True), (True, True), (True, False)])
def test_the_default_fuses_only_where_the_graph_autotunes_with_our_backend(cpu_counts_as_cuda, monkeypatch,
                                                                          autotuned, hopper):
    # enable()'s default (None): the fused ops' autotuning weighs them against the unfused
    # computation; without it our kernel's heuristic config would run unopposed, and on another
    # GPU the op would run eager's unfused computation
    from inductor_cute.inductor.grouped import moe_pass as moe_pass_module

    monkeypatch.setattr(moe_pass_module, "kernels_run_on", lambda graph: hopper)
    x, w, offs = routed_inputs()
    gm = traced(routed_gated, x, w, offs)
    with inductor_config.patch(max_autotune=autotuned, max_autotune_gemm=False,
                               max_autotune_gemm_backends="ATEN,TRITON,ICUTE"):
        moe_pass(None, None)(gm.graph)
    fused = [n for n in gm.graph.nodes if n.target in (gather.OP, gate.OP)]
    assert len(fused) == (1 if autotuned and hopper else 0)
    if fused:
        assert fused[0].target is gather.OP and fused[0].args[-1] == "silu"  # one gathered, gated call
    with inductor_config.patch(max_autotune=False, max_autotune_gemm=True,  # ours not asked for
                               max_autotune_gemm_backends="ATEN,TRITON"):
        gm = traced(routed_gated, x, w, offs)
        moe_pass(None, None)(gm.graph)
        assert gather.OP not in targets(gm) and gate.OP not in targets(gm)


def test_the_default_needs_a_hopper_gpu_for_the_graphs_inputs(cpu_counts_as_cuda):
    from inductor_cute.inductor.grouped.moe_pass import kernels_run_on

    gm = traced(routed_gated, *routed_inputs())
    assert not kernels_run_on(gm.graph)  # CPU inputs (CUDA, when there is one, is checked for sm_90)


# ---- the gathered op's autotuning (grouped/gate_lowering.py), on fake CUDA tensors

def test_the_gathered_op_autotunes_our_gathered_configs_on_routed_rows(monkeypatch):
    from types import SimpleNamespace

    from test_grouped_lowering import E, K as K_, N, TOKENS, lower, record_gated_selects

    from inductor_cute.inductor.grouped import runtime
    from inductor_cute.kernels.gemm.grouped_config import GroupedProblem, candidates

    def gathered(a, rows, w, offs):
        return gather.OP(a, rows, w.transpose(1, 2), offs, "")

    x_rows = 100  # the tokens the routed rows index
    specs = [((x_rows, K_), BF16), ((TOKENS,), torch.int64), ((E, N, K_), BF16), ((E,), torch.int32)]
    recorded = record_gated_selects(monkeypatch)
    _, code = lower(gathered, specs, codegen=True, enable_kwargs={"fuse_moe_gather": True})
    (name, choices, kwargs, layout), = recorded
    problem = GroupedProblem("bfloat16", "bfloat16", "k", "k", "", "int64")
    want = candidates(problem, TOKENS, N, K_, E, 132)
    assert name == "grouped_mm_rows" and want and all(c.cluster_n == 1 for c in want)
    unfused, *ours = choices  # torch's kernels computing the same, then ours
    assert unfused.choice.name == "inductor_cute_grouped_mm_unfused" and len(unfused.input_nodes) == 4
    assert [c.kwargs["config"] for c in ours] == [runtime.as_tuple(cfg) for cfg in want]
    assert all(c.problem == problem and len(c.input_nodes) == 4 for c in ours)
    assert list(layout.size) == [TOKENS, N]
    node = SimpleNamespace(get_device=lambda: torch.device("cpu"), get_dtype=lambda: torch.int64)
    rows = kwargs["input_gen_fns"][1](node)
    assert rows.dtype == torch.int64 and rows.shape == (TOKENS,) and 0 <= int(rows.min()) <= int(rows.max()) < x_rows
    offs = kwargs["input_gen_fns"][3](SimpleNamespace(get_device=node.get_device, get_dtype=lambda: torch.int32))
    assert offs[-1] == TOKENS and len(set(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())) > 1
    assert re.search(r"icute_grouped_mm_0 = \S+GroupedLauncher\(config=\(.*\)\)\.launch_rows", code)
    # called with (a, rows, b, offs, out), as launch_rows takes them
    assert re.search(r"icute_grouped_mm_0\(a_1, rows_1, reinterpret_tensor\(w_1, .*\), offs_1, buf0\)", code)


def test_the_gathered_launcher_runs_the_kernel_with_the_index_or_computes_unfused(monkeypatch):
    from inductor_cute.inductor.grouped import runtime
    from inductor_cute.kernels.gemm.grouped_config import GroupedConfig

    calls = []
    monkeypatch.setattr(runtime.host_grouped, "grouped_mm", lambda *args, config, rows: calls.append((args, rows)))
    x, w, offs = routed_inputs()
    rows, out = torch.arange(40) // TOP_K, torch.empty(40, 96, dtype=BF16)
    launcher = runtime.GroupedLauncher(runtime.as_tuple(GroupedConfig()))
    launcher.launch_rows(x, rows, w.transpose(-2, -1), offs, out)
    assert calls[0][0][0] is x and calls[0][1] is rows

    def refuse(*args, **kwargs):
        raise inductor_cute.UnsupportedError("an unaligned pointer")

    monkeypatch.setattr(runtime.host_grouped, "grouped_mm", refuse)
    launcher.launch_rows(x, rows, w.transpose(-2, -1), offs, out)
    assert torch.equal(out, torch._grouped_mm(x[rows], w.transpose(-2, -1), offs=offs))


def test_benchmark_inputs_out_of_range_are_replaced_by_valid_rows():
    from inductor_cute.inductor.grouped import runtime

    good = torch.tensor([0, 5, 9])
    assert runtime.valid_rows(good, 10) is good
    fixed = runtime.valid_rows(torch.tensor([0, 12, -1]), 10)
    assert fixed.shape == (3,) and int(fixed.min()) >= 0 and int(fixed.max()) < 10


def test_a_gathered_choices_benchmark_gets_valid_rows_and_offsets(monkeypatch):
    from inductor_cute.inductor.gemm.extern import CuteGemmCaller
    from inductor_cute.inductor.grouped.extern import CuteGroupedCaller

    timed = []
    monkeypatch.setattr(CuteGemmCaller, "benchmark", lambda self, *args, out: timed.append(args) or 1.0)
    mine = object.__new__(CuteGroupedCaller)
    mine.description, mine.kwargs = "test", {}
    x, w, _ = routed_inputs()
    rows = torch.tensor([3, 99, -50, 7] * 10)  # 99 and -50 outside x's 20 rows
    assert mine.benchmark(x, rows, w.transpose(-2, -1), torch.tensor([5, -2, 900], dtype=torch.int32), out=None) == 1.0
    (a, got_rows, _, got_offs), = timed
    assert a is x and got_rows.shape == (40,) and 0 <= int(got_rows.min()) and int(got_rows.max()) < 20
    assert got_offs.tolist() == [13, 26, 40]  # an even split of the 40 rows


def test_fuse_moe_gather_alone_refuses_a_users_pre_pass():
    def users_pass(graph):
        return None

    with inductor_config.patch(post_grad_custom_pre_pass=users_pass):
        with pytest.raises(RuntimeError, match="post_grad_custom_pre_pass is already set"):
            inductor_cute.enable(fuse_moe_gather=True)
        assert inductor_config.post_grad_custom_pre_pass is users_pass


def test_nested_enables_restore_the_pre_pass_slot():
    with inductor_cute.enable(fuse_moe_gate=True):
        with inductor_cute.enable(fuse_moe_gather=True):
            assert inductor_config.post_grad_custom_pre_pass is moe_pass(None, True, True)
            with inductor_cute.enable(moe_routing=False, fuse_moe_gate=False, fuse_moe_gather=False):
                assert inductor_config.post_grad_custom_pre_pass is None
            with inductor_cute.enable():
                assert inductor_config.post_grad_custom_pre_pass is moe_pass(None, None, True)
            assert inductor_config.post_grad_custom_pre_pass is moe_pass(None, True, True)
        assert inductor_config.post_grad_custom_pre_pass is moe_pass(True, None, True)
    assert inductor_config.post_grad_custom_pre_pass is None


@pytest.mark.parametrize("gated", [False, True])
def test_the_unfused_choice_computes_what_the_op_does(gated):
    from inductor_cute.inductor.grouped import runtime

    x, w, offs = routed_inputs()
    b, rows = w.transpose(-2, -1), torch.arange(40).flip(0) // TOP_K
    activation = "silu" if gated else ""
    out = torch.full((40, 48 if gated else 96), float("nan"), dtype=BF16)
    runtime.grouped_mm_unfused(x, rows, b, offs, out=out, activation=activation)
    assert torch.equal(out, (routed_gated if gated else routed)(x, w, offs))
    if gated:  # the gate op's inputs: (a, b, offs)
        runtime.grouped_mm_unfused(x[rows], b, offs, out=out, activation="silu")
        assert torch.equal(out, routed_gated(x, w, offs))


def test_the_models_suite_counts_fused_sites_in_output_code():
    from inductor_cute.bench.suites.grouped_gemm import UNFUSED_CALL, gated_sites, gathered_sites

    code = "\n".join([
        "icute_grouped_mm_0 = inductor_cute.inductor.grouped.runtime.GroupedLauncher(config=(128, 256, 64, 4, 2, 1, 1, "
        "0, True, True), activation='silu').launch_rows",
        "icute_grouped_mm_1 = inductor_cute.inductor.grouped.runtime.GroupedLauncher(config=(128, 256, 64, 4, 2, 1, 1, "
        "0, True, True)).launch",
        "buf2 = torch.ops.inductor_cute.grouped_mm_rows.default(arg0_1, buf1, reinterpret_tensor(arg2_1, (3, 64, 96), "
        "(6144, 1, 64), 0), arg3_1, '')",
        "extern_kernels.inductor_cute_grouped_mm_unfused(arg0_1, buf1, arg2_1, arg3_1, out=buf4, activation='silu')",
        ""])
    assert gated_sites(code) == 1  # the gated launcher; not the plain op call, not the unfused extern
    assert gathered_sites(code) == 2  # the gathered launcher and the op
    assert code.count(UNFUSED_CALL) == 1
