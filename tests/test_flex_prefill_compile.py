"""The prefill forward kernel compiled for sm_90a on the CPU: head dims, dtypes, score programs,
mask programs and block masks, checked in PTX and in ptxas's resource report; the configuration
limits, the tile order and the eager entry's input checks."""

import dataclasses
import re

import pytest

from inductor_cute.kernels.attention.flex_prefill_config import (HEAD_DIMS, M_BLOCK, SMEM_BUDGET, TILE_CLAIM_STAGES,
                                                                 FlexPrefillConfig,
                                                                 FlexPrefillProblem, attention_flops, config_error,
                                                                 default_config, from_params, smem_bytes, spec,
                                                                 sparse_block_reason, unsupported_reason)
from inductor_cute.kernels.attention import flex_prefill_config as fpc
from inductor_cute.kernels.attention.softmax import poly_positions
from inductor_cute.kernels.attention.tile_order import L2_KV_BYTES, LongestFirst, section_width
from inductor_cute.kernels.common.programs.score import dumps
from inductor_cute.host.flex_prefill import _flex_prefill_kernel as REAL_KERNEL_FACTORY
from inductor_cute.runtime.compiler import compile_spec
from sass import sass

SOFTCAP = dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
CAUSAL = dumps([["o", "ge", "q", "kv"]])
DOCUMENT = dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["o", "eq", "qd", "kd"]])
ALIBI = dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
               ["o", "add", "score", "bias"]])

VARIANTS = {
    "d128": FlexPrefillProblem(128, 128, "bfloat16"),
    "d256": FlexPrefillProblem(256, 256, "bfloat16"),
    "mla-192-128-causal-block128": FlexPrefillProblem(192, 128, "bfloat16", mask_program=CAUSAL, sparse_block=128),
    "d64-fp16": FlexPrefillProblem(64, 64, "float16"),
    "d128-causal-block128": FlexPrefillProblem(128, 128, "bfloat16", mask_program=CAUSAL, sparse_block=128),
    "d128-softcap": FlexPrefillProblem(128, 128, "bfloat16", score_program=SOFTCAP),
    "d128-causal-shared-kv": FlexPrefillProblem(128, 128, "bfloat16", mask_program=CAUSAL, sparse_block=128,
                                                kv_batch_broadcast=True),
    "d64-document-block256-alibi-q256": FlexPrefillProblem(
        64, 64, "bfloat16", score_program=ALIBI, score_dtypes=("float32",), mask_program=DOCUMENT,
        mask_dtypes=("int32",), sparse_block=256, sparse_q_block=256),
}
# persistent CTAs (config.persistent_ctas): the same problems through the tile loop's other path
PERSISTENT = {
    "d128-persistent": VARIANTS["d128"],
    "mla-192-128-causal-block128-persistent": VARIANTS["mla-192-128-causal-block128"],
    "d64-fp16-persistent": VARIANTS["d64-fp16"],
    "d64-causal-persistent-2q": FlexPrefillProblem(64, 64, "bfloat16", mask_program=CAUSAL, sparse_block=128),
}
VARIANTS.update(PERSISTENT)
# K and V in rings of their own (config.split_kv), one CTA per tile and persistent
SPLIT_KV = {
    "mla-192-128-causal-block128-split-kv": VARIANTS["mla-192-128-causal-block128"],
    "d128-causal-block128-split-kv-persistent": VARIANTS["d128-causal-block128"],
}
VARIANTS.update(SPLIT_KV)
# the first exponentials of each row before the wait for P V (config.early_exps)
EARLY_EXPS = {
    "d64-causal-persistent-2q-early": VARIANTS["d64-causal-persistent-2q"],
    "d128-causal-block128-early": VARIANTS["d128-causal-block128"],
    "mla-192-128-causal-block128-split-kv-early": VARIANTS["mla-192-128-causal-block128"],
}
VARIANTS.update(EARLY_EXPS)
# persistent CTAs claiming their tiles from a global counter (config.dynamic_tiles)
DYNAMIC = {
    "d128-causal-block128-persistent-dynamic-early": VARIANTS["d128-causal-block128"],
    "mla-192-128-causal-block128-split-kv-persistent-dynamic-early": VARIANTS["mla-192-128-causal-block128"],
    "d64-causal-persistent-2q-dynamic": VARIANTS["d64-causal-persistent-2q"],
}
VARIANTS.update(DYNAMIC)
# some of each row's exponentials on the FMA pipes (config.poly_exps): the vit case's default
# kernel, and with early_exps and a causal mask (-inf scores through softmax.exp2_fma)
POLY = {
    "d64-persistent-2q-poly": VARIANTS["d64-fp16"],
    "d64-causal-persistent-2q-early-poly": VARIANTS["d64-causal-persistent-2q"],
}
VARIANTS.update(POLY)
POLY_EXPS = 8
# the next tile's S_0 under this tile's last P V (config.overlap_tiles): problems without a block mask
OVERLAP = {
    "d64-persistent-2q-overlap": VARIANTS["d64-fp16"],
    "d64-persistent-2q-overlap-poly": VARIANTS["d64-fp16"],
    "d128-softcap-persistent-2q-overlap-split-kv": VARIANTS["d128-softcap"],
}
VARIANTS.update(OVERLAP)


