"""The models suite's CPU-checkable parts: models built from configs in code, decode steps that walk
a StaticCache and wrap round, step costs, case names. transformers is an optional extra."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from inductor_cute.bench.suites import models as M  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=97)
EXTRA = {"llama3-8b": {}, "qwen3-30b-a3b": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
         "dsv2-lite": dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)}


def _tiny(name):
    return M.build_model(M.MODELS[name], 2, device="cpu", dtype=torch.float32, **{**TINY, **EXTRA[name]})


@pytest.mark.parametrize("name", list(M.MODELS))
def test_decode_step_matches_a_plain_forward_and_wraps_round(name):
    model = _tiny(name)
    assert model.config._attn_implementation == "flex_attention" and len(model.model.layers) == 2
    step = M.DecodeStep(model, batch=2, kv=64, device="cpu")
    first = step.first
    with torch.no_grad():
        a = step(model.forward)
        assert step.pos == first + 1 and int(step.position) == first + 1
        assert all(int(layer.cumulative_length) == first + 1 for layer in step.cache.layers)
        step.reference_inputs()
        b = step(model.forward)
    assert a.shape == (2, 1, 97) and torch.isfinite(a).all()
    torch.testing.assert_close(a, b)  # same position, same cache contents: same logits
    step._set(63)  # the last slot: the next call wraps to the first position instead of overflowing
    with torch.no_grad():
        step(model.forward)
    assert step.pos == first + 1


def test_steps_pass_generates_attention_mask_when_asked(monkeypatch):
    # INDUCTOR_CUTE_MODEL_ATTENTION_MASK=1: the 2-D mask of ones generate() passes (the cache's
    # length for decode, the tokens' for prefill); without it, none
    model = _tiny("llama3-8b")
    for masked in ("", "1"):
        monkeypatch.setenv("INDUCTOR_CUTE_MODEL_ATTENTION_MASK", masked)
        decode, prefill = M.DecodeStep(model, batch=2, kv=64, device="cpu"), M.PrefillStep(model, 2, 16, device="cpu")
        seen = []

        def forward(**kwargs):
            seen.append(kwargs.get("attention_mask"))
            return model.forward(**kwargs)

        with torch.no_grad():
            decode(forward), prefill(forward)
        if masked:
            assert [tuple(m.shape) for m in seen] == [(2, 64), (2, 16)] and all(bool((m == 1).all()) for m in seen)
        else:
            assert seen == [None, None]


def test_step_costs_count_weights_cache_and_active_experts():
    llama = _tiny("llama3-8b")
    params = sum(p.numel() for p in llama.parameters()) - 97 * 64 + 2 * 64  # embedding: 2 rows read
    flops, n_bytes = M.step_cost(M.MODELS["llama3-8b"], 2, "decode", 2, 64, llama)
    cache = 2 * 2 * 64 * (2 * 2 * 16 * 2)  # layers * batch * kv * (K+V heads*dim*2 bytes)
    assert n_bytes == 2 * params + cache + 2 * 2 * 97
    assert flops > 2 * params * 2
    moe = _tiny("qwen3-30b-a3b")
    moe_params = sum(p.numel() for p in moe.parameters()) - 97 * 64
    _, one_token = M.step_cost(M.MODELS["qwen3-30b-a3b"], 2, "decode", 1, 64, moe)
    _, many = M.step_cost(M.MODELS["qwen3-30b-a3b"], 2, "prefill", 8, 64, moe)
    assert one_token < 2 * moe_params  # one token touches 2 of 8 experts per layer
    assert many >= 2 * moe_params  # 512 tokens touch every expert


def test_case_names_and_the_suite_is_registered():
    from inductor_cute.bench.suites import SUITES

    assert SUITES["models"] is M
    assert M.case_name("llama3-8b", "decode", 8, 8192, "nocg") == "llama3-8b decode B8 KV8192 nocg"
    assert M.case_name("dsv2-lite", "prefill", 1, 4096, "cg") == "dsv2-lite prefill B1 x4096 cg"
    assert len(M.cases(quick=False)) == len(M.MODELS) * len(M.STEPS) * len(M.MODES) + len(M.TRAIN) + len(M.moe_block.CASES)
    assert M.cases(quick=True)[0].case_name == M.case_name(*M.QUICK[0])  # named: --match skips it unbuilt
    assert len(M.cases(quick=True)) == len(M.QUICK)


def test_our_kernel_calls_counts_gemm_and_flex_call_sites():
    code = ("icute_gemm_0 = inductor_cute.inductor.gemm.runtime.GemmLauncher(op='mm', config=(8,)).launch\n"
            "icute_gemm_0(a, b, buf1)\n"
            "icute_flex_1 = inductor_cute.inductor.flex.runtime.FlexDecodeLauncher(scale=0.1).call_static\n"
            "buf2 = icute_flex_1(q, k, v)\n"
            "buf3 = extern_kernels.mm(a, b)\n")
    assert M.our_kernel_calls(code) == 2


def test_gemm_picks_count_each_kind_of_gemm_call_site():
    code = "\n".join([
        "extern_kernels.mm(buf0, arg1_1, out=buf1)",
        "extern_kernels.addmm(arg2_1, buf1, arg3_1, alpha=1, beta=1, out=buf2)",
        "triton_tem_fused_mm_3.run(buf2, arg4_1, buf3, stream=stream0)",
        "triton_tem_fused_add_mm_4.run(buf3, arg5_1, buf4, stream=stream0)",
        "triton_tem_fused_0.run(buf4, buf5, stream=stream0)",  # templates that are no GEMM (flex)
        "triton_tem_fused_add_bmm_cat_flex_attention_mul_4.run(buf4, buf5, stream=stream0)",
        "triton_poi_fused_mul_5.run(buf4, buf6, stream=stream0)",
        "icute_gemm_0 = inductor_cute.inductor.gemm.runtime.GemmLauncher(spec='x')",
        "buf7 = torch.ops.inductor_cute.gemv_shared_a.default(buf6, [arg6_1, arg7_1])",
    ])
    assert M.gemm_picks(code) == "GEMM call sites: cuBLAS 2, Triton 2, ours 2"


def test_train_step_runs_forward_and_backward_and_drops_gradients():
    model = _tiny("llama3-8b")
    model.config._attn_implementation = "eager"  # flex_attention has no CPU backward; the step is the same
    step = M.TrainStep(model, batch=2, tokens=32, device="cpu")
    assert model.training and all(p.requires_grad for p in model.parameters())
    a = step(model.forward)
    grads = [p.grad.clone() for p in model.parameters()]
    b = step(model.forward)  # the same step again: gradients dropped first, not accumulated
    assert a.shape == (2,) and torch.isfinite(a).all() and a[1] > 0
    torch.testing.assert_close(a, b)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_train_cost_is_three_forwards_of_gemms_plus_both_attention_passes():
    model = _tiny("llama3-8b")
    fwd, fwd_bytes = M.step_cost(M.MODELS["llama3-8b"], 2, "prefill", 2, 32, model)
    train, train_bytes = M.step_cost(M.MODELS["llama3-8b"], 2, "train", 2, 32, model)
    pairs = 2 * 4 * 32 * 32 // 2 * 2  # batch, heads, causal (q, kv) pairs, layers
    attn_fwd = 2 * pairs * 2 * 16
    assert train == 3 * (fwd - attn_fwd) + attn_fwd + 2 * pairs * 5 * 16
    assert train_bytes == 3 * fwd_bytes
    with pytest.raises(ValueError, match="Llama-like"):
        M.step_cost(M.MODELS["qwen3-30b-a3b"], 2, "train", 1, 32, _tiny("qwen3-30b-a3b"))


def test_the_training_case_enables_our_prefill_and_backward():
    assert M.ENABLE["train"] == {"flex_prefill": True, "flex_backward": True} and M.ENABLE["decode"] == {}
    names = [c.case_name for c in M.cases(quick=False)]
    assert "llama3-8b train B1 x4096 nocg" in names
    assert not any("train" in c.case_name for c in M.cases(quick=True))


def test_our_kernel_calls_count_prefill_and_backward_launchers():
    code = ("f0 = inductor_cute.inductor.flex.runtime.FlexPrefillLauncher(scale=0.1).call\n"
            "f1 = inductor_cute.inductor.flex.runtime.FlexBackwardLauncher(scale=0.1)\n")
    assert M.our_kernel_calls(code) == 2


def test_switches_named_in_the_environment_join_each_phases_enable_kwargs(monkeypatch):
    from inductor_cute.bench.suites import models

    monkeypatch.delenv("INDUCTOR_CUTE_MODEL_ENABLE", raising=False)
    assert models.enable_kwargs("decode") == {}
    assert models.enable_kwargs("train") == {"flex_prefill": True, "flex_backward": True}
    monkeypatch.setenv("INDUCTOR_CUTE_MODEL_ENABLE", " group_gemv, flex_prefill ")
    assert models.enable_kwargs("decode") == {"group_gemv": True, "flex_prefill": True}
    assert models.enable_kwargs("train") == {"flex_prefill": True, "flex_backward": True, "group_gemv": True}
    monkeypatch.setenv("INDUCTOR_CUTE_MODEL_ENABLE", "keep_m1_mm,-trace_block_masks")
    assert models.enable_kwargs("decode") == {"keep_m1_mm": True, "trace_block_masks": False}


def test_our_kernel_calls_count_the_grouped_decode_gemv():
    code = ("buf2 = torch.ops.inductor_cute.gemv_shared_a.default(reinterpret_tensor(buf1, (1, 64), (0, 1), 0), "
            "[arg4_1, arg5_1])\n"
            "buf3 = buf2[0]\n")
    assert M.our_kernel_calls(code) == 1


def _late_runners(model, step, poison_after: int | None = None):
    """An eager runner and a 'compiled' one (the same forward) that returns NaN logits from its
    `poison_after`-th call on: a fault that shows only after many steps."""
    calls = [0]

    def compiled(*args, **kwargs):
        out = model.forward(*args, **kwargs)
        calls[0] += 1
        if poison_after is not None and calls[0] > poison_after:
            out.logits.fill_(float("nan"))
        return out

    return {"aten": lambda: M._run_step(step, model.forward), "inductor_cute": lambda: M._run_step(step, compiled)}


def test_late_agreement_compares_each_runner_with_eager_at_the_same_positions():
    model = _tiny("llama3-8b")
    step = M.DecodeStep(model, batch=2, kv=64, device="cpu")
    runners = _late_runners(model, step)
    for _ in range(5):  # "timing": the steps walk on and write the cache
        runners["inductor_cute"]()
    note = M.late_agreement(step, runners)
    assert note.startswith(f"late logits rel err at positions {step.first}/62: inductor_cute ")
    assert "0.00e+00/0.00e+00" in note and "MISMATCH" not in note
    assert runners["inductor_cute"] is not None and step.pos == step.first  # rewound for the next check


def test_late_agreement_disqualifies_a_runner_whose_logits_turn_non_finite():
    model = _tiny("llama3-8b")
    step = M.DecodeStep(model, batch=2, kv=64, device="cpu")
    runners = _late_runners(model, step, poison_after=3)
    for _ in range(3):
        assert torch.isfinite(runners["inductor_cute"]()).all()  # fine at first, as at compile time
    note = M.late_agreement(step, runners)
    assert "inductor_cute nan/nan" in note and "MISMATCH: inductor_cute gave non-finite logits" in note
    assert runners["inductor_cute"] is None
