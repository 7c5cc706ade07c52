"""The flex_backward benchmark suite without a GPU: issue 15's cases and names, the flops of a
training step, the fp32 reference against flex_attention and dense attention's autograd, our runner's
arguments and its reasons for declining, SDPA's step; and the harness's check of tuple outputs."""

import dataclasses
import functools

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from inductor_cute.bench import harness
from inductor_cute.bench.case import Case
from inductor_cute.bench.suites import SUITES
from inductor_cute.bench.suites import flex_backward as fb
from inductor_cute.bench.suites import flex_prefill as fp

ISSUE_15 = ["llama B4 H32/8 S4096 causal", "llama B2 H32/8 S16384 noncausal", "dsv2-lite B1 H16 S8192 causal",
            "doc-causal B1 H32 S16384", "sliding1024 B4 H32/8 S8192", "softcap50 B2 H16/8 S8192 causal"]


def test_registered():
    assert SUITES["flex_backward"] is fb


@pytest.mark.parametrize("quick", [True, False])
def test_cases_are_the_issues_named_factories(quick):
    factories = fb.cases(quick)
    assert all(isinstance(f, functools.partial) for f in factories)
    names = [f.case_name for f in factories]
    assert names == [f.args[0].name for f in factories]
    assert names == (["llama B4 H32/8 S4096 causal", "doc-causal B1 H32 S16384"] if quick else ISSUE_15)


def test_shapes_of_the_issue():
    shapes = {p.name: (p.b, p.hq, p.hkv, p.s, p.dqk, p.dv, p.variant) for p in fb.CASES}
    assert shapes == {
        "llama B4 H32/8 S4096 causal": (4, 32, 8, 4096, 128, 128, "causal"),
        "llama B2 H32/8 S16384 noncausal": (2, 32, 8, 16384, 128, 128, "noncausal"),
        "dsv2-lite B1 H16 S8192 causal": (1, 16, 16, 8192, 192, 128, "causal"),
        "doc-causal B1 H32 S16384": (1, 32, 32, 16384, 128, 128, "document"),
        "sliding1024 B4 H32/8 S8192": (4, 32, 8, 8192, 128, 128, "sliding"),
        "softcap50 B2 H16/8 S8192 causal": (2, 16, 8, 8192, 256, 256, "softcap"),
    }


def test_flops_are_forward_plus_backward_over_the_kept_pairs():
    llama = fb.CASES[0]
    kept = 4096 * 4097 // 2
    flops, n_bytes = fb.cost(llama, kept)
    dense = 2 * 4 * 32 * 4096 * 4096
    assert flops == dense * (3 * 128 + 2 * 128) * kept / 4096 ** 2 + dense * (128 + 128) * kept / 4096 ** 2
    assert flops == 2 * 4 * 32 * kept * (4 * 128 + 3 * 128)
    qkvo = 2 * 4 * (32 * 4096 * 256 + 8 * 4096 * 256)
    grads = 2 * 4 * (32 * 4096 * 128 + 8 * 4096 * 256)
    assert n_bytes == 2 * qkvo + 2 * 4 * 4 * 32 * 4096 + 2 * 4 * 32 * 4096 * 128 + grads
    dsv2 = fb.CASES[2]  # Dqk != Dv: the backward's products weigh Dqk three times, Dv twice
    assert fb.cost(dsv2, 100)[0] == 2 * 16 * 100 * ((192 + 128) + (3 * 192 + 2 * 128))
    assert "3*Dqk+2*Dv" in fb.FLOPS_NOTE and "kept fraction" in fb.FLOPS_NOTE


TINY = {v: fp.Prefill(f"tiny {v}", 2, 4, 2, 300, 24, 16, v) for v in ("causal", "noncausal", "document", "sliding",
                                                                       "softcap")}


