"""The backward kernels (preprocess, dK/dV, dQ) compiled for sm_90a on the CPU: head dims, dtypes,
mask programs and block masks, checked in PTX and in ptxas's resource report; the configuration
limits, the specs and the eager entry's input checks."""

import dataclasses
import math
import re

import pytest

from inductor_cute.kernels.attention.flex_backward_config import (HEAD_DIMS, KERNEL_MODULES, SMEM_BUDGET,
                                                                  FlexBackwardConfig, FlexBackwardProblem,
                                                                  backward_flops, config_error, default_config,
                                                                  from_params, padded_rows, smem_bytes, specs,
                                                                  sparse_block_reason, unsupported_reason)
from inductor_cute.kernels.attention.flex_prefill_config import attention_flops
from inductor_cute.kernels.common.programs.score import dumps
from inductor_cute.runtime.compiler import compile_spec
from sass import sass

CAUSAL = dumps([["o", "ge", "q", "kv"]])
DOCUMENT = dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["o", "eq", "qd", "kd"]])
SOFTCAP = dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = dumps([["d", "sub", "kv", "q"], ["df", "float", "d"], ["sl", "load", "t0", "h"], ["bi", "mul", "sl", "df"],
               ["o", "add", "score", "bi"]])

PROBLEMS = {
    "d128": FlexBackwardProblem(128, 128, "bfloat16"),
    "d64-fp16": FlexBackwardProblem(64, 64, "float16"),
    "d128-causal-block128": FlexBackwardProblem(128, 128, "bfloat16", mask_program=CAUSAL, sparse_block=128),
    "d64-document-block256-q256": FlexBackwardProblem(64, 64, "bfloat16", mask_program=DOCUMENT,
                                                      mask_dtypes=("int32",), sparse_block=256, sparse_q_block=256),
}
OVERLAP = {"dkdv": dict(overlap=True), "dq": dict(dq_overlap=True)}
# (kernel, problem name, overlapped schedule)
MAIN_VARIANTS = ([(kernel, name, False) for kernel in ("dkdv", "dq") for name in sorted(PROBLEMS)] +
                 [("dkdv", "d64-fp16", True), ("dq", "d128-causal-block128", True)])


@pytest.fixture(scope="module")
def compiled_all():
    return {}


@pytest.fixture(scope="module", params=MAIN_VARIANTS,
                ids=[f"{k}-{n}" + ("-overlap" if o else "") for k, n, o in MAIN_VARIANTS])
def compiled(request, compiled_all):
    kernel, name, overlap = request.param
    problem = PROBLEMS[name]
    config = dataclasses.replace(default_config(problem), **(OVERLAP[kernel] if overlap else {}))
    obj = compile_spec(specs(problem, config)[kernel], "sm_90a", keep_ptx=True)
    compiled_all[request.param] = obj
    return obj


@pytest.mark.parametrize("kernel,name,dq_reduce", [
    (kernel, name, False) for kernel in ("dkdv", "dq") for name in ("d128", "d64-fp16", "d128-causal-block128")
] + [("dkdv", "d128", True)])  # (dq_reduce runs no dQ kernel)
def test_exp_under_dp_commits_s_and_dp_apart(kernel, name, dq_reduce, tmp_path):
    problem = PROBLEMS[name]
    config = dataclasses.replace(default_config(problem, dq_reduce=dq_reduce), exp_under_dp=True)
    obj = compile_spec(specs(problem, config)[kernel], "sm_90a", keep_ptx=True)
    assert_no_spills(obj)
    assert "wgmma.mma_async instructions are serialized" not in obj.ptxas_report
    # S and dP each committed and waited apart (wait_group 1, then 0), then the gradient products
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", obj.ptx)
    plain = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", compile_spec(
        specs(problem, dataclasses.replace(config, exp_under_dp=False))[kernel], "sm_90a", keep_ptx=True).ptx)
    assert len(waits) == len(plain) + 1 and waits.count("1") == plain.count("1") + 1
    assert "exp_under_dp" in config.as_params() and "exp_under_dp" not in default_config(problem).as_params()
    # and ptxas keeps the exponentials between the two waits (without the hold it waited for dP
    # first in the dQ kernel and with dq_reduce): a thread's 32 values of the 64 x 64 block, after
    # one wait_group 1 (with dq_reduce the other is dQ's)
    marks = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2", sass(obj, tmp_path))
    between = re.findall(r"1(E*)0", "".join("E" if m == "MUFU.EX2" else m[-1] for m in marks))
    assert sorted(len(run) for run in between)[-1:] == [32]


