"""The split-KV decode kernel compiled for sm_90a on the CPU: every head-dim variant, score programs
(softcap, ALiBi, one using most ops), mask programs and block masks, checked in PTX and in ptxas's
resource report; the configuration limits and the split heuristic."""

import dataclasses
import re

import pytest

from inductor_cute.kernels.attention.flex_decode_config import (DEFAULT_SM_COUNT, HEAD_DIMS, SMEM_BUDGET,
                                                                FlexDecodeConfig, FlexDecodeProblem, config_error,
                                                                default_config, flex_decode_spec, from_params,
                                                                m_tiles, num_splits, smem_bytes, spec,
                                                                unsupported_reason)
from inductor_cute.kernels.attention import flex_decode_config as fdc
from inductor_cute.kernels.common.programs.score import dumps
from inductor_cute.runtime.compiler import compile_spec
from ptx_order import check_waits_then_releases, entries

# (head_dim_qk, head_dim_v, dtype, q_per_kv, has_kv_len)
VARIANTS = {
    "d64-gqa8": (64, 64, "bfloat16", 8, True),
    "qk64-v32-gqa4": (64, 32, "bfloat16", 4, True),
    "qk32-v64-fp16-gqa2": (32, 64, "float16", 2, False),
    "d128-gqa8": (128, 128, "bfloat16", 8, True),
    "d128-fp16-mha-no-kv-len": (128, 128, "float16", 1, False),
    "d256-gqa4": (256, 256, "bfloat16", 4, True),
    "mla-192-128": (192, 128, "bfloat16", 1, False),
    "absorbed-mla-576-512": (576, 512, "bfloat16", 128, True),
}
SOFTCAP = dumps([["a", "truediv", "score", 30.0], ["t", "tanh", "a"], ["o", "mul", "t", 30.0]])
ALIBI = dumps([["slope", "load", "t0", "h"], ["d", "sub", "kv", "q"], ["bias", "mul", "slope", "d"],
               ["o", "add", "score", "bias"]])
MIXED = dumps([["r", "remainder", "kv", 3], ["z", "floordiv", "q", 2], ["even", "eq", "r", 0],
               ["odd", "not", "even"], ["w", "where", "odd", "score", -1.5], ["i", "int", "w"],
               ["f", "float", "i"], ["m", "maximum", "f", "score"], ["g", "load", "t0", "z"],
               ["off", "load", "t1", "b"], ["e", "exp", "g"], ["s", "sigmoid", "e"], ["x", "add", "m", "s"],
               ["o", "add", "x", "off"]])
# PyTorch's flex decoding tests write ALiBi with exp2: 2^(-(h + 1) * 8 / heads)
ALIBI_EXP2 = dumps([["h1", "add", "h", 1], ["m", "mul", "h1", 8.0], ["d", "truediv", "m", 8], ["n", "neg", "d"],
                    ["slope", "exp2", "n"], ["r", "sub", "kv", "q"], ["bias", "mul", "r", "slope"],
                    ["o", "add", "score", "bias"]])
# name -> (flex_decode_spec arguments, score program, captured tensor dtypes)
SCORE_VARIANTS = {
    "d64-gqa8-alibi-exp2": (VARIANTS["d64-gqa8"], ALIBI_EXP2, ()),
    "d128-gqa8-softcap": (VARIANTS["d128-gqa8"], SOFTCAP, ()),
    "d128-gqa8-alibi": (VARIANTS["d128-gqa8"], ALIBI, ("float32",)),
    "d64-fp16-mixed-ops": ((64, 64, "float16", 4, False), MIXED, ("bfloat16", "int32")),
    "absorbed-mla-576-512-alibi": (VARIANTS["absorbed-mla-576-512"], ALIBI, ("bfloat16",)),
}


SLIDING = dumps([["d", "sub", "q", "kv"], ["pos", "add", "d", 1000], ["ge", "ge", "pos", 0],
                 ["lt", "lt", "pos", 1024], ["o", "and", "ge", "lt"]])
