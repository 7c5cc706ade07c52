"""The benchmark suites without a GPU: registry and CLI, case factories and names, the e2e models
and their roofline counts, the autotuning records, and compiling a runner under its own config."""

import functools
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config

from inductor_cute.bench.suites import SUITES, e2e, gemm, gemm_compiled
from inductor_cute.inductor import is_enabled

ROOT = Path(__file__).resolve().parents[1]


def test_registry_lists_the_new_suites():
    assert {"gemm", "rmsnorm", "gemm_compiled", "e2e"} <= set(SUITES)
    assert SUITES["gemm_compiled"] is gemm_compiled and SUITES["e2e"] is e2e


def test_cli_bench_help_lists_every_suite(capsys):
    from inductor_cute.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in SUITES:
        assert name in out


def test_bench_without_gpu_refuses():
    from inductor_cute.bench.harness import run_suite

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        run_suite("e2e", quick=True)


@pytest.mark.parametrize("quick", [True, False])
def test_gemm_compiled_cases_cover_the_gemm_shapes_in_both_layouts(quick):
    factories = gemm_compiled.cases(quick)
    shapes = gemm.QUICK if quick else gemm.SHAPES
    assert len(factories) == 2 * len(shapes)
    assert all(isinstance(f, functools.partial) and callable(f) for f in factories)
    names = [gemm_compiled.case_name(*f.args) for f in factories]
    assert len(set(names)) == len(names)
    assert {f.args[:3] for f in factories} == set(shapes) and {f.args[3] for f in factories} == {"n", "k"}


@pytest.mark.parametrize("quick", [True, False])
def test_e2e_cases(quick):
    factories = e2e.cases(quick)
    assert all(callable(f) for f in factories)
    names = [e2e.case_name(*f.args[:2]) for f in factories]
    assert len(set(names)) == len(names)
    blocks = {f.args[0] for f in factories}
    assert blocks == ({"mlp"} if quick else {"mlp", "layer"})
    assert {f.args[1] for f in factories} == {"prefill", "decode"}
    assert all(f.args[2] is not quick for f in factories)  # ours with CUDA graphs: full run only