def test_exp_under_dp_is_refused_where_it_would_serialize():
    problem = FlexBackwardProblem(192, 128, "bfloat16")
    assert "serializes" in config_error(dataclasses.replace(default_config(problem), exp_under_dp=True), problem)
    softcap = FlexBackwardProblem(128, 128, "bfloat16", score_program=SOFTCAP)
    assert "score program" in config_error(dataclasses.replace(default_config(softcap), exp_under_dp=True), softcap)
    plain = PROBLEMS["d64-fp16"]
    overlapped = dataclasses.replace(default_config(plain), exp_under_dp=True, overlap=True)
    assert "sequential" in config_error(overlapped, plain)


def assert_no_spills(compiled):
    report = compiled.ptxas_report
    assert report and report.count("Used") == 1
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx


def test_main_kernels_use_tma_wgmma_setmaxnreg_and_exp2(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert len(re.findall(r"^\.visible \.entry ", ptx, re.M)) == 1
    # the resident tiles and the ring's blocks come by TMA on mbarriers
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert "ex2.approx" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx


def test_main_kernels_have_no_spills_and_balance_setmaxnreg(compiled):
    assert_no_spills(compiled)
    # 384 threads launch with 168 registers; 24 * 128 + 240 * 256 = 168 * 384
    assert "Used 168 registers" in compiled.ptxas_report
    assert "setmaxnreg' ignored" not in compiled.ptxas_report.replace("''", "'")
    assert "wgmma.mma_async instructions are serialized" not in compiled.ptxas_report  # C7512/C7519


def test_two_products_from_shared_memory_and_the_gradients_from_registers(compiled_all, compiled):
    # dK/dV: S^T and dP^T (SS: both descriptors), dV and dK (RS: {A registers}); dQ: S and dP
    # (SS), dQ (RS). One k16 WGMMA per 16 of the contracted dim: for 128/128 dK/dV 8 + 8 + 4 + 4.
    # The overlapped schedule issues each at two sites (the first block's S, the last's gradients)
    lines = [line for line in compiled.ptx.splitlines() if "wgmma.mma_async" in line]
    ss = [line for line in lines if line.count("{") == 1]
    rs = [line for line in lines if line.count("{") == 2]
    assert ss and rs and len(ss) + len(rs) == len(lines)
    kernel, name, overlap = next(key for key, obj in compiled_all.items() if obj is compiled)
    d = PROBLEMS[name].head_dim_qk
    sites = 2 if overlap else 1
    if kernel == "dkdv":
        assert (len(ss), len(rs)) == (sites * 2 * d // 16, sites * 2 * 64 // 16)
    else:
        assert (len(ss), len(rs)) == (sites * 2 * d // 16, sites * 64 // 16)
    # S (S^T) and dP (dP^T) are 64 x 64 per warp group with both operands K-major (no transpose
    # flags); the gradient products read their B (dO, Q or K) MN-major through the transposed
    # view: the transpose-B flag is set and N is the head dim
    dtype = "f16" if "fp16" in name else "bf16"
    assert all(re.search(rf"\.m64n64k16\.f32\.{dtype}\.{dtype} .*, p, 1,\s+1, 0, 0;$", line) for line in ss)
    assert all(re.search(rf"\.m64n{d}k16\.f32\.{dtype}\.{dtype} .*, p, 1,\s+1, 1;$", line) for line in rs)


def test_masks_reach_the_main_kernels(compiled_all):
    needed = [(k, n, False) for k in ("dkdv", "dq") for n in ("d128", "d128-causal-block128")]
    if not all(n in compiled_all for n in needed):
        pytest.skip("needs the module's compiled variants (run the whole file)")

    def compares(ptx):
        return len(re.findall(r"setp\.(?:ge|lt|le|gt)\.s32", ptx))

    for kernel in ("dkdv", "dq"):
        plain = compiled_all[(kernel, "d128", False)].ptx
        causal = compiled_all[(kernel, "d128-causal-block128", False)].ptx
        # the block lists are read from global memory; the mask program compares each element's
        # query and key (32 per thread and 64 x 64 tile)
        assert causal.count("ld.global") > plain.count("ld.global")
        assert compares(causal) >= compares(plain) + 32


@pytest.mark.parametrize("name,ds_buffers", [("d128", 1), ("d128", 2), ("d128-causal-block128", 2), ("d128-fp16", 2),
                                             ("d64-fp16", 1), ("d64-fp16", 2)])
def test_dq_reduce_adds_a_third_product_from_shared_memory_and_one_tma_reduce(name, ds_buffers):
    # dq_reduce: the dK/dV kernel also issues dQ = dS K (SS, both operands MN-major: transpose
    # flags 1, 1; N = 64 per warp group: at d128 half the columns over 128 keys, 8 k16 steps; at
    # d64 all columns over the warp group's 64 keys, 4), stores dS^T and its dQ product to shared
    # memory and adds the product to the workspace with one TMA reduce per block
    problem = PROBLEMS[name] if name in PROBLEMS else FlexBackwardProblem(128, 128, "float16")
    d = problem.head_dim_qk
    config = dataclasses.replace(default_config(problem, dq_reduce=True), ds_buffers=ds_buffers)
    compiled = compile_spec(specs(problem, config)["dkdv"], "sm_90a", keep_ptx=True)
    dtype = "f16" if "fp16" in name else "bf16"
    assert_no_spills(compiled)
    assert "Used 168 registers" in compiled.ptxas_report
    ptx = compiled.ptx
    lines = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    dq = [line for line in lines if re.search(rf"\.m64n64k16\.f32\.{dtype}\.{dtype} .*, p, 1,\s+1, 1, 1;$", line)]
    dq_steps = 128 // 16 if d == 128 else 64 // 16
    assert len(lines) == 2 * d // 16 + 2 * 64 // 16 + dq_steps and len(dq) == dq_steps
    # one reduce per 8-column strip of the staging tile, issued by one elected lane, the tile reused
    # only after the TMA unit read it (wait_group.read), all reduces complete before the CTA ends
    reduces = [m.start() for m in re.finditer(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)]
    assert len(reduces) == 64 // 8
    staged = [m.end() for m in re.finditer(r"bar\.sync \t%r\d+, 128;", ptx)][-1]
    assert staged < reduces[0] and "elect.sync" in ptx[staged:reduces[0]]
    # the staging: 16 two-word stores per thread (its 32 fp32 accumulators), none scalar
    assert len(re.findall(r"st\.shared\.v2\.b32", ptx)) == 16
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    assert "fence.proxy.async.shared::cta" in ptx
    # each warp group's staging barrier (ids 2, 3) twice; the consumers' meetings (id 1)
    meetings = [m.start() for m in re.finditer(r"bar\.sync \t1, 256;", ptx)]
    assert len(re.findall(r"bar\.sync \t%r\d+, 128;", ptx)) == 2
    waits = [(m.start(), m.group(1)) for m in re.finditer(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    first_dq = ptx.index(dq[0])
    if ds_buffers == 1:
        # around sdS, twice; dQ committed before dV and dK and waited alone (wait_group 1): its
        # staging and reduce run while dV and dK still accumulate (wait_group 0 after the reduce)
        assert len(meetings) == 2
        assert [n for pos, n in waits if pos < reduces[0]][-1] == "1"
        assert [n for pos, n in waits if pos > reduces[0]][0] == "0"
    else:
        # once, after the warp group issued dV and dK (RS: P^T and dS^T from registers) and before
        # dQ; the dS buffer of the block's parity (two sdS buffers)
        (meeting,) = meetings
        grads = [ptx.index(line) for line in lines if line not in dq][-(d // 16 + 64 // 16):]
        assert max(grads) < meeting < first_dq
        assert [n for pos, n in waits if pos < reduces[0]][-1] == "0"


# (thread, value) of dq_reduce's dQ accumulator -> its word in the kernel's staging tile, evaluated
# with the DSL's layout algebra from the kernel's own layouts, in a process of its own (the DSL
# keeps the first target it was set up for)
STAGING_WORDS = """
import json, sys
import cutlass, cutlass.cute as cute
from inductor_cute.kernels.attention.flex_backward_config import FlexBackwardProblem, default_config
from inductor_cute.kernels.attention.flex_backward_sm90 import FlexBackwardSm90
problem = FlexBackwardProblem(int(sys.argv[1]), int(sys.argv[1]), "bfloat16")
words = []

@cute.jit
def evaluate():
    kernel = FlexBackwardSm90(problem, default_config(problem, dq_reduce=True))
    kernel._setup()
    tv = kernel._make_mma_dq().tv_layout_C  # (thread, value) -> element of the (64, cols) tile
    tile = cute.slice_(kernel.sdQ_layout, (None, None, 0))
    for t in cutlass.range_constexpr(128):
        for v in cutlass.range_constexpr(cute.size(tv, mode=[1])):
            element = cute.crd2idx((t, v), tv)
            words.append((t, v, int(cute.crd2idx((element % 64, element // 64), tile))))

evaluate()
print(json.dumps(words))
"""


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_reduce_staging_stores_are_conflict_free(head_dim, tmp_path):
    # each warp's two-word store of its dQ accumulators (8 rows x 4 column pairs) must cover 64
    # words on 32 banks in 2 wavefronts (whole 256-byte rows, the first version, took 8)
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "staging_words.py"  # the DSL reads a jit function's source from its file
    script.write_text(STAGING_WORDS)
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    done = subprocess.run([sys.executable, str(script), str(head_dim)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    words = {(t, v): w for t, v, w in json.loads(done.stdout.splitlines()[-1])}
    values = 1 + max(v for _, v in words)
    assert values == 32 and len(set(words.values())) == 128 * 32  # every element once
    for warp in range(4):
        for v in range(0, values, 2):  # a pair of consecutive values is one st.shared.v2
            lanes = [words[(32 * warp + lane, v + i)] for lane in range(32) for i in (0, 1)]
            per_bank = [{w for w in lanes if w % 32 == bank} for bank in range(32)]
            assert max(len(b) for b in per_bank) == 2, (warp, v)


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_head_dims_64_32_fit_without_spills(kernel):
    # PyTorch's tests' 32-wide values (the eager entry takes them; the lowering once the GPU has)
    problem = FlexBackwardProblem(64, 32, "bfloat16", mask_program=CAUSAL, sparse_block=128)
    assert_no_spills(compile_spec(specs(problem, default_config(problem))[kernel], "sm_90a", keep_ptx=True))


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_head_dims_192_128_fit_without_spills(kernel):
    # DeepSeek's MLA: dK (96 fp32 registers per consumer thread) and dV (64) beside S^T and dP^T.
    # Without a mask nothing spills; the causal block-sparse dK/dV kernel spills a few words
    # (24 bytes stored, 36 loaded per thread), which the first GPU timing is to weigh
    plain = FlexBackwardProblem(192, 128, "bfloat16")
    problem = dataclasses.replace(plain, mask_program=CAUSAL, sparse_block=128)
    config = default_config(problem)
    assert config == FlexBackwardConfig(3, 3) == default_config(plain)
    assert_no_spills(compile_spec(specs(plain, config)[kernel], "sm_90a", keep_ptx=True))
    compiled = compile_spec(specs(problem, config)[kernel], "sm_90a", keep_ptx=True)
    spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled.ptxas_report)
    assert int(spilled[1]) <= 32 and int(spilled[2]) <= 48
    assert "Used 168 registers" in compiled.ptxas_report
    lines = [line for line in compiled.ptx.splitlines() if "wgmma.mma_async" in line]
    ss = [line for line in lines if line.count("{") == 1]
    # S (K = 192: 12 k16 steps) and dP (K = 128: 8) from shared memory; the gradient products
    # from registers: dK (N 192) and dV (N 128) over 64 queries, or dQ (N 192) over 64 keys
    assert len(ss) == 12 + 8 and len(lines) - len(ss) == (8 if kernel == "dkdv" else 4)
    assert sum(".m64n192k16" in line for line in lines) == 4  # dK's or dQ's 4 k16 steps


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("name", ["softcap-d128", "alibi-causal-d64"])
def test_score_mods_and_their_derivatives_compile_into_both_main_kernels(kernel, name):
    problem = {"softcap-d128": FlexBackwardProblem(128, 128, "bfloat16", score_program=SOFTCAP),
               "alibi-causal-d64": FlexBackwardProblem(64, 64, "bfloat16", mask_program=CAUSAL, sparse_block=128,
                                                       score_program=ALIBI, score_dtypes=("float32",))}[name]
    plain = dataclasses.replace(problem, score_program="", score_dtypes=())
    compiled = compile_spec(specs(problem)[kernel], "sm_90a", keep_ptx=True)
    without = compile_spec(specs(plain)[kernel], "sm_90a", keep_ptx=True)
    assert_no_spills(compiled)
    assert "Used 168 registers" in compiled.ptxas_report
    if name.startswith("softcap"):  # tanh (IEEE: through ex2) on top of P's ex2, per element
        assert compiled.ptx.count("ex2.approx") > without.ptx.count("ex2.approx")
    else:  # the slopes come from the captured tensor
        assert compiled.ptx.count("ld.global") > without.ptx.count("ld.global")


@pytest.mark.parametrize("head_dim, dtype", [(128, "bfloat16"), (64, "float16")])
def test_preprocess_compiles_without_spills_and_reduces_over_a_warp(head_dim, dtype):
    spec = specs(FlexBackwardProblem(head_dim, head_dim, dtype))["preprocess"]
    compiled = compile_spec(spec, "sm_90a", keep_ptx=True)
    assert_no_spills(compiled)
    assert "shfl.sync.bfly" in compiled.ptx
    assert "wgmma" not in compiled.ptx


def test_shared_memory_fits_and_matches_the_kernel_layouts():
    # the kernels assert at trace time that their shared storage is smem_bytes: compiling checks it
    for dims in HEAD_DIMS:
        problem = FlexBackwardProblem(*dims, "bfloat16")
        cfg = default_config(problem)
        assert config_error(cfg, problem) is None
        assert smem_bytes(problem, cfg, "dkdv") <= SMEM_BUDGET and smem_bytes(problem, cfg, "dq") <= SMEM_BUDGET
    # 128/128: K and V (64 KB) + 4 stages of Q and dO (4 x 32 KB) + barriers
    assert smem_bytes(FlexBackwardProblem(128, 128, "bfloat16"), FlexBackwardConfig(4, 4)) == 1024 + 65536 + 131072
    assert default_config(FlexBackwardProblem(128, 128, "bfloat16")) == FlexBackwardConfig(4, 4)


def test_unsupported_problems_and_configs_are_named():
    assert "dtype float32" in unsupported_reason(128, 128, "float32")
    assert unsupported_reason(192, 128, "bfloat16") is None and "head dims 128/192" in unsupported_reason(128, 192,
                                                                                                      "bfloat16")
    assert "head dims 256/256" in unsupported_reason(256, 256, "bfloat16")
    assert unsupported_reason(64, 64, "float16") is None and unsupported_reason(128, 128, "bfloat16") is None
    p = FlexBackwardProblem(128, 128, "bfloat16")
    assert "stages must be in 1..4" in config_error(FlexBackwardConfig(0, 2), p)
    assert "dq_stages" in config_error(FlexBackwardConfig(2, 5), p)
    assert "overlap (dK/dV) spills registers at head dims 128/128" in config_error(FlexBackwardConfig(2, 2, True), p)
    assert config_error(FlexBackwardConfig(2, 2, False, True), p) is None
    assert config_error(FlexBackwardConfig(2, 2, True, True), dataclasses.replace(p, head_dim_qk=64, head_dim_v=64)) \
        is None
    assert "dq_overlap needs at least 2 stages" in config_error(FlexBackwardConfig(2, 1, False, True), p)
    assert config_error(FlexBackwardConfig(3, 4, dq_reduce=True), p) is None
    assert "dkdv: 246784 bytes" in config_error(FlexBackwardConfig(4, 4, dq_reduce=True), p)
    assert "built for head dims 64/64 and 128/128, not 192/128" in config_error(
        FlexBackwardConfig(2, 2, dq_reduce=True), dataclasses.replace(p, head_dim_qk=192))
    assert default_config(p, dq_reduce=True) == FlexBackwardConfig(3, 4, dq_reduce=True, ds_buffers=2)
    assert default_config(dataclasses.replace(p, head_dim_qk=64, head_dim_v=64), dq_reduce=True) == \
        FlexBackwardConfig(4, 4, dq_reduce=True, ds_buffers=2)
    assert smem_bytes(p, FlexBackwardConfig(3, 4, dq_reduce=True, ds_buffers=2)) - \
        smem_bytes(p, FlexBackwardConfig(3, 4, dq_reduce=True)) == 128 * 64 * 2  # a second dS block
    assert "ds_buffers 2 must be 1, or 2 with dq_reduce" in config_error(FlexBackwardConfig(2, 2, ds_buffers=2), p)
    assert "ds_buffers" not in FlexBackwardConfig(2, 2).as_params()  # older specs keep their keys
    assert "not overlap" in config_error(FlexBackwardConfig(2, 2, overlap=True, dq_reduce=True), p)
    assert "dq_overlap must be off" in config_error(FlexBackwardConfig(2, 2, dq_overlap=True, dq_reduce=True), p)
    assert "KV block size 64" in config_error(default_config(p), dataclasses.replace(p, sparse_block=64))
    assert "query block size 64" in config_error(default_config(p), dataclasses.replace(p, sparse_q_block=64))
    assert "canonical" in config_error(default_config(p), dataclasses.replace(p, mask_program=CAUSAL + " "))
    assert "must end in a float" in config_error(default_config(p), dataclasses.replace(p, score_program=CAUSAL))
    assert config_error(default_config(p), dataclasses.replace(p, score_program=SOFTCAP)) is None
    assert "unknown argument 'score'" in config_error(default_config(p), dataclasses.replace(p, mask_program=SOFTCAP))
    with pytest.raises(ValueError, match="not supported"):
        specs(FlexBackwardProblem(96, 96, "bfloat16"))
    assert sparse_block_reason(128, 128) is None and sparse_block_reason(256, 512) is None
    assert "KV block" in sparse_block_reason(64, 128) and "query block" in sparse_block_reason(128, 64)


def test_specs_spell_problem_and_config_and_read_back():
    problem = FlexBackwardProblem(128, 128, "bfloat16", DOCUMENT, ("int32",), 256, 128)
    s = specs(problem)
    assert set(s) == {"preprocess", "dkdv", "dq"}
    assert {k: v.module for k, v in s.items()} == KERNEL_MODULES
    assert s["preprocess"].kwargs == {"head_dim_v": 128, "dtype_name": "bfloat16"}
    for kernel in ("dkdv", "dq"):  # dq_reduce off: the specs' keys as before it existed
        assert set(s[kernel].kwargs) == set(problem.as_params()) | {"stages", "dq_stages", "overlap", "dq_overlap"}
        assert from_params(s[kernel].kwargs) == (problem, default_config(problem))
    with_score = dataclasses.replace(problem, score_program=ALIBI, score_dtypes=("float32",))
    assert {"score_program", "score_dtypes"} <= set(specs(with_score)["dq"].kwargs)
    assert from_params(specs(with_score)["dkdv"].kwargs)[0] == with_score
    reduced = specs(problem, FlexBackwardConfig(3, 4, dq_reduce=True))
    assert set(reduced) == {"preprocess", "dkdv"} and reduced["dkdv"].kwargs["dq_reduce"] is True
    assert from_params(reduced["dkdv"].kwargs)[1] == FlexBackwardConfig(3, 4, dq_reduce=True)


def test_floor_counts_five_products_two_and_a_half_forwards():
    # S, dP, dV, dK, dQ: with Dqk = Dv, 2.5x the forward's S and O = P V
    assert backward_flops(2, 8, 1000, 3000, 128, 128) == 2.5 * attention_flops(2, 8, 1000, 3000, 128, 128)
    assert backward_flops(1, 16, 8192, 8192, 128, 128, causal=True) == 8192 ** 2 * 16 * 128 * 5
    assert padded_rows(1) == 128 and padded_rows(300) == 384 and padded_rows(0) == 128


def test_flex_backward_refuses_cpu_tensors():
    import torch

    from inductor_cute import UnsupportedError
    from inductor_cute.host.flex_backward import flex_attention_backward

    q = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 100)
    with pytest.raises(UnsupportedError, match="^flex_backward: tensors must be on a CUDA device, got cpu$"):
        flex_attention_backward(q, q, q, q, lse, q)


class KernelStandIn:
    """Records the exported kernels' arguments in place of the compiled kernels."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):
        return lambda *args: self.calls.append((name, args))


@pytest.fixture
def host_on_cpu(monkeypatch):
    """The eager entry on CPU tensors: the device check passes and the kernels are stand-ins."""
    from inductor_cute.host import flex_backward as fb

    recorder = KernelStandIn()
    params = []

    def kernels(*p):
        params.append(p)
        return {name: recorder(name) for name in ("preprocess", "dkdv", "dq")}

    monkeypatch.setattr(fb, "check_cuda", lambda *a: None)
    monkeypatch.setattr(fb, "_flex_backward_kernels", kernels)
    return fb.flex_attention_backward, recorder, params


def _inputs(batch=2, heads=8, kv_heads=2, q_len=300, kv_len=500, d=128):
    import torch

    q = torch.randn(batch, heads, q_len, d).bfloat16()
    k = torch.randn(batch, kv_heads, kv_len, d).bfloat16()
    v = torch.randn(batch, kv_heads, kv_len, d).bfloat16()
    out, grad_out = torch.randn_like(q), torch.randn_like(q)
    return q, k, v, out, torch.zeros(batch, heads, q_len), grad_out


def test_host_runs_the_three_kernels_with_their_arguments(host_on_cpu):
    import torch

    backward, recorder, params = host_on_cpu
    q, k, v, out, lse, grad_out = _inputs()
    fwd = (torch.ones(1, 1, 3, dtype=torch.int64), torch.zeros(1, 1, 3, 4, dtype=torch.int64))
    bwd = (torch.ones(1, 1, 2, dtype=torch.int64), torch.zeros(1, 1, 2, 3, dtype=torch.int64))
    dq, dk, dv = backward(q, k, v, out, lse, grad_out, scale=0.5, mask_mod=CAUSAL, kv_num_blocks=fwd[0],
                          kv_indices=fwd[1], q_num_blocks=bwd[0], q_indices=bwd[1], kv_block_size=256)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert [name for name, _ in recorder.calls] == ["preprocess", "dkdv", "dq"]
    assert params == [(128, 128, "bfloat16", CAUSAL, (), 256, 128, None, "", ())]
    (_, pre), (_, dkdv), (_, dqk) = recorder.calls
    delta, lse2 = pre[3], pre[4]
    assert delta.shape == lse2.shape == (2, 8, 384) and delta.dtype == torch.float32
    assert len(dkdv) == 23 and dkdv[4] is lse2 and dkdv[5] is delta and dkdv[6] is dk and dkdv[7] is dv
    assert math.isclose(dkdv[8], 0.5 / math.log(2)) and dkdv[9] == 0.5
    assert torch.equal(dkdv[10], bwd[0].int()) and torch.equal(dkdv[12], torch.zeros(1, 1, 2, dtype=torch.int32))
    assert len(dqk) == 21 and dqk[6] is dq and torch.equal(dqk[10], fwd[1].int())
    assert all(t is None for t in dkdv[14:] + dqk[13:])


def test_host_with_dq_reduce_gives_the_dk_dv_kernel_a_zeroed_workspace_and_casts_it_to_dq(monkeypatch):
    import torch

    from inductor_cute.host import flex_backward as fb

    q, k, v, out, lse, grad_out = _inputs(q_len=300)
    workspaces = []

    def dkdv(*args):  # the kernel adds its dQ products into the workspace: here, known values
        workspaces.append(args[-1].clone())
        args[-1].copy_(torch.arange(args[-1].numel(), dtype=torch.float32).reshape(args[-1].shape) % 251 / 8)

    asked = []
    monkeypatch.setattr(fb, "check_cuda", lambda *a: None)
    monkeypatch.setattr(fb, "_flex_backward_kernels",
                        lambda *p: asked.append(p) or {"preprocess": lambda *a: None, "dkdv": dkdv})
    config = FlexBackwardConfig(3, 4, dq_reduce=True)
    dq, dk, dv = fb.flex_attention_backward(q, k, v, out, lse, grad_out, config=config)
    assert asked[0][7] == config and "dq" not in specs(FlexBackwardProblem(128, 128, "bfloat16"), config)
    (workspace,) = workspaces
    assert workspace.shape == (2, 8, 384, 128) and workspace.dtype == torch.float32 and not workspace.any()
    expected = (torch.arange(workspace.numel(), dtype=torch.float32).reshape(workspace.shape) % 251 / 8)[:, :, :300]
    assert dq.dtype == q.dtype and torch.equal(dq, expected.bfloat16())


def test_host_passes_a_score_mod_and_its_tensors_to_both_main_kernels(host_on_cpu):
    import torch

    backward, recorder, params = host_on_cpu
    q, k, v, out, lse, grad_out = _inputs()
    slopes = torch.rand(8)
    backward(q, k, v, out, lse, grad_out, score_mod=ALIBI, score_tensors=(slopes,))
    assert params == [(128, 128, "bfloat16", "", (), 0, 128, None, ALIBI, ("float32",))]
    (_, _), (_, dkdv), (_, dqk) = recorder.calls
    assert dkdv[18] is slopes and dkdv[19:] == (None, None, None, None)  # s0..s3, then no dq workspace
    assert dqk[17] is slopes and dqk[18:] == (None, None, None)


def test_host_pads_lse_and_delta_over_every_query_block_the_mask_has(host_on_cpu):
    import torch

    backward, recorder, _ = host_on_cpu
    q, k, v, out, lse, grad_out = _inputs(q_len=300)
    lists = dict(kv_num_blocks=torch.ones(1, 1, 2, dtype=torch.int32), kv_indices=torch.zeros(1, 1, 2, 2),
                 q_num_blocks=torch.ones(1, 1, 4, dtype=torch.int32), q_indices=torch.zeros(1, 1, 4, 2))
    lists["kv_indices"], lists["q_indices"] = lists["kv_indices"].int(), lists["q_indices"].int()
    backward(q, k, v, out, lse, grad_out, q_block_size=256, **lists)
    assert recorder.calls[0][1][3].shape == (2, 8, 512)  # 2 mask query blocks of 256 rows


def test_host_refuses_what_the_kernels_cannot_take(host_on_cpu):
    import torch

    from inductor_cute import UnsupportedError

    backward, recorder, _ = host_on_cpu
    q, k, v, out, lse, grad_out = _inputs(batch=1, heads=4, kv_heads=4, kv_len=300)
    num = torch.ones(1, 1, 3, dtype=torch.int32)
    idx = torch.zeros(1, 1, 3, 4, dtype=torch.int32)
    lists = dict(kv_num_blocks=num, kv_indices=idx, q_num_blocks=num, q_indices=idx)
    d96 = [t[..., :96] if t.dim() == 4 else t for t in (q, k, v, out, lse, grad_out)]
    cases = [
        (lambda: backward(*d96), "head dims 96/96"),
        (lambda: backward(q, k, v, out, lse, grad_out, score_mod=CAUSAL), "score_mod: score program must end"),
        (lambda: backward(q, k, v, out, lse, grad_out, score_tensors=(num.flatten(),)), "without a score_mod"),
        (lambda: backward(q, k[:, :3], v[:, :3], out, lse, grad_out), "not a multiple of 3 KV heads"),
        (lambda: backward(q, k, v, out[:, :, :10], lse, grad_out), "out must be"),
        (lambda: backward(q, k, v, out, lse, grad_out.half()), "grad_out must be"),
        (lambda: backward(q, k, v, out, lse.double(), grad_out), "lse must be"),
        (lambda: backward(q, k, v, out, lse, grad_out, mask_tensors=(num.flatten(),)), "without a mask_mod"),
        (lambda: backward(q, k, v, out, lse, grad_out, mask_mod=SOFTCAP), "mask_mod: "),
        (lambda: backward(q, k, v, out, lse, grad_out, kv_num_blocks=num, kv_indices=idx), "q_num_blocks"),
        (lambda: backward(q, k, v, out, lse, grad_out, **{**lists, "kv_num_blocks": num[..., :2],
                                                            "kv_indices": idx[:, :, :2]}), "do not cover 300"),
        # (sizes dividing 128 are walked coarsened: walked_block_masks, test_flex_block_walk.py)
        (lambda: backward(q, k, v, out, lse, grad_out, kv_block_size=96, **lists), "KV block size 96"),
        (lambda: backward(q, k, v, out, lse, grad_out, q_block_size=96, **lists), "query block size 96"),
        (lambda: backward(q, k, v, out, lse, grad_out, config=FlexBackwardConfig(2, 2, overlap=True)), "spills"),
    ]
    for call, message in cases:
        with pytest.raises(UnsupportedError, match=message) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("flex_backward: ")
    assert not recorder.calls


def test_host_answers_empty_problems_without_the_kernels(host_on_cpu):
    import torch

    backward, recorder, _ = host_on_cpu
    q = torch.randn(1, 2, 5, 64).half()
    empty = q[:, :, :0]
    dq, dk, dv = backward(q, empty, empty, q, torch.zeros(1, 2, 5), q)
    assert (dq == 0).all() and dk.shape == (1, 2, 0, 64) and not recorder.calls


def test_host_takes_torch_block_masks_as_built(host_on_cpu):
    # both list sets of a BlockMask torch builds (on the CPU here), GQA with a per-head mask
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    backward, recorder, params = host_on_cpu
    q, k, v, out, lse, grad_out = _inputs(q_len=300, kv_len=500)
    bm = create_block_mask(lambda b, h, m, n: m >= n, 2, 8, 300, 500, device="cpu", BLOCK_SIZE=128)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
             "full_q_num_blocks", "full_q_indices")
    backward(q, k, v, out, lse, grad_out, mask_mod=CAUSAL, **{n: getattr(bm, n) for n in names})
    (_, pre), (_, dkdv), (_, dq) = recorder.calls
    assert params[0][5:7] == (128, 128)
    assert all(torch.equal(a, getattr(bm, n)) for a, n in zip(dkdv[10:14], names[4:]))
    assert all(torch.equal(a, getattr(bm, n)) for a, n in zip(dq[9:13], names[:4]))
    assert pre[3].shape == (2, 8, 384)
