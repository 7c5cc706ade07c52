"""enable(trace_block_masks=True): create_block_mask(..., _compile=True) called in compiled code
(transformers builds every step's BlockMask that way) is traced into the graph instead of breaking
it at the flag's deprecation warning; off, and after disable(), Dynamo does what it does stock."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import inductor_cute
from inductor_cute.inductor import block_masks


def attend(q, k, v, offset, positional=False):
    """A decode step's attention as transformers writes it: a mask_mod capturing a 0-d offset."""
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    if positional:
        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], "cpu", 128, True)
    else:
        block_mask = create_block_mask(mask_mod=mask_mod, B=q.shape[0], H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2],
                                       device="cpu", _compile=True)
    return flex_attention(q, k, v, block_mask=block_mask)


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (1, 300, 300))
    return q, k, v, torch.tensor(250)


def reference(q, k, v, offset):
    """fp64 attention over keys 0..offset (the query sits at position offset)."""
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    s[..., int(offset) + 1:] = float("-inf")
    return torch.softmax(s, -1) @ v.double()


def graphs_of(fn, *args, **kwargs):
    """(result, graphs Dynamo made) for fn compiled from scratch with a counting backend."""
    torch._dynamo.reset()
    counter = CompileCounter()
    out = torch.compile(fn, backend=counter)(*args, **kwargs)
    return out, counter.frame_count


def test_arguments_after_a_positional_compile_flag_are_kept(inputs):
    """torch 2.13 has parameters after `_compile`: one passed positionally after it must arrive."""
    import inspect

    params = list(inspect.signature(create_block_mask).parameters)
    if params[-1] == "_compile" or params[params.index("_compile") + 1] != "separate_full_blocks":
        pytest.skip("this torch has no separate_full_blocks right after _compile")

    def masks(q, k):
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        block_mask = create_block_mask(mask_mod, 1, None, 64, 256, "cpu", 128, True, False)
        return block_mask.kv_num_blocks, block_mask.full_kv_num_blocks

    with inductor_cute.enable(trace_block_masks=True):
        (kv_num_blocks, full), graphs = graphs_of(masks, *inputs[:2])
    assert graphs == 1 and full is None  # separate_full_blocks=False: every block is partial
    torch.testing.assert_close(kv_num_blocks, torch.tensor([[[1]]], dtype=torch.int32))


@pytest.mark.parametrize("positional", [False, True])
def test_a_block_mask_built_in_compiled_code_stays_in_the_graph(inputs, positional):
    with inductor_cute.enable(trace_block_masks=True):
        out, graphs = graphs_of(attend, *inputs, positional=positional)
    assert graphs == 1
    torch.testing.assert_close(out.double(), reference(*inputs), atol=1e-5, rtol=1e-5)


STOCK_GRAPHS = """
import torch
from torch._dynamo.testing import CompileCounter
import test_block_masks as t
q, k, v = (torch.randn(2, 4, n, 64) for n in (1, 300, 300))
counter = CompileCounter()
torch.compile(t.attend, backend=counter)(q, k, v, torch.tensor(250))
print(counter.frame_count)
"""


