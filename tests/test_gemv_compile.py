"""The decode GEMV compiled for sm_90a on the CPU: dtypes, epilogues and token tiles, checked in
PTX and in ptxas's resource report; the config limits and the split heuristic."""

import dataclasses
import re

import pytest

from inductor_cute.kernels.common.programs.epilogue import dumps
from inductor_cute.kernels.gemm.config import GemmProblem
from inductor_cute.kernels.gemm.gemv_config import (MAX_REGISTERS, GemvConfig, candidates, default_config, spec, splits,
                                                    unsupported_reason, workspace_sizes)
from inductor_cute.runtime.compiler import compile_spec, ptx_fingerprint
from ptx_order import check_waits_then_releases, entries

BF16 = GemmProblem("bfloat16", "bfloat16", "k", "k")
PROGRAM = dumps([["v0", "add", "acc", "row"], ["v1", "mul", "full", 0.5], ["v2", "add", "v0", "v1"],
                 ["v3", "sigmoid", "v2"]])

VARIANTS = {
    "bf16-m8": (BF16, GemvConfig(4, 2048, 4, 1)),
    "bf16-m16": (BF16, GemvConfig(4, 512, 4, 2)),
    "fp16": (GemmProblem("float16", "float16", "k", "k"), GemvConfig(4, 512, 4, 1)),
    "fp32-out": (GemmProblem("bfloat16", "float32", "k", "k"), GemvConfig(4, 512, 4, 2)),
    "bias-residual-gelu": (GemmProblem("bfloat16", "bfloat16", "k", "k", True, True, "gelu_tanh"),
                           GemvConfig(4, 1024, 4, 2)),
    "fp16-bias-silu": (GemmProblem("float16", "float16", "k", "k", True, False, "silu"), GemvConfig(4, 512, 4, 1)),
    "fp32-out-residual": (GemmProblem("bfloat16", "float32", "k", "k", False, True), GemvConfig(4, 512, 4, 1)),
    "epilogue-program": (GemmProblem("bfloat16", "bfloat16", "k", "k", True, True, epilogue=PROGRAM),
                         GemvConfig(4, 512, 4, 2)),
    "8-warps-8-stages": (BF16, GemvConfig(8, 512, 8, 2)),
    # wide steps: each thread copies 2 or 4 K-adjacent vectors per W row and stage
    "wide-2-m16": (BF16, GemvConfig(8, 1024, 6, 2, vecs=2)),
    "wide-2-m8": (BF16, GemvConfig(8, 4096, 6, 1, vecs=2)),
    "wide-2-bias-silu": (GemmProblem("bfloat16", "bfloat16", "k", "k", True, False, "silu"),
                         GemvConfig(4, 512, 4, 1, vecs=2)),
    # more token tiles for an explicit config: M up to 24 and 32
    "m24": (BF16, GemvConfig(8, 1024, 4, 3)),
    "m32-residual": (GemmProblem("bfloat16", "bfloat16", "k", "k", False, True), GemvConfig(8, 1024, 8, 4)),
}