DOCUMENT = dumps([["qd", "load", "t0", "q"], ["kd", "load", "t0", "kv"], ["o", "eq", "qd", "kd"]])
PREFIX_LM = dumps([["pre", "lt", "kv", 100], ["c", "ge", "q", "kv"], ["o", "or", "pre", "c"]])
# transformers' causal + padding mask_mod as the lowering translates it: the 0-d int64 query offset
# and the (batch, 300) bool padding mask, both int32 and flattened
TRANSFORMERS_PADDING = dumps([["off", "load", "t0", 0], ["pos", "add", "q", "off"], ["causal", "le", "kv", "pos"],
                              ["row", "mul", "b", 300], ["i", "add", "row", "kv"], ["p.v", "load", "t1", "i"],
                              ["p", "ne", "p.v", 0], ["o", "and", "causal", "p"]])
# the same under dynamic shapes (the padding mask's length symbolic): its row stride len(t1) // batch
TRANSFORMERS_PADDING_DYNAMIC = dumps([["off", "load", "t0", 0], ["pos", "add", "q", "off"], ["causal", "le", "kv", "pos"],
                                      ["n", "len", "t1"], ["width", "floordiv", "n", 4], ["row", "mul", "b", "width"],
                                      ["i", "add", "row", "kv"], ["p.v", "load", "t1", "i"], ["p", "ne", "p.v", 0],
                                      ["o", "and", "causal", "p"]])
# the same with the batch symbolic too (dynamic=True), as a score_mod: the row stride is the kv_len
# operand Dynamo captures beside the mask (t1; t0 holds the batch), loaded (translate.SizeOperand)
TRANSFORMERS_PADDING_SIZE_OPERAND = dumps([["w", "load", "t1", 0], ["row", "mul", "b", "w"], ["i", "add", "row", "kv"],
                                           ["p.v", "load", "t2", "i"], ["p", "ne", "p.v", 0],
                                           ["o", "where", "p", "score", float("-inf")]])
# name -> (flex_decode_spec arguments, keyword arguments: mask program, its tensors, block mask)
MASK_VARIANTS = {
    "d128-gqa4-transformers-padding-block128": ((128, 128, "bfloat16", 4, False), dict(
        mask_program=TRANSFORMERS_PADDING, mask_dtypes=("int32", "int32"), sparse_block=128)),
    "d128-gqa4-transformers-padding-dynamic": ((128, 128, "bfloat16", 4, False), dict(
        mask_program=TRANSFORMERS_PADDING_DYNAMIC, mask_dtypes=("int32", "int32"), sparse_block=128)),
    "d128-gqa4-transformers-padding-size-operand": ((128, 128, "bfloat16", 4, False), dict(
        score_program=TRANSFORMERS_PADDING_SIZE_OPERAND, score_dtypes=("int32",) * 3)),
    "d128-gqa8-sliding-block128": (VARIANTS["d128-gqa8"], dict(mask_program=SLIDING, sparse_block=128)),
    "d128-gqa8-document-block256-softcap": (VARIANTS["d128-gqa8"], dict(
        mask_program=DOCUMENT, mask_dtypes=("int32",), sparse_block=256, score_program=SOFTCAP)),
    "d64-mask-without-block-mask": (VARIANTS["d64-gqa8"], dict(mask_program=PREFIX_LM)),
    "d256-block-mask-only": (VARIANTS["d256-gqa4"], dict(sparse_block=128)),  # 2 kernel blocks per mask block
    "d128-gqa8-sliding-block64": (VARIANTS["d128-gqa8"], dict(mask_program=SLIDING, sparse_block=64)),  # 64-row stages
    "d64-gqa8-block32": (VARIANTS["d64-gqa8"], dict(sparse_block=32)),  # 32-row stages
    "d128-gqa4-kv-shared-by-the-batch": ((128, 128, "bfloat16", 4, False), dict(sparse_block=128,
                                                                                 kv_batch_broadcast=True)),
    "mla-192-128-prefix-lm-block128": (VARIANTS["mla-192-128"], dict(mask_program=PREFIX_LM, sparse_block=128)),
    "d128-gqa4-per-head-mask-unpacked": ((128, 128, "bfloat16", 4, False), dict(
        mask_program=SLIDING, sparse_block=128, gqa_unpacked=True)),  # a CTA per query head
    "absorbed-mla-576-512-document-block128": (VARIANTS["absorbed-mla-576-512"], dict(
        mask_program=DOCUMENT, mask_dtypes=("int32",), sparse_block=128)),
}