def stock_graphs() -> int:
    """The graphs of `attend` in a process where inductor-cute never registered its polyfill."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", STOCK_GRAPHS], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout
    return int(out.split()[-1])


def test_off_and_after_disable_the_graph_breaks_as_stock(inputs):
    stock = stock_graphs()
    assert stock > 1  # the deprecation warning: what the switch is for (torch >= 2.10)
    with inductor_cute.enable(trace_block_masks=False):
        _, off = graphs_of(attend, *inputs)
    with inductor_cute.enable():  # on by default
        pass
    out, after = graphs_of(attend, *inputs)
    assert off == after == stock and not block_masks.installed()
    torch.testing.assert_close(out.double(), reference(*inputs), atol=1e-5, rtol=1e-5)


def test_a_graph_traced_with_it_is_not_recompiled_after_disable(inputs):
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(attend, backend=counter)
    with inductor_cute.enable(trace_block_masks=True):
        fn(*inputs)
    q, k, v, offset = inputs
    out = fn(q, k, v, torch.tensor(200))  # another offset: a tensor, so no guard on its value either
    assert counter.frame_count == 1
    torch.testing.assert_close(out.double(), reference(q, k, v, torch.tensor(200)), atol=1e-5, rtol=1e-5)


def test_nested_enable_keeps_the_outer_setting(inputs):
    with inductor_cute.enable():
        with inductor_cute.enable(trace_block_masks=False):
            assert not block_masks.installed()
        assert block_masks.installed()
        _, graphs = graphs_of(attend, *inputs)
    assert graphs == 1 and not block_masks.installed()


def test_prefill_sized_masks_keep_the_stock_path(inputs):
    # only decode-sized masks (Q_LEN <= 64) are traced: a prefill step's mask is built as stock
    # builds it (graph break, its own compiled create_block_mask) until the fix for the traced
    # prefill mask's disagreement on the GPU (packed strides, below) is checked there (block_masks.py)
    q, k, v, _ = inputs
    q_long = torch.randn(2, 4, 300, 64)
    with inductor_cute.enable(trace_block_masks=True):
        out, graphs = graphs_of(attend, q_long, k, v, torch.tensor(0))
        _, decode_graphs = graphs_of(attend, q, k, v, torch.tensor(250))
    assert graphs == stock_graphs() > 1 and decode_graphs == 1
    s = (q_long.double() @ k.double().transpose(-1, -2)) / 8.0
    keep = torch.arange(300)[:, None] >= torch.arange(300)[None, :]
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_traced_mask_tensors_reach_flex_attention_at_packed_strides(monkeypatch):
    # Stock Inductor's Triton flex templates find batch z's mask rows at (z * H + h) * stride(1);
    # traced into the graph, a (4, 1, 8, 8) kv_indices was laid out at strides (64, 256, 8, 1)
    # (contiguous to torch: size-1 dims are ignored), so on the GPU every batch past the first read
    # the wrong blocks. The polyfill views each mask tensor at packed strides: what the flex
    # lowering gets, recorded here, must be packed. Traced at a prefill length (the check raises
    # the decode-only limit, as benchmarks/traced_mask_check.py does); the CPU kernel reads all strides.
    from inductor_cute.inductor.flex import lowering

    seen, real = [], lowering._problem

    def stride(t):  # None where the layout is not fixed yet: the stock lowering would pick it
        try:
            return tuple(int(s) for s in t.get_stride())
        except NotImplementedError:
            return None

    def spy(query, key, value, subgraph, block_mask, *rest):
        for t in lowering._block_mask_fields(block_mask)[:4]:
            if t is not None:
                seen.append((tuple(int(s) for s in t.get_size()), stride(t)))
        return real(query, key, value, subgraph, block_mask, *rest)

    monkeypatch.setattr(lowering, "_problem", spy)
    monkeypatch.setattr(block_masks, "MAX_TRACED_Q_LEN", 1 << 30)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 1024, 64, generator=g) for _ in range(3))
    keep = torch.ones(4, 1024, dtype=torch.bool)
    keep[1:, 900:] = False  # batches differ: reading another batch's blocks changes the result

    def attend_padded(q, k, v, keep):
        def mask_mod(b, h, m, n):
            return (m >= n) & keep[b, n]

        block_mask = create_block_mask(mask_mod, 4, None, 1024, 1024, device="cpu", _compile=True)
        return flex_attention(q, k, v, block_mask=block_mask)

    no_cache = torch._inductor.config.patch(force_disable_caches=True)  # a cached graph skips the lowering
    with inductor_cute.enable(trace_block_masks=True), torch.no_grad(), no_cache:
        out, graphs = graphs_of(attend_padded, q, k, v, keep)  # the counting backend: no lowering yet
        torch._dynamo.reset()
        out = torch.compile(attend_padded)(q, k, v, keep)
    assert graphs == 1
    assert seen and any(1 in size for size, _ in seen)
    assert all(stride == block_masks.packed_strides(size) for size, stride in seen), seen
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    allowed = (torch.arange(1024)[:, None] >= torch.arange(1024)[None, :]) & keep[:, None, None, :]
    ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_packed_strides_keep_every_mask_tensors_values():
    # eagerly (what Dynamo traces): a contiguous tensor whose size-1 dim has another stride, and a
    # transposed one, keep their values; every tensor of the mask comes back at packed strides
    mask = create_block_mask(lambda b, h, m, n: m >= n, 2, None, 256, 384, device="cpu")
    odd = torch.arange(2 * 2 * 3, dtype=torch.int32).view(2, 2, 3).as_strided((2, 1, 2, 3), (6, 99, 3, 1))
    mask.kv_indices = odd
    mask.q_indices = torch.arange(2 * 3 * 2, dtype=torch.int32).view(2, 1, 3, 2).transpose(-1, -2)
    expected = {name: getattr(mask, name).clone() for name in ("kv_num_blocks", "kv_indices", "q_indices")}
    packed = block_masks.with_packed_strides(mask)
    for name, values in expected.items():
        t = getattr(packed, name)
        assert torch.equal(t, values) and t.stride() == block_masks.packed_strides(t.shape), name
    assert block_masks.packed_strides((2, 1, 2, 3)) == (6, 6, 3, 1)


FAST_ALL_LATE = """
import sys
import torch
import inductor_cute
from torch._dynamo.trace_rules import _polyfilled_function_ids
with inductor_cute.enable():
    torch._dynamo.reset()  # clears Dynamo's callbacks: registration must not depend on them
    assert "transformers.masking_utils" not in sys.modules
    from transformers import masking_utils
    print(id(masking_utils.fast_all) in _polyfilled_function_ids)
