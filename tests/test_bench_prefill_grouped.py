"""The flex_prefill and grouped_gemm benchmark suites without a GPU: registry, case lists and names
of issues 13 and 14, flops counted from the masks, our programs against the flex mods, the fp32
reference against flex_attention, routing and offsets; and the harness's check of every runner
against a case's reference."""

import dataclasses
import functools
import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from inductor_cute.bench import harness
from inductor_cute.bench.case import Case
from inductor_cute.bench.suites import SUITES
from inductor_cute.bench.suites import flex_prefill as fp
from inductor_cute.bench.suites import grouped_gemm as gg
from inductor_cute.kernels.common.programs import score as sp

ISSUE_13 = ["dsv3-mla B1 H128 S4096 causal", "dsv2-lite B1 H16 S8192 causal", "llama B4 H32/8 S4096 causal",
            "llama B2 H32/8 S16384 noncausal", "doc-causal B1 H32 S16384", "sliding1024 B4 H32/8 S8192",
            "softcap50 B2 H16/8 S8192 causal", "alibi B4 H16 S4096 causal", "vit B32 H16 S1024 noncausal"]


def test_registered():
    assert SUITES["flex_prefill"] is fp and SUITES["grouped_gemm"] is gg


# ------------------------------------------------------------------------------------ flex_prefill

@pytest.mark.parametrize("quick", [True, False])
def test_prefill_cases_are_the_issues_named_factories(quick):
    factories = fp.cases(quick)
    assert all(isinstance(f, functools.partial) for f in factories)
    names = [f.case_name for f in factories]
    assert names == [f.args[0].name for f in factories]
    assert names == ([ISSUE_13[0], ISSUE_13[2], ISSUE_13[8]] if quick else ISSUE_13)


def test_prefill_shapes_of_the_issue():
    shapes = {p.name: (p.b, p.hq, p.hkv, p.s, p.dqk, p.dv) for p in fp.CASES}
    assert shapes["dsv3-mla B1 H128 S4096 causal"] == (1, 128, 128, 4096, 192, 128)
    assert shapes["dsv2-lite B1 H16 S8192 causal"] == (1, 16, 16, 8192, 192, 128)
    assert shapes["llama B4 H32/8 S4096 causal"] == (4, 32, 8, 4096, 128, 128)
    assert shapes["softcap50 B2 H16/8 S8192 causal"] == (2, 16, 8, 8192, 256, 256)
    assert shapes["vit B32 H16 S1024 noncausal"] == (32, 16, 16, 1024, 64, 64)
    assert fp.SOFTCAP == 50.0 and fp.WINDOW == 1024
    assert [len(fp.document_lengths(16384)), sum(fp.document_lengths(16384))] == [8, 16384]
    assert len(set(fp.document_lengths(16384))) == 8  # uneven
    assert all(length % 128 for length in fp.document_lengths(16384))  # boundaries inside blocks