# The one-weight kernel's PTX (runtime.compiler.ptx_fingerprint) as of the dependent-launch wait
# (main after f561f70, CuTe DSL 4.8.1); before it, as of e4a14ae, when the kernel took several
# weights sharing A: the group must not cost the one-weight kernel an instruction. Change these
# only with a deliberate change to that kernel.
SINGLE_WEIGHT_PTX = {
    "8-warps-8-stages": "200caa72d1e5d575", "bf16-m16": "dabcf856d01b5df0", "bf16-m8": "d19670a46855655a",
    "bias-residual-gelu": "9c2bbb11d9b75882", "epilogue-program": "91dbd6cb839c5252", "fp16": "a32cb3802594a3a1",
    "fp16-bias-silu": "85660eb8d652ee4e", "fp32-out": "3ddb013c9026c315", "fp32-out-residual": "4df1078df084766c",
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def compiled(request):
    problem, config = VARIANTS[request.param]
    return compile_spec(spec(problem, config), "sm_90a", keep_ptx=True)


def test_single_weight_ptx_is_unchanged(compiled, request):
    name = request.node.callspec.params["compiled"]
    if name not in SINGLE_WEIGHT_PTX:
        pytest.skip("a variant added after the pin (wide steps, more token tiles): no pinned PTX")
    assert ptx_fingerprint(compiled.ptx) == SINGLE_WEIGHT_PTX[name], f"{name}: the one-weight kernel's PTX changed"


def test_waits_for_the_previous_grid_before_any_global_access_and_then_releases_the_next(compiled):
    (body,) = entries(compiled.ptx)
    check_waits_then_releases(body)


def test_streams_w_with_cp_async_and_feeds_mma_sync(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, 16;", ptx)
    assert "cp.async.commit_group" in ptx and "cp.async.wait_group" in ptx
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16\.bf16|f16\.f16)\.f32", ptx)
    assert "ld.shared.v4.b32" in ptx  # operands come out of shared memory as 16-byte vectors
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_split_k_arrival_is_ordered_and_reads_l2(compiled):
    ptx = compiled.ptx
    assert "atom.global.acq_rel.add.u32" in ptx
    assert ptx.count("fence.acq_rel.gpu") == 2  # publish before arriving, acquire after
    assert "st.global.v4" in ptx and "ld.global.cg.v4" in ptx  # partials: whole fragments, never L1


def test_ptxas_reports_no_spills_and_fits_the_register_cap(compiled):
    report = compiled.ptxas_report
    assert report and "Used" in report
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= MAX_REGISTERS


def test_token_tiles_issue_one_mma_pair_each_per_vector():
    for name, pairs in (("bf16-m8", 1), ("bf16-m16", 2), ("wide-2-m16", 2 * 2), ("wide-2-m8", 2), ("m24", 3),
                        ("m32-residual", 4)):
        problem, config = VARIANTS[name]
        ptx = compile_spec(spec(problem, config), "sm_90a", keep_ptx=True).ptx
        assert ptx.count("mma.sync.aligned") == 2 * pairs


def test_wide_steps_copy_k_adjacent_vectors_per_row():
    # the same config at 1 and 2 vectors: the A slice's copies are the same (it holds k_slice
    # either way), and each of the stages - 1 prologue stages and the mainloop's refill copy
    # 2 rows x vecs W vectors
    def copies(cfg):
        ptx = compile_spec(spec(BF16, cfg), "sm_90a", keep_ptx=True).ptx
        return ptx.count("cp.async.cg.shared.global")

    one, two = GemvConfig(8, 4096, 6, 1), GemvConfig(8, 4096, 6, 1, vecs=2)
    assert copies(two) - copies(one) == 2 * one.stages


def test_wide_step_configs_keep_their_old_specs_at_one_vector():
    assert "vecs" not in GemvConfig().as_params() and GemvConfig(vecs=2).as_params()["vecs"] == 2
    assert spec(BF16, GemvConfig(vecs=2)).name != spec(BF16, GemvConfig()).name
    assert GemvConfig(8, 1024, 6, 2, vecs=2).describe() == "gemv w8 k1024 s6 m16 v2"
    from inductor_cute.kernels.gemm.family import as_tuple, from_tuple

    for cfg in (GemvConfig(), GemvConfig(8, 1024, 6, 2, vecs=2)):
        assert from_tuple(as_tuple(cfg)) == cfg


def test_problems_outside_the_kernel_are_named():
    assert unsupported_reason(BF16, m=8, n=4096, k=4096) is None
    assert "M in 1..16" in unsupported_reason(BF16, m=17, n=4096, k=4096)
    assert "M in 1..16" in unsupported_reason(BF16, m=0, n=4096, k=4096)
    assert "multiples of 8" in unsupported_reason(BF16, m=8, n=4100, k=4096)
    assert "multiples of 8" in unsupported_reason(BF16, m=8, n=4096, k=1001)
    assert "row-major W" in unsupported_reason(GemmProblem("bfloat16", "bfloat16", "k", "n"), m=8, n=4096, k=4096)
    assert "row-major W" in unsupported_reason(GemmProblem("bfloat16", "bfloat16", "m", "k"), m=8, n=4096, k=4096)
    assert "dtype" in unsupported_reason(GemmProblem("float32", "float32", "k", "k"), m=8, n=4096, k=4096)


def test_invalid_configs_are_named():
    assert unsupported_reason(BF16, GemvConfig()) is None
    assert "warps" in unsupported_reason(BF16, GemvConfig(warps=3))
    assert "m_tiles" in unsupported_reason(BF16, GemvConfig(m_tiles=5))
    assert "k_slice" in unsupported_reason(BF16, GemvConfig(k_slice=100))
    assert "stages" in unsupported_reason(BF16, GemvConfig(stages=1))
    assert "shared memory" in unsupported_reason(BF16, GemvConfig(k_slice=8192, m_tiles=2))
    assert "m_tiles=2" in unsupported_reason(BF16, GemvConfig(m_tiles=1), m=9)
    assert "splits" in unsupported_reason(BF16, GemvConfig(k_slice=32), k=4096)
    assert "vecs" in unsupported_reason(BF16, GemvConfig(vecs=4))
    assert "m_tiles must be 1 to 4" in unsupported_reason(BF16, GemvConfig(m_tiles=5))
    assert "at most 2 token tiles" in unsupported_reason(BF16, GemvConfig(k_slice=1024, m_tiles=3, vecs=2))
    # up to 32 rows with an explicit config, but only up to 16 by default (routing and autotuning)
    assert unsupported_reason(BF16, GemvConfig(8, 1024, 4, 4), m=32, n=4096, k=4096) is None
    assert "M in 1..16" in unsupported_reason(BF16, m=17, n=4096, k=4096)
    assert "M in 1..32" in unsupported_reason(BF16, GemvConfig(8, 1024, 4, 4), m=33, n=4096, k=4096)
    assert "m_tiles=3" in unsupported_reason(BF16, GemvConfig(8, 1024, 4, 2), m=20, n=4096, k=4096)
    assert "multiple of 64" in unsupported_reason(BF16, GemvConfig(k_slice=96, vecs=2))


DECODE = [(16, 4096, 4096), (8, 14336, 4096), (8, 6144, 4096), (8, 4096, 14336), (1, 4096, 4096)]


@pytest.mark.parametrize("m,n,k", DECODE + [(1, 8, 8), (16, 1000, 1000), (4, 128256, 4096), (2, 4096, 128000)])
def test_default_config_takes_the_fewest_splits_that_fill_the_sms(m, n, k):
    cfg = default_config(BF16, m, n, k, num_sms=132)
    assert unsupported_reason(BF16, cfg, m=m, k=k) is None
    assert cfg.m_tiles == (1 if m <= 8 else 2)
    n_blocks = -(-n // cfg.n_block)
    s = splits(k, cfg)
    if s > 1:
        fewer = dataclasses.replace(cfg, k_slice=-(-k // (s - 1) // 32) * 32)
        # one split less would leave a quarter of the SMs idle, or not fit in shared memory
        assert n_blocks * (s - 1) < 0.75 * 132 or unsupported_reason(BF16, fewer, m=m, k=k) is not None


@pytest.mark.parametrize("m,n,k", DECODE + [(8, (4096, 1024, 1024), 4096), (1, 4096, 128256), (16, 1000, 1000)])
def test_default_and_alternate_slices_are_whole_lines(m, n, k):
    """Every split starts each W row on a 128-byte line (3 splits of 4096 are 1408, not 1376)."""
    for cfg in candidates(BF16, m, n, k, num_sms=132):
        assert cfg.k_slice * 2 % 128 == 0, cfg
    assert default_config(BF16, 8, (4096, 1024, 1024), 4096, num_sms=132).k_slice == 1408


def test_decode_shapes_split_k_only_when_n_is_short():
    assert splits(4096, default_config(BF16, 16, 4096, 4096)) == 4  # 32 N blocks
    assert splits(14336, default_config(BF16, 8, 4096, 14336)) == 4
    assert splits(4096, default_config(BF16, 8, 14336, 4096)) == 1  # 112 N blocks already fill the SMs
    assert splits(8, default_config(BF16, 1, 8, 8)) == 1


def test_candidates_start_with_the_default_and_are_valid_and_distinct():
    for m, n, k in DECODE + [(16, 1000, 1000)]:
        cands = candidates(BF16, m, n, k)
        assert cands[0] == default_config(BF16, m, n, k) and len(set(cands)) == len(cands) >= 2
        assert all(unsupported_reason(BF16, c, m=m, k=k) is None for c in cands)
        assert len({c.describe() for c in cands}) == len(cands)


def test_workspace_covers_every_fragment():
    cfg = GemvConfig(4, 512, 4, 2)
    partials, counters = workspace_sizes(4096, 4096, cfg)
    assert counters == 4096 // 64
    assert partials == 8 * 64 * 128 * 8  # splits x N blocks x threads x fragment
    assert workspace_sizes(4096, 512, cfg)[0] == 8  # one split: the kernel never touches it
    assert workspace_sizes(4000, 4096, cfg)[1] == 63  # a ragged last N block has its own counter


def test_spec_names_the_whole_problem_and_the_config():
    gemv = spec(BF16, GemvConfig())
    assert gemv.module == "inductor_cute.kernels.gemm.gemv_sm90"
    assert gemv.kwargs["a_major"] == gemv.kwargs["b_major"] == "k" and gemv.kwargs["k_slice"] == 512
    assert spec(BF16, GemvConfig(m_tiles=2)).name != gemv.name


def test_problem_checks_cover_batches_and_configs():
    assert "not batched" in unsupported_reason(BF16, batch=2)
    assert "row-major W" in unsupported_reason(GemmProblem("bfloat16", "bfloat16", "k", "n"), GemvConfig())
    assert "warps" in unsupported_reason(BF16, GemvConfig(warps=3), m=8, n=4096, k=4096)