def spec_of(name: str):
    if name in VARIANTS:
        return flex_decode_spec(*VARIANTS[name])
    if name in MASK_VARIANTS:
        args, kwargs = MASK_VARIANTS[name]
        return flex_decode_spec(*args, **kwargs)
    args, program, dtypes = SCORE_VARIANTS[name]
    return flex_decode_spec(*args, score_program=program, score_dtypes=dtypes)


@pytest.fixture(scope="module", params=sorted(VARIANTS) + sorted(SCORE_VARIANTS) + sorted(MASK_VARIANTS))
def compiled(request):
    return compile_spec(spec_of(request.param), "sm_90a", keep_ptx=True)


def test_uses_wgmma_tma_mbarriers_and_exp2(compiled):
    ptx = compiled.ptx
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx  # the K/V ring
    assert re.search(r"cp\.async\.c[ag]\.shared\.global", ptx)  # the packed Q rows
    assert "ex2.approx" in ptx and "lg2.approx" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx


def test_both_kernels_are_in_the_object(compiled):
    entries = re.findall(r"^\.visible \.entry (\S+)\(", compiled.ptx, re.M)
    assert len(entries) == 2
    assert any("split_kernel" in e for e in entries) and any("combine_kernel" in e for e in entries)


def test_each_kernel_waits_for_the_previous_grid_before_any_global_access_then_releases_the_next(compiled):
    bodies = entries(compiled.ptx)
    assert len(bodies) == 2
    for body in bodies:
        check_waits_then_releases(body)


def test_ptxas_reports_no_spills_and_no_stack(compiled):
    report = compiled.ptxas_report
    assert report and report.count("Used") == 2
    assert len(re.findall(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report)) == 2
    assert not re.search(r"[1-9]\d* bytes spill", report)
    assert "wgmma.mma_async instructions are serialized" not in report  # C7512/C7519: no overlap left
    assert "setmaxnreg' ignored" not in report.replace("''", "'")


def test_pv_uses_p_from_registers():
    # the S -> P conversion feeds WGMMA's A operand from registers: no P round trip through smem
    ptx = compile_spec(flex_decode_spec(*VARIANTS["d128-gqa8"]), "sm_90a", keep_ptx=True).ptx
    rs = [line for line in ptx.splitlines() if "wgmma.mma_async" in line and "m64n128k16" in line]
    assert rs and "ld.local" not in ptx and "st.local" not in ptx


def test_score_programs_reach_the_split_kernel():
    plain = compile_spec(spec_of("d128-gqa8"), "sm_90a", keep_ptx=True).ptx
    softcap = compile_spec(spec_of("d128-gqa8-softcap"), "sm_90a", keep_ptx=True).ptx
    alibi = compile_spec(spec_of("d128-gqa8-alibi"), "sm_90a", keep_ptx=True).ptx
    # score / 30 multiplies by fp32(1/30) per element (64 per thread and block), with no IEEE
    # division and its slow-path branch; tanh is not approximate
    assert "div.rn.f32" not in softcap and softcap.count("0f3D088889") >= 64
    assert "tanh.approx" not in softcap
    # ALiBi reads the slopes (one per row a thread holds) and converts kv - q to float
    assert alibi.count("ld.global.b32") > plain.count("ld.global.b32")
    assert "cvt.rn.f32.s32" in alibi
    for ptx in (softcap, alibi):  # the mod sits between two WGMMAs, P still from registers
        assert "ld.local" not in ptx and "st.local" not in ptx