def closed_form_kept(p, s=None):
    s = s or p.s
    if p.variant == "noncausal":
        return s * s
    if p.variant == "document":
        return sum(n * (n + 1) // 2 for n in fp.document_lengths(s))
    if p.variant == "sliding":
        return sum(min(q + 1, fp.WINDOW) for q in range(s))
    return s * (s + 1) // 2


@pytest.mark.parametrize("p", fp.CASES, ids=lambda p: p.name)
def test_kept_pairs_are_counted_exactly_from_the_mask(p):
    p = dataclasses.replace(p, s=2500)  # a length a CPU counts quickly, off the blocks
    kept = fp.kept_pairs(fp.mods_of(p, device="cpu").mask_mod, p.s, p.s, chunk=700)
    assert kept == closed_form_kept(p)


def test_flops_count_the_kept_fraction_of_the_dense_work():
    dsv3 = fp.CASES[0]
    kept = fp.kept_pairs(fp.mods_of(dsv3, device="cpu").mask_mod, 4096, 4096)
    assert kept == 4096 * 4097 // 2
    flops, n_bytes = fp.cost(dsv3, kept)
    assert flops == 2 * 1 * 128 * 4096 * 4096 * (192 + 128) * (4097 / 8192)
    assert n_bytes == 2 * (128 * 4096 * (192 + 128) + 128 * 4096 * (192 + 128))
    llama = fp.CASES[3]
    assert fp.cost(llama, closed_form_kept(llama))[0] == 2 * 2 * 32 * 16384 ** 2 * 256
    assert fp.cost(llama, closed_form_kept(llama))[1] == 2 * 2 * (32 + 8) * 16384 * 256
    doc = fp.CASES[4]
    fraction = closed_form_kept(doc) / 16384 ** 2
    assert 0.08 < fraction < 0.09  # 8 documents: far less work than causal's half


def index_tensors(shape):
    return [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(shape)]


@pytest.mark.parametrize("p", fp.CASES, ids=lambda p: p.name)
def test_our_programs_compute_the_flex_mods(p):
    p = dataclasses.replace(p, b=1, s=700)
    mods = fp.mods_of(p, device="cpu")
    shape = (1, p.hq, 700, 700)
    idx = index_tensors(shape)
    if mods.mask_mod is None:
        assert mods.mask_program is None
    else:
        keep = sp.reference_mask(mods.mask_program, *idx, mods.mask_tensors)
        assert torch.equal(keep, mods.mask_mod(*idx).expand(shape))
    if mods.score_mod is None:
        assert mods.score_program is None
    else:
        score = torch.randn(shape) * 40
        torch.testing.assert_close(sp.reference(mods.score_program, score, *idx, mods.score_tensors),
                                   mods.score_mod(score, *idx).expand(shape))


TINY = {v: fp.Prefill(f"tiny {v}", 2, 4, 2, 300, 24, 16, v) for v in fp.VARIANTS}


@pytest.mark.parametrize("variant", fp.VARIANTS)
def test_reference_is_flex_attention(variant, monkeypatch):
    """The fp32 reference (chunked: several KV heads, query chunks) computes what the stock
    runner's flex_attention arguments ask for: GQA, Dqk != Dv, every variant's mods."""
    monkeypatch.setattr(fp, "WINDOW", 64)
    p = TINY[variant]
    mods = fp.mods_of(p, device="cpu")
    kept = fp.kept_pairs(mods.mask_mod, p.s, p.s)
    q, k, v = fp.make_inputs(p, kept, device="cpu", dtype=torch.float32)
    scale = p.dqk ** -0.5
    block_mask = fp.block_mask_of(p, mods, device="cpu")
    expected = flex_attention(q, k, v, scale=scale, enable_gqa=True, **fp.flex_kwargs(mods, block_mask))
    out = fp.reference(q, k, v, scale, mods, max_scores=2 * p.s * 70)
    assert out.dtype == torch.float32 and out.shape == (p.b, p.hq, p.s, p.dv)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    sdpa = fp.sdpa_runner(p, q, k, v, scale)
    if variant in ("causal", "noncausal"):
        torch.testing.assert_close(sdpa(), expected, atol=1e-5, rtol=1e-5)
    else:
        assert sdpa is None


def test_our_arguments_carry_the_block_mask_and_programs():
    p = TINY["document"]
    mods = fp.mods_of(p, device="cpu")
    bm = fp.block_mask_of(p, mods, device="cpu")
    kw = fp.ours_kwargs(mods, bm)
    assert kw["mask_mod"] == fp.DOCUMENT_CAUSAL_PROGRAM and kw["mask_tensors"][0].dtype == torch.int32
    assert kw["kv_indices"] is bm.kv_indices and (kw["kv_block_size"], kw["q_block_size"]) == (128, 128)
    keep = sp.reference_keep((p.b, p.hq, p.s, p.s), kw["mask_mod"], kw["mask_tensors"],
                             (kw["kv_num_blocks"], kw["kv_indices"], kw["full_kv_num_blocks"], kw["full_kv_indices"]))
    assert int(keep[0, 0].sum()) == fp.kept_pairs(mods.mask_mod, p.s, p.s)
    plain = fp.ours_kwargs(fp.mods_of(TINY["noncausal"], device="cpu"), None)
    assert "kv_indices" not in plain and plain["mask_mod"] is None and plain["score_mod"] is None


@pytest.mark.parametrize("variant", ["document", "sliding", "alibi"])
def test_ignoring_a_mod_misses_by_more_than_the_tolerance(variant):
    """With the suite's peaked queries, a kernel that ignored the mask or score_mod would be caught
    by the harness's 2e-2 check, while bf16 inputs stay within it of the fp32 answer."""
    p = fp.Prefill(variant, 1, 4, 4, 2048, 64, 64, variant)
    mods = fp.mods_of(p, device="cpu")
    q, k, v = fp.make_inputs(p, fp.kept_pairs(mods.mask_mod, p.s, p.s), device="cpu")
    scale = p.dqk ** -0.5
    exact = fp.reference(q, k, v, scale, mods)
    causal = fp.reference(q, k, v, scale, fp.mods_of(fp.Prefill("", 1, 4, 4, 2048, 64, 64, "causal"), device="cpu"))
    assert not torch.allclose(causal, exact, atol=2e-2, rtol=2e-2)
    bf16 = fp.reference(q, k, v, scale, mods).to(torch.bfloat16)
    assert torch.allclose(bf16.float(), exact, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------ grouped_gemm

@pytest.mark.parametrize("quick", [True, False])
def test_grouped_cases_and_names(quick):
    factories = gg.cases(quick)
    names = [f.case_name for f in factories]
    assert names == [f.args[0].name for f in factories] and len(set(names)) == len(names)
    if quick:
        assert names == ["DeepSeek-V3 fwd up T16384 balanced", "Qwen3-30B-A3B fwd up T16384 skewed",
                         "Mixtral-8x7B fwd up T4096 balanced", "Qwen3-30B-A3B wgrad up T16384 skewed",
                         "DeepSeek-V3 wgrad down T4096 balanced", "DeepSeek-V3 dgrad up T16384 skewed"]
        return
    assert len(names) == 2 * 5 * 2 * 2 * 2 + 2 * 2 * 2 * 2  # dgrad for the issue's two backward models
    assert {c.model.name for c in gg.CASES if c.form == "dgrad"} == {"DeepSeek-V3", "Qwen3-30B-A3B"}
    assert [c.form for c in gg.CASES].count("wgrad") == 5 * 2 * 2 * 2
    for c, name in zip(gg.CASES, names):
        assert name.startswith(f"{c.model.name} {c.form} ")
        assert f" {c.projection} " in name and f"T{c.tokens}" in name and name.endswith(c.routing)
    assert {c.model.name for c in gg.CASES} == {"DeepSeek-V3", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "Mixtral-8x7B",
                                                 "gpt-oss-120b"}


def test_models_of_the_issue():
    m = {x.name: (x.experts, x.topk, x.hidden, x.ffn) for x in gg.MODELS}
    assert m == {"DeepSeek-V3": (256, 8, 7168, 2048), "Qwen3-30B-A3B": (128, 8, 2048, 768),
                 "Qwen3-235B-A22B": (128, 8, 4096, 1536), "Mixtral-8x7B": (8, 2, 4096, 14336),
                 "gpt-oss-120b": (128, 4, 2880, 2880)}
    dsv3 = gg.MODELS[0]
    assert gg.Grouped(dsv3, "up", 4096, "balanced").n_k == (4096, 7168)  # gate and up fused
    assert gg.Grouped(dsv3, "down", 4096, "balanced").n_k == (7168, 2048)


@pytest.mark.parametrize("model, tokens", list(itertools.product(gg.MODELS, gg.TOKENS)),
                         ids=lambda x: getattr(x, "name", x))
def test_routing_sums_to_every_routed_row(model, tokens):
    rows = tokens * model.topk
    balanced = gg.balanced_sizes(tokens, model.topk, model.experts)
    assert sum(balanced) == rows and max(balanced) - min(balanced) <= 1 and len(balanced) == model.experts
    skewed = gg.skewed_sizes(tokens, model.topk, model.experts)
    assert sum(skewed) == rows and len(skewed) == model.experts
    assert skewed.count(0) >= 1 and skewed.count(0) == min(max(1, round(model.experts / 8)),
                                                           model.experts - model.topk)
    assert max(skewed) <= tokens  # a token picks an expert at most once
    assert max(skewed) > 2 * rows / model.experts  # skewed indeed
    assert skewed == gg.skewed_sizes(tokens, model.topk, model.experts)  # seeded


@pytest.mark.parametrize("routing", gg.ROUTINGS)
def test_offsets_are_non_decreasing_int32_ends(routing):
    case = gg.Grouped(gg.MODELS[1], "up", 4096, routing)
    sizes = gg.group_sizes(case)
    offs = gg.offsets(sizes)
    assert offs.dtype == torch.int32 and offs.shape == (128,)
    assert (offs[1:] >= offs[:-1]).all() and offs[0] >= 0 and int(offs[-1]) == case.rows
    assert torch.diff(offs, prepend=torch.zeros(1, dtype=torch.int32)).tolist() == sizes
    if routing == "skewed":
        assert (offs[1:] == offs[:-1]).any()  # empty groups


def test_grouped_cost():
    case = gg.Grouped(gg.MODELS[0], "up", 16384, "skewed")
    sizes = gg.group_sizes(case)
    flops, n_bytes = gg.cost(case, sizes)
    assert flops == 2 * 16384 * 8 * 4096 * 7168
    used = 256 - sizes.count(0)
    assert n_bytes == 2 * (16384 * 8 * 7168 + used * 7168 * 4096 + 16384 * 8 * 4096)


def test_wgrad_cases_are_autograds_weight_gradient():
    tiny = gg.MoeModel("tiny", 6, 2, 64, 40)
    case = gg.Grouped(tiny, "up", 50, "skewed", "wgrad")
    sizes = gg.group_sizes(case)
    a, b, offs = gg.make_inputs(case, sizes, device="cpu")
    assert a.shape == (80, 100) and a.stride() == (1, 80)  # grad_out.t()
    assert b.shape == (100, 64) and b.is_contiguous() and int(offs[-1]) == 100
    flops, n_bytes = gg.cost(case, sizes)
    assert flops == 2 * 100 * 80 * 64 and n_bytes == 2 * (100 * (64 + 80) + 6 * 64 * 80)


def test_dgrad_cases_are_autograds_input_gradient():
    """dgrad is the forward with N and K swapped, b the weight as autograd passes it (the transpose
    of the forward's transposed view: the (E, N_fwd, K_fwd) weight itself), output (rows, K_fwd)."""
    tiny = gg.MoeModel("tiny", 6, 2, 64, 40)
    fwd, dgrad = (gg.Grouped(tiny, "up", 50, "skewed", form) for form in ("fwd", "dgrad"))
    assert dgrad.name == "tiny dgrad up T50 skewed" and fwd.n_k == (80, 64) and dgrad.n_k == (64, 80)
    sizes = gg.group_sizes(dgrad)
    grad, w, offs = gg.make_inputs(dgrad, sizes, device="cpu")
    assert grad.shape == (100, 80) and grad.is_contiguous()
    assert w.shape == (6, 80, 64) and w.is_contiguous() and gg._b_major(dgrad) == "n"  # N-major
    assert gg._b_major(fwd) == "k"
    x = torch.randn(100, 64, requires_grad=True)
    weight = w.detach().float().clone()  # (E, N_fwd, K_fwd) as held
    ends = [0, *offs.tolist()]
    out = torch.cat([x[s:e] @ weight[g].T for g, (s, e) in enumerate(zip(ends, ends[1:]))])
    (dx,) = torch.autograd.grad(out, x, grad.float())
    got = torch.cat([grad[s:e].float() @ w[g].float() for g, (s, e) in enumerate(zip(ends, ends[1:]))])
    torch.testing.assert_close(got, dx)
    assert 0.3 < got.std() < 3  # w scaled by 1/sqrt of the reduction: outputs O(1)
    flops, n_bytes = gg.cost(dgrad, sizes)
    used = 6 - sizes.count(0)
    assert flops == 2 * 100 * 80 * 64 and n_bytes == 2 * (100 * 80 + used * 80 * 64 + 100 * 64)


def test_grouped_inputs_are_transposed_weights_and_match_per_group_matmuls():
    tiny = gg.MoeModel("tiny", 6, 2, 64, 40)
    case = gg.Grouped(tiny, "up", 50, "skewed")
    sizes = gg.group_sizes(case)
    a, b, offs = gg.make_inputs(case, sizes, device="cpu")
    assert a.shape == (100, 64) and b.shape == (6, 64, 80) and b.stride(1) == 1  # K-major view of (E, N, K)
    assert offs.dtype == torch.int32 and int(offs[-1]) == 100
    ends = [0, *offs.tolist()]
    out = torch.cat([a[s:e].float() @ b[g].float() for g, (s, e) in enumerate(zip(ends, ends[1:]))])
    assert out.shape == (100, 80) and 0.3 < out.std() < 3  # weights scaled by 1/sqrt(K): outputs O(1)


# ------------------------------------------------------------------------------------------ harness

def _case(reference=None):
    return Case("c", {}, 0, 0, runners={}, reference=reference)


def test_runners_are_checked_against_the_reference_when_a_case_has_one():
    ref = torch.ones(4, 4)
    outputs = {"inductor_cute": ref + 1e-3, "aten": ref + 0.5, "flash": ref.clone(), "triton": torch.ones(4, 3)}
    bad = dict(harness._check(_case(lambda: ref), outputs, ref))
    assert set(bad) == {"aten", "triton"}
    assert "differs from the reference" in bad["aten"] and "shape" in bad["triton"]
    # without one, against aten; every additional runner too
    bad = dict(harness._check(_case(), outputs))
    assert set(bad) == {"inductor_cute", "flash", "triton"} and "differs from aten" in bad["flash"]
    assert harness._check(_case(), {"inductor_cute": ref}) == []


def test_outputs_are_compared_chunk_by_chunk_over_every_element(monkeypatch):
    # (outputs of billions of elements are compared a chunk at a time: each chunk must count)
    import dataclasses

    monkeypatch.setattr(harness, "_CHUNK", 5)
    ref = torch.arange(1.0, 24.0)
    late = ref.clone()
    late[-1] += 0.5  # in the last, partial chunk
    bad = dict(harness._check(_case(), {"aten": ref, "inductor_cute": late.bfloat16()}))
    assert set(bad) == {"inductor_cute"} and "max abs err 0.5" in bad["inductor_cute"]
    # atol of the reference's largest magnitude, found in any chunk
    relative = dataclasses.replace(_case(), atol=0.03, rtol=0.0, atol_of_max=True)
    assert harness._check(relative, {"aten": ref, "inductor_cute": late}) == []  # 0.5 <= 0.03 * 23
    poisoned = ref.clone()
    poisoned[7] = float("nan")
    unchecked = dataclasses.replace(_case(), atol=float("inf"), rtol=float("inf"))
    assert set(dict(harness._check(unchecked, {"aten": ref, "inductor_cute": poisoned}))) == {"inductor_cute"}


def test_variant_runners_are_one_fixed_config_each(monkeypatch):
    # each runner's name means the same config whatever the host's defaults are
    import inductor_cute.host.common as common
    from inductor_cute.kernels.attention.flex_prefill_config import FlexPrefillProblem, config_error, plain_config

    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    by_name = {p.name: p for p in fp.CASES}
    for name, q_stages in [("vit B32 H16 S1024 noncausal", 2), ("llama B4 H32/8 S4096 causal", 1),
                           ("dsv3-mla B1 H128 S4096 causal", 1)]:
        p = by_name[name]
        problem = FlexPrefillProblem(p.dqk, p.dv, "bfloat16")
        plain = fp.variant_config(p, **fp.VARIANT_KNOBS["plain"])
        assert plain == plain_config(problem) and plain.persistent_ctas == 0 and plain.early_exps == 0
        dynamic = fp.variant_config(p, **fp.VARIANT_KNOBS["dynamic_split_early"])
        assert config_error(dynamic, problem) is None
        assert (dynamic.persistent_ctas, dynamic.dynamic_tiles, dynamic.split_kv) == (132, True, True)
        assert dynamic.early_exps == dynamic.kv_block // 4 * 5 // 8 and dynamic.stages == plain.stages
        # a second Q buffer only where it fits beside the ring
        assert fp.variant_config(p, persistent=True).q_stages == q_stages
    for p in fp.CASES:
        for knobs in fp.VARIANT_KNOBS.values():
            config = fp.variant_config(p, **knobs)
            assert config is None or config_error(config, FlexPrefillProblem(p.dqk, p.dv, "bfloat16")) is None
    # --quick times only the variants still open; the full suite every one
    assert set(fp.QUICK_VARIANTS) < set(fp.VARIANT_KNOBS)
    assert all(c.args[1:] == (fp.QUICK_VARIANTS,) for c in fp.cases(quick=True))
    assert all(c.args[1:] == () for c in fp.cases(quick=False))

def test_unchecked_cases_accept_exact_zeros_and_reject_only_non_finite_outputs():
    # a whole-model case (atol = rtol = inf) reports its own agreement: allclose would make
    # inf * |0| a NaN and reject every output whose reference holds an exact zero (logits do)
    import dataclasses

    ref = torch.tensor([[0.0, 1.0], [-2.0, 0.0]])
    case = dataclasses.replace(_case(), atol=float("inf"), rtol=float("inf"))
    assert harness._check(case, {"aten": ref, "inductor_cute": ref + 5.0}) == []
    poisoned = ref.clone()
    poisoned[0, 1] = float("nan")
    bad = dict(harness._check(case, {"aten": ref, "inductor_cute": poisoned}))
    assert set(bad) == {"inductor_cute"} and "non-finite" in bad["inductor_cute"]
