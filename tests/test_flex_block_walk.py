"""BlockMasks of finer blocks than the prefill kernel's, on the CPU: the lists coarsened to the
kernel's 128 x 128 blocks (host/flex_blocks.py) with the fine blocks' states read by one more mask
program term (kernels/attention/block_states.py) keep exactly the keys the fine mask keeps, by the
stock kernels' rule (full blocks keep every key, partial ones ask the mask_mod, the rest none),
whatever the lists hold: random lists, lists inconsistent with the mask_mod, no mask_mod, no full
lists, a mask of one batch or head, lengths off the blocks. GPU runs: test_flex_prefill_gpu.py."""

import pytest
import torch

from inductor_cute.errors import UnsupportedError
from inductor_cute.host import flex_prefill as host_prefill
from inductor_cute.host.flex_blocks import _as_lists, as_lists, coarse_maps, fine_states
from inductor_cute.kernels.attention.block_states import FULL, PARTIAL, with_block_states
from inductor_cute.kernels.attention.flex_prefill_config import block_mask_reason, block_walk
from inductor_cute.kernels.common.programs import score as sp

CAUSAL = '[["c","ge","q","kv"]]'
# a document mask reading the ids as t0; one step is named like the added term's, which must step aside
DOCUMENT = ('[["a","load","t0","q"],["blk","load","t0","kv"],["c","eq","a","blk"],["d","ge","q","kv"],'
            '["e","and","c","d"]]')


