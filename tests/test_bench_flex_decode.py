"""The flex_decode benchmark suite without a GPU: registry and CLI, case factories, the HBM bounds
of DESIGN.md from the flops/bytes formulas, and the references' semantics against flex_attention
(eager, on the CPU, tiny sizes)."""

import functools

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from inductor_cute.bench.suites import SUITES
from inductor_cute.bench.suites import flex_decode as fd


def test_registered_and_listed_by_the_cli(capsys):
    from inductor_cute.__main__ import main

    assert SUITES["flex_decode"] is fd
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    assert "flex_decode" in capsys.readouterr().out


@pytest.mark.parametrize("quick", [True, False])
def test_cases_are_factories(quick):
    factories = fd.cases(quick)
    assert all(isinstance(f, functools.partial) and callable(f) for f in factories)
    pairs = [f.args for f in factories]
    if quick:
        assert pairs == [(s, "plain") for s in fd.SHAPES[:3]]
    else:
        assert len(pairs) == len(fd.SHAPES) * 3 and {v for _, v in pairs} == set(fd.VARIANTS)
    names = [fd.case_name(*p) for p in pairs]
    assert len(set(names)) == len(names)


def test_shapes_of_the_issue():
    labels = [s.label for s in fd.SHAPES]
    assert labels == ["B8 Hq64 Hkv8 d128 KV8192", "B4 Hq48 Hkv8 d128 KV32768", "B64 Hq64 Hkv8 d128 KV4096",
                      "B1 Hq64 Hkv8 d128 KV131072", "B8 Hq128 Hkv1 192/128 KV8192",
                      "B8 Hq128 Hkv1 576/512 KV8192 v=k view"]
    assert all(s.lq == 1 for s in fd.SHAPES)


@pytest.mark.parametrize("index, bound_us", [(0, 62), (1, 125), (2, 250), (3, 125), (4, 10)])
def test_hbm_bounds_match_design(index, bound_us):
    """K and V bytes / 4.3 TB/s, as DESIGN.md's decoding table quotes them (q and out add < 0.2%)."""
    assert fd.hbm_bound_us(fd.SHAPES[index]) == pytest.approx(bound_us, rel=0.03)


def test_flops_and_bytes():
    s = fd.SHAPES[0]
    flops, n_bytes = fd.cost(s)
    assert flops == 2 * 8 * 64 * 1 * 8192 * (128 + 128)
    assert n_bytes == 2 * (2 * 8 * 8 * 8192 * 128 + 2 * 8 * 64 * 128)
    # the window's keys only
    flops_w, bytes_w = fd.cost(s, "sliding")
    assert flops_w == flops * fd.WINDOW // 8192
    assert bytes_w == 2 * (2 * 8 * 8 * fd.WINDOW * 128 + 2 * 8 * 64 * 128)
    assert fd.cost(s, "softcap") == (flops, n_bytes)
    # absorbed MLA: V is the first 512 columns of the 576-wide latent cache, read once
    mla = fd.SHAPES[5]
    assert fd.cost(mla)[1] == 2 * (8 * 1 * 8192 * 576 + 8 * 128 * (576 + 512))
    assert fd.hbm_bound_us(mla) == pytest.approx(18.1, rel=0.01)  # 17.6 us of cache + 128 heads of q and out


TINY = [fd.Shape(2, 4, 2, 16, 16, 300), fd.Shape(2, 8, 1, 24, 16, 300), fd.Shape(1, 4, 1, 24, 16, 300, v_view=True),
        fd.Shape(2, 4, 2, 16, 16, 300, lq=3)]


@pytest.mark.parametrize("variant", fd.VARIANTS)
@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.label)
def test_references_match_flex_attention(shape, variant, monkeypatch):
    """The aten runner (SDPA with a dense window mask, or the softcap math) computes what the triton
    runner's flex_attention arguments ask for: GQA, Dqk != Dv, v a view of k, the query at the end."""
    monkeypatch.setattr(fd, "WINDOW", 64)
    q, k, v = fd.make_inputs(shape, variant, device="cpu", dtype=torch.float32)
    if shape.v_view:
        assert v.data_ptr() == k.data_ptr() and v.shape[-1] == shape.dv
    scale = shape.dqk ** -0.5
    ref = flex_attention(q, k, v, scale=scale, enable_gqa=True, **fd.flex_mods(shape, variant, device="cpu"))
    out = fd.aten_runner(shape, variant, q, k, v, scale)()
    assert out.shape == (shape.b, shape.hq, shape.lq, shape.dv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bf16_outputs_are_large_enough_for_the_tolerance_to_mean_something():
    """With the suite's inputs a reference that ignores the score_mod or the mask misses by more
    than the 2e-2 tolerance, while the bf16 runners stay within it of the fp32 answer."""
    shape = fd.Shape(1, 8, 2, 128, 128, 4096)
    scale = shape.dqk ** -0.5
    for variant in ("sliding", "softcap"):
        q, k, v = fd.make_inputs(shape, variant, device="cpu")
        out = fd.aten_runner(shape, variant, q, k, v, scale)()
        assert out.dtype == torch.bfloat16 and out.shape == (1, 8, 1, 128)
        exact = flex_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=True,
                               **fd.flex_mods(shape, variant, device="cpu"))
        assert torch.allclose(out.float(), exact, atol=2e-2, rtol=2e-2)
        plain = fd.aten_runner(shape, "plain", q, k, v, scale)()
        assert not torch.allclose(plain.float(), exact, atol=2e-2, rtol=2e-2)


def test_softcap_program_is_the_softcap_score_mod():
    """Our runner's score program computes what the triton runner's score_mod does."""
    from inductor_cute.kernels.common.programs import score as sp

    score = torch.randn(2, 4, 3, 50) * 40
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate(score.shape)]
    torch.testing.assert_close(sp.reference(fd.softcap_program(), score, *idx), fd.softcap()(score, *idx))


@pytest.mark.parametrize("q_len", [1, 3])
def test_sliding_window_program_is_the_sliding_window_mask_mod(q_len):
    """Our runner's mask program keeps the keys the triton runner's mask_mod keeps."""
    from inductor_cute.kernels.common.programs import score as sp

    shape = (2, 4, q_len, 3000)
    idx = [torch.arange(n, dtype=torch.int32).view([-1 if i == d else 1 for i in range(4)])
           for d, n in enumerate(shape)]
    keep = sp.reference_mask(fd.sliding_window_program(3000, q_len), *idx)
    assert torch.equal(keep, fd.sliding_window(3000, q_len)(*idx).expand(shape))


@pytest.mark.parametrize("shape", TINY, ids=lambda s: s.label)
def test_the_model_mask_sees_the_whole_cache_and_keeps_128_key_blocks(shape):
    """The stock baseline's causal cache BlockMask (what a model passes for a decoding query at the
    end of its cache) computes plain attention, with block size 128 rather than one 2^30-key block."""
    q, k, v = fd.make_inputs(shape, "plain", device="cpu", dtype=torch.float32)
    scale = shape.dqk ** -0.5
    mods = fd.flex_mods(shape, "plain", device="cpu", model_mask=True)
    if shape.lq > 1:  # a causal mask would change what the plain variant computes
        assert "block_mask" not in mods
        return
    assert mods["block_mask"].BLOCK_SIZE == (128, 128)
    out = flex_attention(q, k, v, scale=scale, enable_gqa=True, **mods)
    torch.testing.assert_close(out, fd.aten_runner(shape, "plain", q, k, v, scale)(), atol=1e-5, rtol=1e-5)
    assert "block_mask" not in fd.flex_mods(shape, "plain", device="cpu")