def _weight_elements(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_mlp_flops_and_bytes_count_its_gemms_and_weights():
    mlp = e2e.MLP(device="meta")
    for tokens in (8, 4096):
        flops, n_bytes = e2e.mlp_cost(tokens)
        gemm_flops = sum(2 * tokens * lin.in_features * lin.out_features for lin in (mlp.gate, mlp.up, mlp.down))
        assert flops == gemm_flops == 2 * tokens * 3 * 4096 * 14336
        assert n_bytes == 2 * (_weight_elements(mlp) + 2 * tokens * 4096)
    assert e2e.mlp_cost(4096)[0] == pytest.approx(1.443e12, rel=1e-3)
    assert e2e.mlp_cost(8)[1] == pytest.approx(352.5e6, rel=1e-3)  # decode reads the weights: 352 MB


def test_layer_flops_and_bytes():
    layer = e2e.DecoderLayer(device="meta")
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7
    gemm_per_token = sum(2 * lin.in_features * lin.out_features for lin in linears)
    # prefill: causal attention, half of QK^T and PV over 4096 x 4096
    flops, n_bytes = e2e.layer_cost(1, 4096)
    assert flops == 4096 * gemm_per_token + 2 * 32 * 4096 * 4096 * 128
    assert n_bytes == 2 * (_weight_elements(layer) + 2 * 4096 * 4096)
    # decode: one token per sequence against a 2048-entry cache, which is read
    flops, n_bytes = e2e.layer_cost(8, 1, 2048)
    assert flops == 8 * gemm_per_token + 4 * 8 * 32 * 2048 * 128
    assert n_bytes == 2 * (_weight_elements(layer) + 2 * 8 * 4096 + 2 * 8 * 8 * 2048 * 128)


def test_mlp_is_swiglu():
    torch.manual_seed(0)
    mlp = e2e.MLP(64, 96)
    x = torch.randn(5, 64)
    ref = (torch.nn.functional.silu(x @ mlp.gate.weight.T) * (x @ mlp.up.weight.T)) @ mlp.down.weight.T
    torch.testing.assert_close(mlp(x), ref)


def test_decode_with_kv_cache_matches_prefill_of_the_whole_sequence():
    """The last token of a causal prefill equals a decode step whose cache holds the earlier tokens'
    keys and values: the static-cache decode computes the attention it claims to."""
    torch.manual_seed(0)
    kw = dict(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16)
    layer = e2e.DecoderLayer(**kw).requires_grad_(False)
    with torch.no_grad():
        layer.attn_norm.uniform_(0.5, 1.5)
        x = torch.randn(3, 10, 64)
        full = layer(x)
        _, k, v = layer.qkv(torch.nn.functional.rms_norm(x, (64,), layer.attn_norm, e2e.EPS))
        decoder = e2e.DecoderLayer(**kw).requires_grad_(False)
        decoder.load_state_dict(layer.state_dict())
        decoder.attach_cache(k.clone(), v.clone())
        decoder.k_cache[:, :, -1] = 0  # overwritten by the step
        step = decoder(x[:, -1:])
    torch.testing.assert_close(step, full[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoder.k_cache, k)


class TritonTemplateCaller:  # stand-ins named like Inductor's choice classes
    def __str__(self):
        return "TritonTemplateCaller(tmp.py, BLOCK_M=128)"


class ExternKernelCaller:
    def __str__(self):
        return "ExternKernelCaller(extern_kernels.mm)"


class CuteGemmCaller:
    def __str__(self):
        return "inductor_cute_gemm(128x256x64 cluster 2x1 stages 4 persistent)"


class _Node:
    def __init__(self, *size):
        self.size = list(size)

    def get_size(self):
        return self.size


def test_gemm_record_names_the_winner_and_best_times():
    timings = {ExternKernelCaller(): 0.0339, TritonTemplateCaller(): 0.0352, TritonTemplateCaller(): 0.0401,
               CuteGemmCaller(): 0.0310}
    rec = gemm_compiled.gemm_record(timings, "mm", [_Node(128, 4096), _Node(4096, 14336)])
    assert rec == {"op": "mm", "mnk": (128, 14336, 4096), "winner": "inductor_cute",
                   "us": {"aten": 33.9, "triton": 35.2, "inductor_cute": 31.0}}
    bias = _Node(14336)
    rec = gemm_compiled.gemm_record({ExternKernelCaller(): 0.01, CuteGemmCaller(): float("inf")}, "addmm",
                                    [bias, _Node(8, 4096), _Node(4096, 14336)])
    assert rec["mnk"] == (8, 14336, 4096) and rec["winner"] == "aten"
    text = gemm_compiled.describe_gemms([rec])
    assert text == "addmm 8x14336x4096 aten 10.0 us (inductor_cute inf)"


def test_feedback_is_recorded_only_while_capturing():
    timings = {ExternKernelCaller(): 0.02}
    nodes = [_Node(16, 32), _Node(32, 64)]
    gemm_compiled._feedback(timings, "mm", nodes)  # not capturing: ignored
    gemms = []
    with gemm_compiled.capture([], gemms):
        gemm_compiled._feedback(timings, "mm", nodes, None, None)
        gemm_compiled._feedback({}, "mm", [object()])  # malformed: ignored, never raises
    assert [g["mnk"] for g in gemms] == [(16, 64, 32)]


def test_compile_now_keeps_the_enabled_state_inside_each_runner(caplog):
    """Ours compiles with inductor-cute enabled (its choices hook sees the GEMM and, on a CPU,
    skips it), stock compiles without; nothing stays enabled and neither recompiles later."""
    torch._dynamo.reset()
    a, b = torch.randn(64, 48), torch.randn(48, 80)
    with caplog.at_level(logging.INFO, logger="inductor_cute"):
        ours = gemm_compiled.compile_now(gemm_compiled._mm, (a, b), mode="max-autotune-no-cudagraphs", ours=True,
                                         backends="ATEN,ICUTE")
    assert "inductor-cute skips mm 64x80x48: device cpu is not CUDA" in caplog.text
    assert not is_enabled() and "ICUTE" not in inductor_config.max_autotune_gemm_backends
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inductor_cute"):
        stock = gemm_compiled.compile_now(gemm_compiled._mm, (a, b), mode="max-autotune-no-cudagraphs", ours=False,
                                          backends="ATEN")
    assert "inductor-cute" not in caplog.text
    default = gemm_compiled.compile_now(gemm_compiled._mm, (a, b), mode=None, ours=False, backends="ATEN")
    for c in (ours, stock, default):
        torch.testing.assert_close(c.run(), a @ b)
        assert c.code and c.our_calls == 0 and c.seconds > 0
    assert "ours: " in gemm_compiled.winner_note("ours", ours) and "compile " in gemm_compiled.winner_note("ours", ours)
    torch._dynamo.reset()


def _benchmark_script(name: str, monkeypatch):
    """benchmarks/<name>.py as a module, its folder on the path (as when run as a script)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _autotune_cost(monkeypatch):
    return _benchmark_script("autotune_cost", monkeypatch)


def test_autotune_cost_script_parses_and_tabulates(monkeypatch):
    mod = _autotune_cost(monkeypatch)
    compile(mod.CHILD, "child", "exec")
    assert mod.parse_shapes("4096x14336x4096,16x4096x4096") == [(4096, 14336, 4096), (16, 4096, 4096)]
    assert mod.SHAPES == [(4096, 14336, 4096), (128, 14336, 4096), (16, 4096, 4096)]
    cold = {"seconds": 20.0, "winner": "ours", "err": 1e-3, "ours_s": 6.0, "kernels_compiled": 5}
    warm = {"seconds": 3.0, "winner": "cached graph", "err": 1e-3, "ours_s": 0.2, "kernels_compiled": 0}
    rows = [{"shape": "16x4096x4096", "variant": "ours", "cold": cold, "warm": warm},
            {"shape": "16x4096x4096", "variant": "stock", "cold": {"error": "exit 1: boom"}, "warm": warm}]
    text = mod.table(rows)
    assert "| 16x4096x4096 | ours | 20.0 | 3.0 | 0.2 | 6.0 | ours | 5/0 | 1.0e-03 |" in text
    assert "exit 1: boom" in text


def test_a_fresh_process_gets_its_own_caches_and_reports_its_result(monkeypatch, tmp_path):
    fresh_process = _benchmark_script("fresh_process", monkeypatch)
    code = ("import json, os, sys; print('noise'); print('RESULT ' + json.dumps("
            "{k: os.environ[k] for k in ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR', 'INDUCTOR_CUTE_CACHE_DIR')}"
            " | {'args': sys.argv[1:]}))")
    result = fresh_process.run_child(code, ["a", "7"], str(tmp_path), 60)
    assert result == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                      "INDUCTOR_CUTE_CACHE_DIR": str(tmp_path / "cute"), "args": ["a", "7"]}
    failed = fresh_process.run_child("import sys; print('boom', file=sys.stderr); sys.exit(3)", [], str(tmp_path), 60)
    assert failed == {"error": "exit 3: boom"}


def test_model_compile_cost_script_parses_and_tabulates(monkeypatch):
    mod = _benchmark_script("model_compile_cost", monkeypatch)
    compile(mod.CHILD, "child", "exec")
    assert mod.parse_case("llama3-8b decode B8 KV8192 cg") == ["llama3-8b", "decode", "8", "8192", "cg"]
    assert mod.parse_case("llama3-8b prefill B1 x4096 nocg") == ["llama3-8b", "prefill", "1", "4096", "nocg"]
    run = {"graphs_lowered": 4, "fx_hits": 0}
    rows = {"stock": ({**run, "seconds": 100.0, "our_call_sites": 0}, {**run, "seconds": 30.0, "our_call_sites": 0}),
            "ours": ({**run, "seconds": 90.0, "our_call_sites": 8}, {**run, "seconds": 9.0, "our_call_sites": 8})}
    text = mod.table("llama3-8b decode B8 KV8192 cg", 4, rows)
    assert "| ours | 90.0 | 9.0 | 4/4 | 8/8 | 0 |" in text and "cold 0.90x, warm 0.30x" in text
    rows["ours"] = ({"error": "timed out after 400 s"}, rows["ours"][1])
    assert "timed out after 400 s" in mod.table("c", 4, rows) and "warm 0." not in mod.table("c", 4, rows)


def test_decode_layer_compiles_with_its_cache_write():
    """The decoder layer's decode step (in-place KV-cache write, GQA attention) goes through
    dynamo and Inductor and matches eager; tiny sizes, on the CPU."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = e2e.DecoderLayer(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16).requires_grad_(False)
    layer.attach_cache(torch.randn(3, 2, 12, 16), torch.randn(3, 2, 12, 16))
    x = torch.randn(3, 1, 64)
    with torch.no_grad():
        ref = layer(x)
    c = gemm_compiled.compile_now(layer, (x,), mode=None, ours=False, backends="ATEN")
    torch.testing.assert_close(c.run(), ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