def test_exp2_and_n_d_mask_reads_reach_the_split_kernel():
    plain = compile_spec(spec_of("d64-gqa8"), "sm_90a", keep_ptx=True).ptx
    alibi = compile_spec(spec_of("d64-gqa8-alibi-exp2"), "sm_90a", keep_ptx=True).ptx
    # exp2 of each row's slope: more ex2 than the softmax's own, and the row's int math converted
    assert alibi.count("ex2.") > plain.count("ex2.") and "cvt.rn.f32.s32" in alibi
    padded = compile_spec(spec_of("d128-gqa4-transformers-padding-block128"), "sm_90a", keep_ptx=True).ptx
    base = compile_spec(flex_decode_spec(128, 128, "bfloat16", 4, False), "sm_90a", keep_ptx=True).ptx
    assert padded.count("ld.global") > base.count("ld.global")  # the offset, the padding row, the block list
    dynamic = compile_spec(spec_of("d128-gqa4-transformers-padding-dynamic"), "sm_90a", keep_ptx=True).ptx
    assert dynamic.count("ld.global") == padded.count("ld.global")  # the length is an argument, not a load
    for ptx in (alibi, padded, dynamic):
        assert "ld.local" not in ptx and "st.local" not in ptx


def test_block_masks_and_mask_programs_reach_the_split_kernel():
    plain = compile_spec(spec_of("d128-gqa8"), "sm_90a", keep_ptx=True).ptx
    sliding = compile_spec(spec_of("d128-gqa8-sliding-block128"), "sm_90a", keep_ptx=True).ptx
    only_blocks = compile_spec(spec_of("d256-block-mask-only"), "sm_90a", keep_ptx=True).ptx
    # the block list: kv_num_blocks, full_kv_num_blocks and the indices are read from global memory
    for ptx in (sliding, only_blocks):
        assert ptx.count("ld.global") > plain.count("ld.global")
        assert "ld.local" not in ptx and "st.local" not in ptx
    # the mask program compares each element's query and key positions: 64 selects per block row pair
    assert sliding.count("selp.f32") >= plain.count("selp.f32") + 64


GQA8 = FlexDecodeProblem(128, 128, "bfloat16", 8)


def test_mask_and_block_mask_configs_are_validated():
    from inductor_cute.kernels.attention.flex_decode_config import sparse_block_reason

    config = default_config(GQA8)

    def error(**problem):
        return config_error(config, dataclasses.replace(GQA8, **problem))

    assert error(mask_program=SLIDING, sparse_block=256) is None
    assert "unknown argument 'score'" in error(mask_program=SOFTCAP)
    assert "end in a bool" in error(mask_program=dumps([["o", "add", "kv", 1]]))
    assert "not a multiple" in error(sparse_block=64)
    from inductor_cute.kernels.attention.flex_decode_config import kv_block_for

    assert [kv_block_for(128, 128, b) for b in (0, 128, 256, 64, 32, 96, 48)] == [128, 128, 128, 64, 32, 32, 128]
    smaller = default_config(dataclasses.replace(GQA8, sparse_block=64))
    assert smaller.kv_block == 64 and config_error(smaller, dataclasses.replace(GQA8, sparse_block=64)) is None
    assert smaller.stages > config.stages  # as many bytes in flight in smaller stages
    assert sparse_block_reason(128, 32, 128, 64) is None  # absorbed MLA: 4 kernel blocks per mask block
    assert "not a multiple" in sparse_block_reason(64, 128, 128, 1)
    assert "query block" in sparse_block_reason(128, 128, 16, 32)
    from inductor_cute.kernels.attention.flex_decode_config import pack_factor, unpacks_gqa

    # a mask per query head under GQA: a CTA per query head; broadcast or without GQA: packed
    assert unpacks_gqa(32, 4) and not unpacks_gqa(1, 4) and not unpacks_gqa(32, 1)
    assert pack_factor(GQA8) == 8 and pack_factor(dataclasses.replace(GQA8, gqa_unpacked=True)) == 1