def random_lists(z, h, q_blocks, kv_blocks, with_full: bool, seed: int, width=None):
    """Random (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), a block's state drawn
    from skipped / partial / full, the lists `width` wide (the block count by default; torch allows
    narrower ones) with whatever argsort leaves past each count."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randint(0, 3 if with_full else 2, (z, h, q_blocks, kv_blocks), generator=g)
    if width is not None and width < kv_blocks:
        states[..., width:] = 0  # nothing a narrower list could name
    num, idx = _as_lists(states == PARTIAL)
    full_num, full_idx = _as_lists(states == FULL) if with_full else (None, None)
    if width is not None:
        idx, full_idx = idx[..., :width], None if full_idx is None else full_idx[..., :width]
    return num, idx, full_num, full_idx


def walked(fine, shape, q_block, kv_block, mask_text="", tensors=()):
    """What the host hands the kernel for this fine mask: (lists, program, tensors, KV block, query block)."""
    return host_prefill._walked_block_mask(fine, mask_text or None, tensors, kv_block, q_block, 128, shape,
                                           torch.device("cpu"))


def kept(shape, mask_text, tensors, block_mask, kv_block, q_block):
    return sp.reference_keep(shape, mask_text, tensors, block_mask, kv_block, q_block)


CASES = {  # (z, h) of the mask, batch, heads, q_len, kv_len, (q block, kv block), mask program, with full lists
    "64x64 causal full lists": ((2, 3), 2, 3, 300, 300, (64, 64), CAUSAL, True),
    "64x64 no mask_mod": ((2, 3), 2, 3, 300, 500, (64, 64), "", True),
    "64x64 no full lists": ((1, 3), 2, 3, 257, 333, (64, 64), CAUSAL, False),
    "32x64 one mask head": ((2, 1), 2, 4, 200, 260, (32, 64), CAUSAL, True),
    "64x128 document, one batch": ((1, 2), 3, 2, 390, 390, (64, 128), DOCUMENT, True),
    "128x64 kv only": ((2, 2), 2, 2, 300, 400, (128, 64), "", False),
    "16x32": ((1, 1), 1, 1, 100, 150, (16, 32), CAUSAL, True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_coarsened_lists_and_the_states_term_keep_what_the_fine_mask_keeps(case):
    (z, h), batch, heads, q_len, kv_len, (q_block, kv_block), mask_text, with_full = case
    ids = (torch.arange(max(q_len, kv_len)) // 97).to(torch.int32)
    tensors = (ids,) if "t0" in mask_text else ()
    fine = random_lists(z, h, -(-q_len // q_block), -(-kv_len // kv_block), with_full, seed=q_len + kv_len)
    shape = (batch, heads, q_len, kv_len)
    lists, program, walked_tensors, kv_walk, q_walk = walked(fine, shape, q_block, kv_block, mask_text, tensors)
    assert (kv_walk, q_walk) == (max(kv_block, 128), max(q_block, 128))
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in walked_tensors)
    assert sp.canonical(program, dtypes, mask=True) == program
    want = kept(shape, mask_text, tensors, fine, kv_block, q_block)
    got = kept(shape, program, walked_tensors, lists, kv_walk, q_walk)
    assert torch.equal(got, want)
    assert 0 < int(want.sum()) < want.numel()  # the case keeps some keys and drops others


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_backward_walks_both_list_sets_at_its_blocks(case):
    """The backward's walk (host/flex_backward.walked_block_masks): the forward lists coarsened to
    128 x 128 with the states term keep what the fine mask keeps, and the backward lists it makes
    name the same coarse blocks, transposed (the dK/dV kernel walks those), whatever backward
    lists came with the mask."""
    from inductor_cute.host.flex_backward import walked_block_masks

    (z, h), batch, heads, q_len, kv_len, (q_block, kv_block), mask_text, with_full = case
    ids = (torch.arange(max(q_len, kv_len)) // 97).to(torch.int32)
    tensors = (ids,) if "t0" in mask_text else ()
    fine = random_lists(z, h, -(-q_len // q_block), -(-kv_len // kv_block), with_full, seed=q_len + kv_len)
    shape = (batch, heads, q_len, kv_len)
    forward, backward, program, walked_tensors, kv_walk, q_walk = walked_block_masks(
        fine, (None,) * 4, mask_text or None, tensors, kv_block, q_block, shape, torch.device("cpu"))
    assert (kv_walk, q_walk) == (max(kv_block, 128), max(q_block, 128))
    assert torch.equal(kept(shape, program, walked_tensors, forward, kv_walk, q_walk),
                       kept(shape, mask_text, tensors, fine, kv_block, q_block))
    assert_backward_lists_transpose_forward(shape, forward, backward, kv_walk, q_walk)


def full_only(lists):
    """The lists with their partial blocks dropped: what they mark full."""
    num, idx, full_num, full_idx = lists
    return torch.zeros_like(num), idx, full_num, full_idx


def assert_backward_lists_transpose_forward(shape, forward, backward, kv_block, q_block):
    """The backward lists name the forward's blocks, transposed, each as full or partial as there
    (a block full in one and partial in the other would skip the mask program in one kernel only)."""
    batch, heads, q_len, kv_len = shape
    for pick in (lambda lists: lists, full_only):
        visited = kept(shape, "", (), pick(forward), kv_block, q_block)
        visited_t = kept((batch, heads, kv_len, q_len), "", (), pick(backward), q_block, kv_block)
        assert torch.equal(visited, visited_t.transpose(-1, -2))


def test_the_backward_walk_and_its_limits():
    from inductor_cute.host.flex_backward import walked_block_masks
    from inductor_cute.kernels.attention import flex_backward_config as fbc

    assert fbc.block_walk(64, 64) == (128, 128) and fbc.block_walk(256, 32) == (256, 128)
    assert fbc.block_walk(128, 256) == (128, 256) and fbc.block_walk(96, 128) is None
    assert fbc.block_mask_reason(64, 128, 3) is None and "all 4" in fbc.block_mask_reason(64, 128, 4)
    assert fbc.block_mask_reason(128, 128, 4) is None  # no walk, no tensor taken
    assert "96" in fbc.block_mask_reason(96, 128, 0)
    fine = random_lists(1, 1, 4, 4, True, seed=3)
    given = walked_block_masks(fine, fine, CAUSAL, (), 128, 128, (1, 1, 512, 512), torch.device("cpu"))
    assert given == (fine, fine, CAUSAL, (), 128, 128)  # the kernels' own blocks: as given
    four = tuple(torch.zeros(8, dtype=torch.int32) for _ in range(4))
    with pytest.raises(UnsupportedError, match="all 4"):
        walked_block_masks(fine, fine, CAUSAL, four, 64, 64, (1, 1, 256, 256), torch.device("cpu"))


@pytest.mark.parametrize("width", [2, 9])
def test_lists_narrower_or_wider_than_the_blocks(width):
    """torch lets a BlockMask's lists be narrower than its KV blocks (from_kv_blocks with explicit
    lengths): blocks past the lists are never kept. Wider lists' extra entries and entries naming
    no block count for nothing."""
    fine = random_lists(1, 2, 5, 6, True, seed=width, width=min(width, 6))
    if width > 6:  # wider, each row's count one more, its last entry naming no block (7, then -1)
        num, idx, full_num, full_idx = fine
        idx = torch.cat([idx, torch.full((1, 2, 5, 3), 7, dtype=torch.int32)], -1)
        full_idx = torch.cat([full_idx, torch.full((1, 2, 5, 3), -1, dtype=torch.int32)], -1)
        idx.scatter_(-1, num.long().unsqueeze(-1), 7)
        full_idx.scatter_(-1, full_num.long().unsqueeze(-1), -1)
        fine = (num + 1, idx, full_num + 1, full_idx)
    shape = (1, 2, 300, 380)
    lists, program, tensors, kv_walk, q_walk = walked(fine, shape, 64, 64, CAUSAL)
    want = kept(shape, CAUSAL, (), fine, 64, 64)
    assert torch.equal(kept(shape, program, tensors, lists, kv_walk, q_walk), want)


def test_a_coarse_block_is_full_only_where_every_fine_block_is():
    # one query block of 128 rows as two of 64; three KV blocks of 128 as six of 64
    states = torch.tensor([[[[FULL, FULL, FULL, PARTIAL, 0, 0], [FULL, FULL, FULL, 0, 0, 0]]]])
    fine = (*_as_lists(states == PARTIAL), *_as_lists(states == FULL))
    assert torch.equal(fine_states(*fine, 6), states.to(torch.int32))
    num, idx, full_num, full_idx = as_lists(*coarse_maps(fine, 6, 2, 2)[:2])
    assert full_num.tolist() == [[[1]]] and full_idx[0, 0, 0, :1].tolist() == [0]
    assert num.tolist() == [[[1]]] and idx[0, 0, 0, :1].tolist() == [1]  # block 2 is skipped


def test_the_walk_and_its_limits():
    assert block_walk(128, 128, 128) == (128, 128) and block_walk(256, 512, 128) == (256, 512)
    assert block_walk(64, 64, 128) == (128, 128) and block_walk(128, 64, 64) == (128, 128)
    assert block_walk(96, 128, 128) is None and block_walk(128, 96, 128) is None and block_walk(0, 128, 128) is None
    assert block_mask_reason(64, 64, 128, 3) is None and block_mask_reason(128, 128, 128, 4) is None
    assert "mask tensor" in block_mask_reason(128, 64, 128, 4)
    assert "KV block size 96" in block_mask_reason(96, 128, 128, 0)


def test_the_host_walks_a_fine_mask_at_the_kernels_blocks():
    fine = random_lists(1, 2, 4, 5, True, seed=0)
    shape = (1, 2, 250, 300)
    lists, mask_mod, tensors, kv_block, q_block = walked(fine, shape, 64, 64, CAUSAL)
    assert (kv_block, q_block) == (128, 128) and len(tensors) == 1 and lists[0].shape == (1, 2, 2)
    assert tensors[0][:3].tolist() == [5, 0, 20]  # kv blocks, no batch stride, the head stride
    cpu = torch.device("cpu")
    assert host_prefill._walked_block_mask(fine, CAUSAL, (), 128, 128, 128, shape, cpu)[1] == CAUSAL  # as given
    refused = {
        "mask tensor": lambda: walked(fine, shape, 64, 64, DOCUMENT, (torch.zeros(4, dtype=torch.int32),) * 4),
        "mask_mod: .* not JSON": lambda: walked(fine, shape, 64, 64, "causal"),
        "do not cover 300": lambda: walked(fine, (1, 2, 300, 300), 64, 64, CAUSAL),  # 4 blocks of 64
        "full_kv_num_blocks and full_kv_indices together": lambda: walked((*fine[:3], None), shape, 64, 64),
        "int32 index": lambda: walked(fine, (1, 2, 250, 2**35), 64, 64),
    }
    for message, call in refused.items():
        with pytest.raises(UnsupportedError, match=message):
            call()


@pytest.mark.parametrize("dims", [(128, 128), (192, 128), (64, 64)])
@pytest.mark.parametrize("per_batch_and_head", [False, True])
def test_the_kernel_compiles_the_walked_mask_program_without_local_memory(dims, per_batch_and_head):
    """A document mask's program with the states term (two captured tensors, four or six loads per
    element) on the device defaults of the head dims (persistent CTAs with early exponentials at
    128/128, split K/V rings at 192/128, two Q buffers at 64/64): no spills, WGMMAs not serialized."""
    import re

    from inductor_cute.kernels.attention.flex_prefill_config import FlexPrefillProblem, default_config, spec
    from inductor_cute.runtime.compiler import compile_spec

    program = sp.canonical(with_block_states(DOCUMENT, 1, 64, 64, per_batch_and_head, per_batch_and_head),
                           ("int32", "int32"), mask=True)
    problem = FlexPrefillProblem(*dims, "bfloat16", mask_program=program, mask_dtypes=("int32", "int32"),
                                 sparse_block=128)
    compiled = compile_spec(spec(problem, default_config(problem, num_sms=132)), "sm_90a", keep_ptx=True)
    assert "serialized" not in compiled.ptxas_report
    if dims == (64, 64) and per_batch_and_head:
        # at the 168-register cap, persistent CTAs with two Q buffers spill a word around the term
        # (a plain config does not): a mask of fine blocks per batch and per head, at head dim 64 only
        assert re.search(r"\b[48] bytes spill stores, [48] bytes spill loads", compiled.ptxas_report)
        return
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", compiled.ptxas_report)
    assert "ld.local" not in compiled.ptx