"""


def test_transformers_imported_after_enable_still_gets_the_padding_check_traced():
    # transformers' fast_all (its all-ones check of a 2-D attention mask) is polyfilled as soon as
    # masking_utils is imported while enabled, not only when it was imported before enable()
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", FAST_ALL_LATE], capture_output=True, text=True,
                         env=dict(os.environ), timeout=300, check=True).stdout
    assert out.split()[-1] == "True"


def test_a_padding_mask_padded_in_the_graph_reaches_the_stock_lowering_realized(monkeypatch):
    # transformers pads its 2-D attention mask to the cache length (constant_pad_nd). Traced, the
    # BlockMask no longer breaks the graph before flex_attention, so the pad is in its graph; the
    # stock lowering builds the mask_mod's subgraph before it realizes captured tensors, and
    # Triton's template code cannot inline the pad (the GPU crashed on Phi-3's padded decode).
    # With only the tracing on, our flex lowering is installed to realize them first.
    from torch._inductor import ir

    from inductor_cute.inductor import hooks

    seen, real = [], hooks.stock_lowering

    def spy(op):
        stock = real(op)

        def lowering(*args):
            seen.extend(ir.is_storage_and_layout(b) for b in args[-1])
            return stock(*args)
        return lowering

    monkeypatch.setattr(hooks, "stock_lowering", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 64, generator=g) for n in (1, 300, 300))
    attention_mask = torch.ones(2, 260, dtype=torch.bool)
    attention_mask[0, :30] = False  # left padding

    def attend_padded(q, k, v, attention_mask):
        keep = torch.nn.functional.pad(attention_mask, (0, k.shape[2] - attention_mask.shape[1]))

        def mask_mod(b, h, m, n):
            return (n <= 259) & keep[b, n]

        block_mask = create_block_mask(mask_mod, 2, None, 1, 300, device="cpu", _compile=True)
        return flex_attention(q, k, v, block_mask=block_mask)

    no_cache = torch._inductor.config.patch(force_disable_caches=True)
    with inductor_cute.enable(flex_decode=False), torch.no_grad(), no_cache:
        torch._dynamo.reset()
        out = torch.compile(attend_padded)(q, k, v, attention_mask)
    assert seen == [True]
    s = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    allowed = (torch.arange(300) <= 259) & torch.nn.functional.pad(attention_mask, (0, 40))[:, None, None, :]
    ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