def test_score_program_configs_are_validated():
    config = default_config(GQA8)
    assert config_error(config, dataclasses.replace(GQA8, score_program=SOFTCAP)) is None
    assert "unknown tensor" in config_error(config, dataclasses.replace(GQA8, score_program=ALIBI))
    assert "canonical" in config_error(config, dataclasses.replace(GQA8, score_program=SOFTCAP.replace(",", ", ")))
    with pytest.raises(ValueError, match="float64 is not supported"):
        flex_decode_spec(128, 128, "bfloat16", 8, score_program=ALIBI, score_dtypes=("float64",))


def test_default_configs_fit_and_keep_bytes_in_flight():
    for (dqk, dv), (kv_block, wgs) in HEAD_DIMS.items():
        problem = FlexDecodeProblem(dqk, dv, "bfloat16", 8)
        cfg = default_config(problem)
        assert config_error(cfg, problem) is None
        assert smem_bytes(problem, cfg) <= SMEM_BUDGET
        assert (cfg.kv_block, cfg.v_warpgroups) == (kv_block, wgs)
        assert cfg.stages >= 2, (dqk, dv)
        assert dv // wgs <= 256  # one WGMMA's N
    assert default_config(FlexDecodeProblem(64, 64, "bfloat16", 1)).stages >= 6


def test_head_dims_96_compile_without_local_memory():
    # Phi-3/3.5-mini's heads: 192-byte rows, 64-byte swizzles
    compiled = compile_spec(flex_decode_spec(96, 96, "bfloat16", 4, False), "sm_90a", keep_ptx=True)
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    assert len(re.findall(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                          compiled.ptxas_report)) == 2


def test_unsupported_problems_are_named_in_one_line():
    assert "dtype float32" in unsupported_reason(128, 128, "float32")
    assert "head dims 80/80" in unsupported_reason(80, 80, "bfloat16")
    assert unsupported_reason(96, 96, "bfloat16") is None  # passed its GPU tests
    assert "query length 65" in unsupported_reason(128, 128, "bfloat16", 8, 65)
    assert "at least 1" in unsupported_reason(128, 128, "bfloat16", 0)
    for reason in (unsupported_reason(80, 80, "bfloat16"), unsupported_reason(128, 128, "int8")):
        assert "\n" not in reason
    assert unsupported_reason(576, 512, "float16", 128, 64) is None


def test_invalid_configs_are_named():
    absorbed = FlexDecodeProblem(576, 512, "bfloat16", 1)
    assert "shared memory" in config_error(FlexDecodeConfig(128, 4, 1), GQA8)
    assert "kv_block" in config_error(FlexDecodeConfig(24, 2, 1), GQA8)
    assert "output columns" in config_error(FlexDecodeConfig(32, 1, 1), absorbed)
    assert config_error(default_config(GQA8), GQA8) is None
    with pytest.raises(ValueError, match="shared memory"):
        flex_decode_spec(128, 128, "bfloat16", 8, config=FlexDecodeConfig(128, 4, 1))
    with pytest.raises(ValueError, match="shared memory"):
        spec(GQA8, FlexDecodeConfig(128, 4, 1))


def test_spec_spells_problem_and_config_and_reads_back():
    # the kernel's parameters (its cache key) are the problem's and the config's fields, flat
    problem = FlexDecodeProblem(128, 128, "bfloat16", 8, True, SOFTCAP, (), DOCUMENT, ("int32",), 256)
    s = spec(problem)
    assert s == flex_decode_spec(128, 128, "bfloat16", 8, True, score_program=SOFTCAP, mask_program=DOCUMENT,
                                 mask_dtypes=("int32",), sparse_block=256)
    assert set(s.kwargs) == set(problem.as_params()) | {"kv_block", "stages", "v_warpgroups"}
    assert from_params(s.kwargs) == (problem, default_config(problem))