def dense_attention(q, k, v, scale, mods):
    """Unchunked attention over the whole (B, Hq, Lq, Lkv) scores, KV heads repeated for GQA: the
    mods applied as flex_attention applies them (flex_attention has no backward on CPU)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    idx = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in enumerate(s.shape)]
    if mods.score_mod is not None:
        s = mods.score_mod(s, *idx)
    if mods.mask_mod is not None:
        s = s.masked_fill(~mods.mask_mod(*idx), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("variant", list(TINY))
def test_reference_is_autograd_of_the_flex_attention(variant, monkeypatch):
    """The chunked fp32 reference's out is flex_attention's with the stock runner's arguments and
    its gradients are autograd's through dense attention: GQA (dk, dv summed over a KV head's
    query heads), Dqk != Dv, every mod of the suite (softcap's score_mod gradient too), several
    query chunks. SDPA's training step computes the same where it runs."""
    monkeypatch.setattr(fp, "WINDOW", 64)
    p = TINY[variant]
    mods = fp.mods_of(p, device="cpu")
    kept = fp.kept_pairs(mods.mask_mod, p.s, p.s)
    q, k, v, grad_out = fb.make_inputs(p, kept, device="cpu", dtype=torch.float32)
    assert all(t.requires_grad for t in (q, k, v)) and grad_out.shape == (2, 4, 300, 16)
    scale = p.dqk ** -0.5
    got = fb.reference(q, k, v, grad_out, scale, mods, max_scores=2 * p.s * 70)
    assert [t.dtype for t in got] == [torch.float32] * 4
    assert [t.shape for t in got] == [(2, 4, 300, 16), (2, 4, 300, 24), (2, 2, 300, 24), (2, 2, 300, 16)]
    block_mask = fp.block_mask_of(p, mods, device="cpu")
    flex = fb._flex(scale, fp.flex_kwargs(mods, block_mask))(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(got[0], flex, atol=1e-5, rtol=1e-5)
    expected = fb.autograd_step(lambda q, k, v: dense_attention(q, k, v, scale, mods), q, k, v, grad_out)()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    sdpa = fb.sdpa_runner(p, q, k, v, grad_out, scale)
    if variant in ("causal", "noncausal"):
        for a, b in zip(sdpa(), expected):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    else:
        assert sdpa is None


@pytest.mark.parametrize("p", fb.CASES, ids=lambda p: p.name)
def test_our_runner_declines_what_the_backward_cannot_run_with_its_reason(p):
    # 192/128 (DeepSeek) and score_mods are taken by the eager entry; head dims 256/256 are not
    mods = fp.mods_of(dataclasses.replace(p, s=256), device="cpu")
    reason = fb.ours_reason(p, mods)
    if p.name.startswith("softcap"):  # its score_mod is taken; its head dims are not
        assert "256/256" in reason and "not supported by the backward" in reason and "score_mod" not in reason
    else:
        assert reason is None
        return
    q = torch.zeros(1, 1, 1, p.dqk)  # declined before any tensor is looked at: no GPU needed
    runner, note = fb.ours_runner(p, mods, q, q, q, q, 1.0, None)
    assert runner is None and note == f"inductor_cute omitted: {reason}"


def test_backward_arguments_carry_both_list_sets_and_the_program():
    p = dataclasses.replace(TINY["document"], s=700)
    mods = fp.mods_of(p, device="cpu")
    bm = fp.block_mask_of(p, mods, device="cpu")
    kw = fb.backward_kwargs(mods, bm)
    assert kw["mask_mod"] == fp.DOCUMENT_CAUSAL_PROGRAM and kw["mask_tensors"] is mods.mask_tensors
    assert kw["kv_indices"] is bm.kv_indices and kw["full_kv_num_blocks"] is bm.full_kv_num_blocks
    assert kw["q_indices"] is bm.q_indices and kw["full_q_indices"] is bm.full_q_indices
    assert (kw["kv_block_size"], kw["q_block_size"]) == (128, 128)
    assert kw["score_mod"] is None and kw["score_tensors"] == ()
    plain = fb.backward_kwargs(fp.mods_of(TINY["noncausal"], device="cpu"), None)
    assert plain == {"score_mod": None, "score_tensors": (), "mask_mod": None, "mask_tensors": ()}
    softcap = fp.mods_of(fb.CASES[-1], device="cpu")
    assert fb.CASES[-1].name.startswith("softcap") and softcap.score_program
    assert fb.backward_kwargs(softcap, None)["score_mod"] == softcap.score_program


def _check_case():
    return Case("c", {}, 0, 0, runners={}, atol=2e-2, rtol=2e-2, atol_of_max=True)


@pytest.mark.parametrize("variant", ["causal", "document", "sliding"])
def test_the_check_catches_a_wrong_mask_and_passes_bf16_gradients(variant, monkeypatch):
    """atol 2e-2 of each tensor's largest magnitude: every gradient rounded to bf16 passes, while
    gradients of a kernel that ignored the mask (attended to every key) miss."""
    p = fp.Prefill(variant, 1, 4, 2, 1024, 64, 64, variant)
    mods = fp.mods_of(p, device="cpu")
    q, k, v, grad_out = fb.make_inputs(p, fp.kept_pairs(mods.mask_mod, p.s, p.s), device="cpu")
    scale = p.dqk ** -0.5
    exact = fb.reference(q, k, v, grad_out, scale, mods)
    assert harness._check(_check_case(), {"inductor_cute": tuple(t.bfloat16() for t in exact)}, exact) == []
    unmasked = fb.reference(q, k, v, grad_out, scale, fp.Mods())
    bad = dict(harness._check(_check_case(), {"triton": unmasked}, exact))
    assert "differs from the reference" in bad["triton"]
    # the forward output alone would be caught too; each gradient is checked on its own
    for i in range(1, 4):
        mixed = tuple(unmasked[j] if j == i else exact[j] for j in range(4))
        assert f"output #{i} differs" in dict(harness._check(_check_case(), {"flash": mixed}, exact))["flash"]


def test_harness_compares_tuple_outputs_one_by_one():
    ref = (torch.ones(4, 4), torch.full((2, 3), 1e-3))
    case = Case("c", {}, 0, 0, runners={})
    outputs = {"inductor_cute": (ref[0] + 1e-3, ref[1] * 10), "aten": ref[:1], "flash": (ref[0], torch.ones(3, 2)),
               "triton": tuple(t.clone() for t in ref)}
    bad = dict(harness._check(case, outputs, ref))
    # an absolute atol of 2e-2 passes a gradient 10x off at 1e-3 scale; relative to its max it fails
    assert set(bad) == {"aten", "flash"}
    assert "returned 1 outputs" in bad["aten"] and "#1 has shape" in bad["flash"]
    scaled = dict(harness._check(dataclasses.replace(case, atol_of_max=True), outputs, ref))
    assert set(scaled) == {"inductor_cute", "aten", "flash"} and "#1 differs" in scaled["inductor_cute"]


def test_stock_and_flash_runners_decline_with_the_reason_where_they_cannot_run():
    """Here (CPU: flex_attention has no backward) both compiled runners come back None with why,
    and the case keeps its other runners; on the GPU machine flash does so without flash-attn-4."""
    torch._dynamo.reset()
    p = TINY["causal"]
    mods = fp.mods_of(p, device="cpu")
    q, k, v, grad_out = fb.make_inputs(p, fp.kept_pairs(mods.mask_mod, p.s, p.s), device="cpu")
    kw = fp.flex_kwargs(mods, fp.block_mask_of(p, mods, device="cpu"))
    stock, stock_note = fb.stock_runner(q, k, v, grad_out, 0.2, kw)
    assert stock is None and stock_note.startswith("triton omitted: default failed: ")
    assert "max-autotune-no-cudagraphs failed: " in stock_note
    flash, flash_note = fb.flash_runner(q, k, v, grad_out, 0.2, kw)
    assert flash is None and flash_note.startswith("flash omitted: ")