def variant_config(name):
    config = default_config(VARIANTS[name])
    if "persistent" in name:
        config = dataclasses.replace(config, persistent_ctas=132, q_stages=2 if "-2q" in name else 1)
    if "split-kv" in name:
        config = dataclasses.replace(config, split_kv=True)
    if name in EARLY_EXPS or name.endswith("-early") or "-early-" in name:
        config = dataclasses.replace(config, early_exps=20)
    if name in DYNAMIC:
        config = dataclasses.replace(config, dynamic_tiles=True)
    if name in POLY or name.endswith("-poly"):
        config = dataclasses.replace(config, poly_exps=POLY_EXPS)
    if name in OVERLAP:  # 128/128 fits two Q buffers and O's beside a ring of 2 stages
        config = dataclasses.replace(config, overlap_tiles=True, stages=min(config.stages, 2 if "d128" in name else 4))
    return config


def variant_spec(name):
    return spec(VARIANTS[name], variant_config(name))


@pytest.fixture(scope="module")
def compiled_all():
    return {}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def compiled(request, compiled_all):
    obj = compile_spec(variant_spec(request.param), "sm_90a", keep_ptx=True)
    compiled_all[request.param] = obj
    return obj


def test_uses_tma_wgmma_stmatrix_and_exp2(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert "wgmma.mma_async" in ptx
    # TMA loads of Q, K, V into shared memory on mbarriers, and the TMA store of O
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global\.tile\.mbarrier", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    assert "stmatrix" in ptx  # O staged in shared memory for the store
    assert "ex2.approx" in ptx and "lg2.approx" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert len(re.findall(r"^\.visible \.entry ", ptx, re.M)) == 1


def test_each_probability_is_exponentiated_once(request, compiled):
    # a consumer thread holds 64 x kv_block / 128 scores of a block: their exp2 at two sites
    # (block 0, the block loop) plus 2 row corrections at each. The compiler once computed the
    # loop's P twice (for the row sums, again for the registers P V reads) inside a tile loop and
    # at d256: causal prefill 40% slower on the H200 (perf notes, eighth session)
    name = request.node.callspec.params["compiled"]
    if VARIANTS[name].score_program:
        pytest.skip("a score program may exponentiate too")
    per_block = 64 * default_config(VARIANTS[name]).kv_block // 128
    by_fma = 2 * variant_config(name).poly_exps  # poly_exps of each of a thread's two rows
    sites = 3 if name in OVERLAP else 2  # overlap_tiles: the next tile's block 0 in the tile loop too
    assert compiled.ptx.count("ex2.approx") == sites * (per_block - by_fma + 2)
    assert compiled.ptx.count("shl.b32 tb, tb, 23") == sites * by_fma  # softmax.exp2_fma's


def test_ptxas_reports_no_spills_and_no_stack(compiled):
    report = compiled.ptxas_report
    assert report and report.count("Used") == 1
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "setmaxnreg' ignored" not in report.replace("''", "'")
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx


def test_split_kv_rings_have_barriers_of_their_own(request, compiled):
    name = request.node.callspec.params["compiled"]
    config = variant_config(name)
    rings = 2 if config.split_kv else 1  # full and empty mbarriers per stage and ring, Q's and the claims'
    claims = TILE_CLAIM_STAGES if config.dynamic_tiles else 0
    assert compiled.ptx.count("mbarrier.init") == 2 * (rings * config.stages + config.q_stages + claims)


def test_only_dynamic_tiles_claim_from_the_counter(request, compiled):
    # one relaxed add per claim, one acq_rel add to retire; a fixed tile walk touches no counter
    name = request.node.callspec.params["compiled"]
    atoms = re.findall(r"^\s*(?:@%p\d+ )?atom\S*", compiled.ptx, re.M)
    if name not in DYNAMIC:
        assert not atoms
        return
    assert len(atoms) == 2 and all(".add" in a for a in atoms), atoms
    assert sum(".acq_rel" in a for a in atoms) == 1


def test_ptxas_keeps_every_wgmma_asynchronous(compiled):
    # C7512 (insufficient registers) or C7519: ptxas made each WGMMA wait for the one before it,
    # no error and no spill, but the softmax no longer overlaps the matrix products (the persistent
    # causal kernels ran 1.4x slower that way)
    assert "wgmma.mma_async instructions are serialized" not in compiled.ptxas_report


def test_setmaxnreg_only_moves_the_launched_registers(compiled):
    # 384 threads launch with 168 registers each; the consumers' increase waits for registers the
    # producer gives back, so the two must balance exactly or the CTA hangs
    from inductor_cute.kernels.attention.flex_prefill_sm90 import FlexPrefillSm90

    assert "Used 168 registers" in compiled.ptxas_report
    kernel = FlexPrefillSm90(FlexPrefillProblem(128, 128, "bfloat16"), FlexPrefillConfig(128, 3))
    assert kernel.producer_regs * 128 + kernel.consumer_regs * 256 == 168 * 384
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{kernel.producer_regs};" in compiled.ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{kernel.consumer_regs};" in compiled.ptx


def test_s_from_shared_memory_and_pv_with_p_from_registers(compiled):
    # SS WGMMA (both descriptors) for S = Q K^T, RS WGMMA ({A registers}) for O += P V, each
    # issued at two sites (the first block alone, then S_j with P_{j-1} V_{j-1})
    lines = [line for line in compiled.ptx.splitlines() if "wgmma.mma_async" in line]
    ss = [line for line in lines if line.count("{") == 1]
    rs = [line for line in lines if line.count("{") == 2]
    assert ss and rs and len(ss) + len(rs) == len(lines)


def test_consumers_take_turns_on_named_barriers(compiled):
    # ping-pong: each consumer syncs on its own turn barrier (256 threads) and arrives on the other's
    ptx = compiled.ptx
    assert re.search(r"bar\.sync\s+%r\d+, 256", ptx)
    assert re.search(r"bar\.arrive\s+(%r\d+|[23]), 256", ptx)


def test_o_leaves_in_halves_and_own_buffers_need_no_cta_wide_epilogue(request, compiled):
    # O goes out as 64-row halves (the consumers' own rows). With one Q buffer one warp stores both
    # halves after a barrier of all 256 consumer threads and waits for their read (Q's buffer is
    # handed back next); with two each warp group syncs only its own 128 threads and stores its
    # half, waiting for that half's previous store only before it stages the next one
    ptx = compiled.ptx
    stores = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.", ptx)
    name = request.node.callspec.params["compiled"]
    two_q = variant_config(name).q_stages == 2
    boxes = VARIANTS[name].head_dim_v * 2 // 128  # a half is one box per 128 bytes of its rows
    assert len(stores) == (1 if two_q else 2) * boxes
    cta_wide = re.findall(r"bar\.sync\s+1, 256", ptx)
    if two_q:
        assert not cta_wide and re.search(r"bar\.sync\s+%r\d+, 128", ptx)
        first_store = ptx.index(stores[0])
        assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0", ptx[:first_store])
        # and each store warp waits for its last store before the CTA ends
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0", ptx[first_store:])
    else:
        assert len(cta_wide) == 2


def test_early_exponentials_run_before_the_wait_for_pv(request, compiled, tmp_path):
    # ptxas issues `wgmma.wait_group 0` (P_{j-1} V_{j-1}) at the first stall it finds, before every
    # exponential of block j, wherever the PTX puts it; early_exps holds it behind the first ones:
    # in SASS, each row's early_exps exponentials (two rows per thread) and the two row corrections
    # come between the wait for S_j (DEPBAR <= 1) and the wait for P V (DEPBAR 0)
    name = request.node.callspec.params["compiled"]
    config = variant_config(name)
    if name not in EARLY_EXPS and not (config.early_exps and name in POLY):
        pytest.skip("early_exps off")
    code = sass(compiled, tmp_path)
    marks = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2", code)
    loops = re.findall(r"0x1((?:MUFU\.EX2)*)WARPGROUP\.DEPBAR\.LE gsb0, 0x0",
                       "".join(m.replace("WARPGROUP.DEPBAR.LE gsb0, 0x1", "0x1") for m in marks))
    # of the first 20 positions of each row, those made by exp2_fma (poly_exps) are no MUFU.EX2
    early_mufu = 20 - len(poly_positions(config.kv_block // 4, config.poly_exps) & set(range(20)))
    assert loops and all(len(run) // len("MUFU.EX2") >= 2 * early_mufu + 2 for run in loops)


def test_next_tiles_softmax_runs_under_the_last_pv(request, compiled, tmp_path):
    # overlap_tiles: in SASS, the next tile's S_0 and this tile's last P V are issued in one turn,
    # and the next tile's exponentials (and its two row corrections) come between the wait for
    # S_0 (DEPBAR <= 1) and the wait for the P V (DEPBAR 0): block 0's softmax under the P V
    name = request.node.callspec.params["compiled"]
    if name not in OVERLAP:
        pytest.skip("overlap_tiles off")
    config = variant_config(name)
    by_mufu = 64 * config.kv_block // 128 - 2 * config.poly_exps + 2
    code = sass(compiled, tmp_path)
    marks = "".join({"WARPGROUP.DEPBAR.LE gsb0, 0x1": "1", "WARPGROUP.DEPBAR.LE gsb0, 0x0": "0"}.get(m, "e")
                    for m in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|MUFU\.EX2", code))
    assert any(len(run) >= by_mufu for run in re.findall(r"1(e+)0", marks)), marks


def test_block_masks_and_programs_reach_the_kernel(compiled_all):
    needed = ("d128", "d128-causal-block128", "d128-softcap")
    if not all(n in compiled_all for n in needed):
        pytest.skip("needs the module's compiled variants (run the whole file)")
    plain, causal, softcap = (compiled_all[n].ptx for n in needed)
    # the block list (counts, indices) is read from global memory; the mask program compares each
    # element's query and key positions (64 per thread and tile)
    assert causal.count("ld.global") > plain.count("ld.global")

    def compares(ptx):
        return len(re.findall(r"setp\.(?:ge|lt|le|gt)\.s32", ptx))

    assert compares(causal) >= compares(plain) + 64
    # score / 30 multiplies by fp32(1/30), once per element of a 64 x 128 tile per thread (64)
    assert "div.rn.f32" not in softcap and softcap.count("0f3D088889") >= 64


def test_two_q_buffers_give_o_its_own_buffer():
    problem = FlexPrefillProblem(64, 64, "bfloat16")
    one = dataclasses.replace(default_config(problem), persistent_ctas=132)
    two = dataclasses.replace(one, q_stages=2)
    # a second Q buffer (16 KB) and O's staging buffer (16 KB), and one more mbarrier pair
    assert smem_bytes(problem, two) - smem_bytes(problem, one) == 2 * 128 * 64 * 2
    assert config_error(two, problem) is None
    assert "q_stages 3 must be 1 or 2" in config_error(dataclasses.replace(one, q_stages=3), problem)
    # at 128/128 the ring must give up a stage for them
    d128 = FlexPrefillProblem(128, 128, "bfloat16")
    assert "exceed" in config_error(dataclasses.replace(default_config(d128), q_stages=2, persistent_ctas=132), d128)
    assert config_error(dataclasses.replace(default_config(d128), q_stages=2, stages=2, persistent_ctas=132),
                        d128) is None
    # one tile per CTA has no next Q to load early
    assert "needs persistent_ctas" in config_error(dataclasses.replace(one, q_stages=2, persistent_ctas=0), problem)
    # nor tiles to claim; claiming costs no buffer beside its mbarriers (the barriers' 1 KB holds them)
    assert "needs persistent_ctas" in config_error(dataclasses.replace(one, dynamic_tiles=True, persistent_ctas=0),
                                                   problem)
    assert smem_bytes(problem, dataclasses.replace(one, dynamic_tiles=True)) == smem_bytes(problem, one)
    assert "dynamic_tiles" not in one.as_params()  # the specs that predate it keep their keys


def test_shared_memory_fits_and_matches_the_kernel_layout(monkeypatch):
    # the kernel asserts at trace time that its shared storage is smem_bytes: compiling checks it
    monkeypatch.setattr(fpc, "GPU_UNCHECKED_HEAD_DIMS", set())  # their configs too
    for dims in HEAD_DIMS:
        problem = FlexPrefillProblem(*dims, "bfloat16")
        cfg = default_config(problem)
        assert config_error(cfg, problem) is None
        assert smem_bytes(problem, cfg) <= SMEM_BUDGET
        assert cfg.stages >= 2
    # the measured winners (sixteenth session): early exponentials at 128/128 (and persistent CTAs
    # given the SM count), split_kv with them at 192/128
    assert default_config(FlexPrefillProblem(128, 128, "bfloat16")) == FlexPrefillConfig(128, 3, early_exps=20)
    assert default_config(FlexPrefillProblem(128, 128, "bfloat16"), 132) == \
        FlexPrefillConfig(128, 3, persistent_ctas=132, early_exps=20)
    assert default_config(FlexPrefillProblem(192, 128, "bfloat16"), 132) == \
        FlexPrefillConfig(128, 2, split_kv=True, early_exps=20)
    assert default_config(FlexPrefillProblem(256, 256, "bfloat16")) == FlexPrefillConfig(64, 2)
    assert default_config(FlexPrefillProblem(64, 64, "bfloat16")).stages == 4


@pytest.mark.parametrize("dims", [(96, 96), (64, 32)])
def test_head_dims_96_and_64_32_compile_without_local_memory(dims):
    # Phi-3/3.5-mini's 96 (192-byte rows, 64-byte swizzles) and PyTorch's tests' 64/32
    compiled = compile_spec(spec(FlexPrefillProblem(*dims, "bfloat16", mask_program=CAUSAL, sparse_block=128)),
                            "sm_90a", keep_ptx=True)
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", compiled.ptxas_report)


def test_unsupported_problems_and_configs_are_named(monkeypatch):
    assert "dtype float32" in unsupported_reason(128, 128, "float32")
    assert unsupported_reason(256, 256, "bfloat16") is None and unsupported_reason(192, 128, "bfloat16") is None
    assert "head dims 128/192" in unsupported_reason(128, 192, "bfloat16")  # O is staged in Q's buffer
    assert "head dims 80/80" in unsupported_reason(80, 80, "bfloat16")
    assert unsupported_reason(96, 96, "bfloat16") is None and unsupported_reason(64, 32, "bfloat16") is None
    assert unsupported_reason(64, 64, "float16") is None
    p = FlexPrefillProblem(128, 128, "bfloat16")
    assert "stages must be at least 2" in config_error(FlexPrefillConfig(128, 1), p)
    assert "shared memory" in config_error(FlexPrefillConfig(128, 4), p)
    assert "kv_block" in config_error(FlexPrefillConfig(24, 2), p)
    assert "poly_exps 33 must be in 0..32" in config_error(FlexPrefillConfig(128, 2, poly_exps=33), p)
    overlap = FlexPrefillConfig(128, 2, persistent_ctas=132, q_stages=2, overlap_tiles=True)
    assert config_error(overlap, p) is None
    assert "two Q buffers" in config_error(dataclasses.replace(overlap, q_stages=1), p)
    assert "fixed stride" in config_error(dataclasses.replace(overlap, dynamic_tiles=True), p)
    assert "without a block mask" in config_error(overlap, dataclasses.replace(p, mask_program=CAUSAL,
                                                                                sparse_block=128))
    assert "not a multiple" in config_error(default_config(p), dataclasses.replace(p, sparse_block=64))
    assert "multiple of 128" in config_error(default_config(p), dataclasses.replace(p, sparse_q_block=64))
    assert "canonical" in config_error(default_config(p), dataclasses.replace(p, score_program=SOFTCAP + " "))
    assert "unknown argument 'score'" in config_error(default_config(p), dataclasses.replace(p, mask_program=SOFTCAP))
    assert "end in a bool" in config_error(default_config(p), dataclasses.replace(
        p, mask_program=dumps([["o", "add", "kv", 1]])))
    with pytest.raises(ValueError, match="not supported"):
        spec(FlexPrefillProblem(80, 80, "bfloat16"))
    assert sparse_block_reason(128, 128, 128) is None and sparse_block_reason(256, 512, 128) is None
    assert "KV block" in sparse_block_reason(64, 128, 128)
    assert "query block" in sparse_block_reason(128, 64, 128)
    monkeypatch.setattr(fpc, "GPU_UNCHECKED_HEAD_DIMS", {(96, 96)})  # a kernel not yet run on a GPU is refused
    assert "96/96 (qk/v) are not yet checked on a GPU" in unsupported_reason(96, 96, "bfloat16")


def test_spec_spells_problem_and_config_and_reads_back():
    problem = FlexPrefillProblem(128, 128, "bfloat16", SOFTCAP, (), DOCUMENT, ("int32",), 256, 128)
    s = spec(problem)
    assert set(s.kwargs) == set(problem.as_params()) | {"kv_block", "stages", "persistent_ctas", "q_stages",
                                                         "early_exps"}
    assert from_params(s.kwargs) == (problem, default_config(problem))


def test_tiles_run_longest_first_and_cover_the_grid():
    tiles = LongestFirst(5, 3, 2)
    coords = [tiles.coord(t) for t in range(tiles.count())]
    assert len(set(coords)) == tiles.count() == 30
    assert sorted(coords) == sorted((m, h, b) for m in range(5) for h in range(3) for b in range(2))
    m_blocks = [c[0] for c in coords]
    assert m_blocks == sorted(m_blocks, reverse=True)  # causal: the last query blocks have the most keys
    assert coords[:6] == [(4, h, b) for b in range(2) for h in range(3)]


@pytest.mark.parametrize("m_blocks, heads, batch, width", [(5, 3, 2, 2), (4, 8, 1, 4), (3, 5, 3, 4), (7, 2, 1, 9),
                                                           (1, 6, 2, 1)])
def test_tiles_in_l2_sections_run_longest_first_within_each_and_cover_the_grid(m_blocks, heads, batch, width):
    tiles = LongestFirst(m_blocks, heads, batch, width)
    coords = [tiles.coord(t) for t in range(tiles.count())]
    assert sorted(coords) == sorted((m, h, b) for m in range(m_blocks) for h in range(heads) for b in range(batch))
    pairs = [h + heads * b for _, h, b in coords]
    width = min(width, heads * batch)
    narrow = heads * batch % width  # the narrower section, if any, comes first
    starts = ([0] if narrow else []) + list(range(narrow, heads * batch, width))
    for i, start in enumerate(starts):  # each section: its pairs' tiles in one run, longest first
        end = starts[i + 1] if i + 1 < len(starts) else heads * batch
        run = [k for k, p in enumerate(pairs) if start <= p < end]
        assert run == list(range(start * m_blocks, end * m_blocks))
        assert [coords[k][0] for k in run] == sorted((coords[k][0] for k in run), reverse=True)
        assert [pairs[k] for k in run[:end - start]] == list(range(start, end))


def test_a_narrower_section_runs_first_so_the_tail_is_short():
    # DeepSeek-V3 MLA causal (32 query blocks, 128 heads, sections of 9: 14 and one of 2): CTAs
    # taking tiles in order as SMs free up (one CTA per SM), a tile costing its KV blocks plus 1.5
    # of fixed cost. With the 2-pair section last its longest tiles ended the kernel alone
    # (581.5 blocks); first, the makespan is that of equal sections (560 = 512 of work + 48)
    import heapq

    tiles = LongestFirst(32, 128, 1, section_width(4096, 640, 1))
    free = [0.0] * 132
    for t in range(tiles.count()):
        heapq.heappush(free, heapq.heappop(free) + tiles.coord(t)[0] + 1 + 1.5)
    assert max(free) <= 1.01 * (32 * 33 / 2 * 128 / 132 + 32 * 1.5)


def test_l2_sections_hold_whole_kv_heads_that_fit():
    # DeepSeek-V3 MLA at 4096 keys: 640 bytes per key, 2.6 MB per head: 9 heads in 24 MB
    assert section_width(4096, 640, 1) == L2_KV_BYTES // 640 // 4096 == 9
    assert section_width(4096, 512, 4) == 12 * 4  # Llama GQA 4: whole KV heads, their 4 query heads each
    assert section_width(1 << 20, 640, 8) == 8  # one KV head longer than L2: a section of its query heads
    assert section_width(0, 640, 1) >= 1


def test_flops_floor_of_a_causal_prefill():
    # B1 H16 S8192 d128 causal: 2 * 8192^2 * 16 * 256 / 2 flops
    assert attention_flops(1, 16, 8192, 8192, 128, 128, causal=True) == 8192 ** 2 * 16 * 256
    assert M_BLOCK == 128


def test_flex_prefill_refuses_cpu_tensors_and_unsupported_head_dims():
    import torch

    from inductor_cute import UnsupportedError
    from inductor_cute.host.flex_prefill import flex_prefill

    q = torch.randn(1, 8, 256, 128, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="^flex_prefill: tensors must be on a CUDA device, got cpu$"):
        flex_prefill(q, kv, kv)


class KernelStandIn:
    """Records the exported kernel's arguments in place of the compiled prefill kernel."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def host_on_cpu(monkeypatch):
    """The eager entry on CPU tensors: the device check passes and the kernel is a stand-in."""
    from inductor_cute.host import flex_prefill as fp

    kernel = KernelStandIn()
    specs = []
    monkeypatch.setattr(fp, "check_cuda", lambda *a: None)
    monkeypatch.setattr(fp, "sm_count", lambda index: 132)
    fp._device_default_config.cache_clear()
    monkeypatch.setattr(fp, "_flex_prefill_kernel", lambda *params: specs.append(params) or kernel)
    return fp.flex_prefill, kernel, specs


def test_host_passes_the_kernel_its_arguments(host_on_cpu):
    import math

    import torch

    flex_prefill, kernel, specs = host_on_cpu
    q, k, v = torch.randn(2, 8, 300, 128), torch.randn(2, 2, 500, 128), torch.randn(2, 2, 500, 128)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    num = torch.ones(1, 1, 3, dtype=torch.int64)
    idx = torch.zeros(1, 1, 3, 4, dtype=torch.int64)
    out, lse = flex_prefill(q, k, v, scale=0.5, mask_mod=CAUSAL, kv_num_blocks=num, kv_indices=idx,
                            return_lse=True)
    (args,) = kernel.calls
    assert len(args) == 20 and out.shape == (2, 8, 300, 128) and lse.shape == (2, 8, 300)
    assert args[19] is None  # the tile counter: only for dynamic_tiles
    assert args[3] is out and args[4] is lse
    assert math.isclose(args[5], 0.5 / math.log(2)) and args[6] == 0.5
    assert args[7:11] == (None,) * 4 and all(t is None for t in args[15:19])
    bm = args[11:15]
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in bm)
    assert torch.equal(bm[2], torch.zeros(1, 1, 3, dtype=torch.int32))  # no full blocks: zero counts
    # the device's default: at 128/128 persistent CTAs, one per SM (the host once passed None there,
    # and the kernel's SM-less default ran one CTA per tile)
    from inductor_cute.kernels.attention.flex_prefill_config import FlexPrefillProblem, default_config

    (spec,) = specs
    assert spec[:10] + spec[11:] == (128, 128, "bfloat16", "", (), CAUSAL, (), 128, 128, True, False)
    assert spec[10] == default_config(FlexPrefillProblem(128, 128, "bfloat16"), 132)
    assert spec[10].persistent_ctas == 132
    # strided (B, L, H, D) views go through as they are
    qt = torch.randn(2, 300, 8, 128).bfloat16().transpose(1, 2)
    flex_prefill(qt, k, v)
    assert kernel.calls[-1][0].data_ptr() == qt.data_ptr() and kernel.calls[-1][0].stride() == qt.stride()


def test_host_passes_dynamic_tiles_a_zeroed_counter(host_on_cpu):
    import torch

    from inductor_cute.kernels.attention.flex_prefill_config import FlexPrefillProblem, default_config

    flex_prefill, kernel, _ = host_on_cpu
    config = dataclasses.replace(default_config(FlexPrefillProblem(128, 128, "bfloat16"), 132), dynamic_tiles=True)
    q = torch.randn(1, 4, 300, 128).bfloat16()
    flex_prefill(q, q, q, config=config)
    counter = kernel.calls[-1][19]
    assert counter.dtype == torch.int32 and counter.shape == (2,) and not counter.any()


def test_host_passes_one_kv_cache_shared_by_the_batch(host_on_cpu):
    import torch

    flex_prefill, kernel, specs = host_on_cpu
    q, kv = torch.randn(3, 8, 200, 128).bfloat16(), torch.randn(1, 2, 500, 128).bfloat16()
    out = flex_prefill(q, kv, kv)
    (args,) = kernel.calls
    assert specs[-1][-1] is True and args[1].shape == (1, 2, 500, 128) and out.shape == (3, 8, 200, 128)
    from inductor_cute import UnsupportedError

    with pytest.raises(UnsupportedError, match="batch sizes differ"):
        flex_prefill(q, kv.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1))


def test_a_shared_kv_cache_is_its_own_kernel_and_older_specs_keep_their_keys():
    from inductor_cute.kernels.attention.flex_prefill_config import FlexPrefillProblem, from_params, spec

    plain, shared = FlexPrefillProblem(128, 128, "bfloat16"), FlexPrefillProblem(128, 128, "bfloat16",
                                                                                 kv_batch_broadcast=True)
    assert "kv_batch_broadcast" not in plain.as_params() and shared.as_params()["kv_batch_broadcast"] is True
    assert spec(plain) != spec(shared)
    assert from_params(dict(spec(shared).params))[0] == shared


def test_host_runs_head_dim_64_on_persistent_ctas_with_two_q_buffers(host_on_cpu, monkeypatch):
    import torch

    from inductor_cute.host import flex_prefill as fp
    from inductor_cute.kernels.attention.flex_prefill_config import (FlexPrefillConfig, FlexPrefillProblem,
                                                                      config_error, default_config)

    flex_prefill, kernel, specs = host_on_cpu
    monkeypatch.setattr(fp, "sm_count", lambda index: 132)
    q = torch.randn(1, 4, 300, 64).bfloat16()
    flex_prefill(q, q, q)
    config = specs[-1][10]
    assert isinstance(config, FlexPrefillConfig) and (config.persistent_ctas, config.q_stages) == (132, 2)
    assert config_error(config, FlexPrefillProblem(64, 64, "bfloat16")) is None
    assert config == default_config(FlexPrefillProblem(64, 64, "bfloat16"), num_sms=132)
    # without an SM count, and at the other head dims, one CTA per tile
    assert default_config(FlexPrefillProblem(64, 64, "bfloat16")).persistent_ctas == 0
    assert default_config(FlexPrefillProblem(128, 128, "bfloat16"), num_sms=132).q_stages == 1


def test_host_refuses_what_the_kernel_cannot_take(host_on_cpu):
    import torch

    from inductor_cute import UnsupportedError

    flex_prefill, kernel, _ = host_on_cpu
    q = torch.randn(1, 4, 300, 128).bfloat16()
    num = torch.ones(1, 1, 3, dtype=torch.int32)
    idx = torch.zeros(1, 1, 3, 4, dtype=torch.int32)
    cases = [
        (lambda: flex_prefill(q[..., :80], q[..., :80], q[..., :80]), "head dims 80/80"),
        (lambda: flex_prefill(q, q[:, :3], q[:, :3]), "not a multiple of 3 KV heads"),
        (lambda: flex_prefill(q, q, q, mask_tensors=(num.flatten(),)), "without a mask_mod"),
        (lambda: flex_prefill(q, q, q, kv_num_blocks=num), "needs kv_num_blocks and kv_indices"),
        (lambda: flex_prefill(q, q, q, kv_num_blocks=num[..., :2], kv_indices=idx[:, :, :2]), "do not cover 300"),
        (lambda: flex_prefill(q, q, q, kv_num_blocks=num, kv_indices=idx, kv_block_size=96), "KV block 128"),
        (lambda: flex_prefill(q, q, q, kv_num_blocks=num, kv_indices=idx, q_block_size=160), "query block size 160"),
        # finer blocks are walked coarsened with one more mask tensor: not beside four of the mask_mod's
        (lambda: flex_prefill(q, q, q, kv_num_blocks=num.repeat(1, 1, 2), kv_indices=idx.repeat(1, 1, 2, 1),
                              q_block_size=64, mask_mod=CAUSAL, mask_tensors=(num.flatten(),) * 4),
         "take a mask tensor"),
        (lambda: flex_prefill(q, q, q, mask_mod=SOFTCAP), "mask_mod: "),
    ]
    for call, message in cases:
        with pytest.raises(UnsupportedError, match=message) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith("flex_prefill: ")
    assert not kernel.calls


def test_host_answers_empty_problems_without_the_kernel(host_on_cpu):
    import torch

    flex_prefill, kernel, _ = host_on_cpu
    q = torch.randn(1, 2, 5, 64).half()
    out, lse = flex_prefill(q, q[:, :, :0], q[:, :, :0], return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all() and not kernel.calls


def test_host_takes_a_config_and_refuses_one_that_cannot_run(host_on_cpu, monkeypatch):
    import torch

    from inductor_cute import UnsupportedError
    from inductor_cute.host import flex_prefill as fp

    flex_prefill, kernel, specs = host_on_cpu
    q = torch.randn(1, 2, 300, 128).bfloat16()
    persistent = FlexPrefillConfig(128, 3, persistent_ctas=132)
    flex_prefill(q, q, q, config=persistent)
    assert specs[-1][10] == persistent
    monkeypatch.setattr(fp, "_flex_prefill_kernel", REAL_KERNEL_FACTORY.__wrapped__)  # the real spec checks
    with pytest.raises(UnsupportedError, match="flex_prefill: stages must be at least 2"):
        flex_prefill(q, q, q, config=FlexPrefillConfig(128, 1))
    with pytest.raises(UnsupportedError, match="persistent_ctas -1 must be 0"):
        flex_prefill(q, q, q, config=FlexPrefillConfig(128, 3, persistent_ctas=-1))


def test_a_scale_of_zero_or_below_compiles_the_unfolded_kernel(host_on_cpu):
    import torch

    flex_prefill, kernel, specs = host_on_cpu
    q = torch.randn(1, 2, 300, 128).bfloat16()
    # 1e-40: positive, but its scale_log2 is no normal fp32 (zero once flushed): unfolded
    for scale, expected in ((0.1, True), (None, True), (0.0, False), (-0.1, False), (1e-40, False)):
        flex_prefill(q, q, q, scale=scale)
        assert specs[-1][9] is expected, scale
    flex_prefill(q, q, q, scale=-0.1, score_mod=SOFTCAP)  # a score program scales for itself
    assert specs[-1][9] is True


def run_exp2_fma_ptx(x):
    """softmax.exp2_fma's inline PTX run line by line on fp32 numpy arrays (a small interpreter of
    the instructions it uses; FMAs fused through float64), so the test reads the text the kernel
    compiles, not a copy of its algorithm."""
    import numpy as np

    from inductor_cute.kernels.attention.softmax import _EXP2_FMA_PTX

    f32, regs = np.float32, {"$1": np.asarray(x, np.float32)}

    def gpu(a):  # an fp32 result as the GPU gives it: NaN is the canonical 0x7fffffff
        return np.where(np.isnan(a), np.uint32(0x7FFFFFFF).view(f32), a).astype(f32)

    def value(operand):
        if operand in regs:
            return regs[operand]
        if operand.startswith("0f"):
            return np.full(regs["$1"].shape, np.uint32(int(operand[2:], 16))).view(f32)
        return np.full(regs["$1"].shape, int(operand), np.int32)

    ops = {
        "add.rn.f32": lambda a, b: gpu(a + b),
        "sub.rn.f32": lambda a, b: gpu(a - b),
        "fma.rn.f32": lambda a, b, c: gpu(a.astype(np.float64) * b + c.astype(np.float64)),
        "mov.b32": lambda a: a.view(np.int32).copy(),
        "shl.b32": lambda a, n: (a.view(np.uint32) << n.astype(np.uint32)).view(np.int32),
        "add.s32": lambda a, b: (a.view(np.uint32) + b.view(np.uint32)).view(np.int32),
        "setp.lt.f32": lambda a, b: a < b,
        "selp.b32": lambda a, b, p: np.where(p, a.view(np.int32), b.view(np.int32)),
        # PTX max.NaN: NaN if either is NaN
        "max.NaN.f32": lambda a, b: gpu(np.where(np.isnan(a.view(f32)) | np.isnan(b), np.nan,
                                                 np.maximum(a.view(f32), b))),
    }
    with np.errstate(all="ignore"):
        for line in _EXP2_FMA_PTX.split("\n"):
            line = line.strip().rstrip(";")
            if not line or line[0] in "{}.":
                continue
            op, args = line.split(None, 1)
            dest, *sources = (a.strip() for a in args.split(","))
            regs[dest] = ops[op](*(value(a) for a in sources))
    return regs["$0"].view(np.float32)


def test_exp2_on_fma_pipes_in_fp32():
    # softmax.exp2_fma's PTX: within 1e-4 of 2^x where MUFU.EX2 gives a normal number, 0 below
    # EXP2_FLUSH_BELOW and for -inf (masked scores), NaN for NaN; its positions spread evenly
    np = pytest.importorskip("numpy")
    from inductor_cute.kernels.attention.softmax import EXP2_FLUSH_BELOW, poly_positions

    x = np.concatenate([np.linspace(-125, 0, 400001), [-0.0, -1e-30, 3e-6, -124.999, -125.0001, -300, -np.inf]])
    y = run_exp2_fma_ptx(x.astype(np.float32))
    normal = x >= EXP2_FLUSH_BELOW
    rel = np.abs(y[normal].astype(np.float64) / np.exp2(x[normal].astype(np.float32).astype(np.float64)) - 1)
    assert rel.max() < 1e-4
    assert (y[~normal] == 0).all() and (~normal).sum() == 3
    assert np.isnan(run_exp2_fma_ptx(np.array([np.nan], np.float32))).all()
    assert poly_positions(32, 0) == frozenset() and poly_positions(32, 32) == frozenset(range(32))
    eight = sorted(poly_positions(32, 8))
    assert len(eight) == 8 and all(b - a == 4 for a, b in zip(eight, eight[1:]))


def test_the_folded_scale_multiplies_inside_the_exponent():
    # folded (the default): S is not scaled after the QK product; the exponent's argument is
    # s * scale_log2 - m (mul then sub, contracted to one FFMA by ptxas). Unfolded: S * scale first.
    folded = compile_spec(spec(FlexPrefillProblem(64, 64, "bfloat16")), "sm_90a", keep_ptx=True).ptx
    plain = compile_spec(spec(FlexPrefillProblem(64, 64, "bfloat16", positive_scale=False)), "sm_90a",
                         keep_ptx=True).ptx

    def feeds_exp2(ptx):  # the instruction producing each ex2.approx's operand
        producers = {}
        for line in ptx.splitlines():
            m = re.match(r"\s*(\w+)(?:\.\w+)*\s+(%r\d+),", line)
            if m:
                producers[m.group(2)] = m.group(1)
        ops = re.findall(r"ex2\.approx\.ftz\.f32\s+%r\d+, (%r\d+);", ptx)
        return {producers.get(r) for r in ops}

    assert feeds_exp2(folded) == feeds_exp2(plain) == {"sub"}

    def maxes_of_scaled_scores(ptx):  # max.f32 with an operand a mul.f32 produced
        muls = set(re.findall(r"mul\.f32\s+(%r\d+),", ptx))
        return sum(1 for a, b in re.findall(r"max\.f32\s+%r\d+, (%r\d+), (%r\d+|0f\w+);", ptx)
                   if a in muls or b in muls)

    # plain: every scaled score goes through the row max; folded: raw scores do, then m * scale
    # once per row half and site
    assert maxes_of_scaled_scores(folded) <= 8 and maxes_of_scaled_scores(plain) >= 128