def test_query_row_copies_stop_at_each_rows_end():
    # the query tile's cp.async stretches (16 bytes a thread) must tile every row exactly: at 96
    # columns a 64-column stretch read 32 columns of the next row into the next row of sQ
    for dqk, _ in HEAD_DIMS:
        threads = fdc.q_copy_threads_per_row(dqk)
        assert dqk % (threads * 8) == 0 and 128 % threads == 0, dqk
    assert fdc.q_copy_threads_per_row(96) == 4 and fdc.q_copy_threads_per_row(128) == 8


def test_packed_gqa_rows_map_to_query_heads_and_positions_and_back():
    from inductor_cute.kernels.attention.pack_gqa import PackGQA

    rows = PackGQA(4)
    assert rows.rows(3) == 12
    assert [rows.unpack(p, 2) for p in (0, 1, 4, 11)] == [(8, 0), (9, 0), (8, 1), (11, 2)]
    for p in range(rows.rows(3)):
        head, pos = rows.unpack(p, 2)
        assert rows.pack(head - 2 * 4, pos) == p


def _one_full_round(base: int, splits: int, sms: int = 132) -> bool:
    """`splits` per (batch, KV head, row tile) make one round of at most `sms` CTAs, and one more
    split would not fit in it."""
    return base * splits <= sms < base * (splits + 1)


def test_splits_make_one_round_of_ctas_that_nearly_fills_the_sms():
    # the three Llama-3.1-8B decode shapes the twelfth session swept on the H200 (best measured:
    # 16, 2 and 1 splits): one round of CTAs beats two rounds that fill every SM
    assert num_splits(1, 8, m_tiles(4, 1), 32768, 128) == 16  # B1 KV32768: 128 CTAs
    assert num_splits(8, 8, m_tiles(4, 1), 8192, 128) == 2  # B8 KV8192: 128 CTAs
    assert num_splits(32, 8, m_tiles(4, 1), 4096, 128) == 1  # B32 KV4096: 256 pairs already
    # B1 Hkv8 KV131072: long sequences split widely, still one round
    s = num_splits(1, 8, 1, 131072, 128)
    assert _one_full_round(8, s) and 131072 // 128 // s >= 4
    # B4 Hq48 Hkv8 KV32768
    assert _one_full_round(4 * 8, num_splits(4, 8, 1, 32768, 128))
    # absorbed MLA: 128 query heads on one KV head fill two row tiles
    assert m_tiles(128, 1) == 2 and _one_full_round(8 * 2, num_splits(8, 1, 2, 8192, 32))
    # another SM count moves the round with it
    assert num_splits(1, 8, 1, 32768, 128, num_sms=78) == 9


def test_splits_stay_whole_blocks_and_vanish_for_short_or_wide_problems():
    assert num_splits(1, 1, 1, 128, 128) == 1  # tiny KV: one block, one split
    assert num_splits(1, 1, 1, 1, 128) == 1
    assert num_splits(1, 1, 1, 1000, 128) <= 2  # 8 blocks: at least 4 per split
    assert num_splits(64, 8, 1, 4096, 128) == 1  # 512 CTAs already cover the SMs
    for args in [(1, 8, 1, 131072, 128), (2, 2, 1, 10**6, 128), (3, 5, 2, 7777, 64)]:
        s = num_splits(*args)
        assert 1 <= s <= 256 and -(-args[3] // args[4]) // s >= 4


def test_split_count_follows_the_sm_count():
    assert DEFAULT_SM_COUNT == 132 and SMEM_BUDGET == 227 * 1024  # the H100/H200 facts of runtime/arch.py
    assert num_splits(1, 8, 1, 131072, 128, num_sms=66) < num_splits(1, 8, 1, 131072, 128, num_sms=132)


def test_flex_decode_refuses_cpu_tensors():
    import torch

    from inductor_cute import UnsupportedError, ops

    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, 16, 128, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="^flex_decode: tensors must be on a CUDA device, got cpu$"):
        ops.flex_decode(q, kv, kv)
