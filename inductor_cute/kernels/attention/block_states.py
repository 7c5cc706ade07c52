"""A BlockMask of blocks finer than a kernel walks, kept exact: the mask program's block-states term.

The prefill kernel walks M_BLOCK query rows and kv_block keys at a time, and a BlockMask's lists
must name whole kernel blocks. A mask of finer blocks (64 queries, 64 keys: `create_block_mask(...,
BLOCK_SIZE=64)`) is walked coarsened (host/flex_blocks.py): a coarse block is full where every fine
block in it is full, skipped where every one is, and partial otherwise. Inside a partial coarse
block the kernel runs the mask program on every element, so the program is given one more term
that looks up the element's fine block: full keeps the key, skipped drops it, partial asks the
mask_mod. That is the stock kernels' rule at the fine blocks, whatever the lists hold (a mask
built from block lists alone, `BlockMask.from_kv_blocks` without a mask_mod, included).

The states tensor (1-D int32) starts with a header: [fine KV blocks per query block, the batch
stride, the head stride] (a stride 0 where the mask has one batch or one head), then each fine
block's state: 0 skipped, 1 partial, 2 full. Plain Python: no DSL, no torch.
"""

from __future__ import annotations

import json

HEADER = 3  # [kv blocks, batch stride, head stride]
SKIPPED, PARTIAL, FULL = 0, 1, 2


def walked_size(size: int, tile: int) -> int | None:
    """The block size at which a kernel of `tile`-sized blocks walks a mask's `size`-sized ones
    along one dimension: the mask's own where it is a multiple of the tile, the tile where it
    divides the tile (walked coarsened, kept exact by the states term), else None."""
    if size > 0 and size % tile == 0:
        return size
    return tile if size > 0 and tile % size == 0 else None


def states_slot_reason(walk: tuple, kv_block_size: int, q_block_size: int, mask_tensors: int) -> str | None:
    """Why a mask of these (KV, query) block sizes, walked at `walk`, cannot be: finer blocks take
    one more captured tensor (the states) beside the mask_mod's `mask_tensors`; None when it can."""
    from ..common.programs.score import MAX_TENSORS

    if walk != (kv_block_size, q_block_size) and mask_tensors >= MAX_TENSORS:
        return (f"{q_block_size} x {kv_block_size} blocks (queries x keys) take a mask tensor, and the mask_mod has "
                f"all {MAX_TENSORS}")
    return None


def with_block_states(mask_text: str, slot: int, q_block: int, kv_block: int, batches: bool = True,
                      heads: bool = True) -> str:
    """The mask program `mask_text` ("" for none) and'ed with the fine-block states read from
    captured tensor t<slot> (the states tensor above) of a mask of `q_block` x `kv_block` blocks;
    `batches` / `heads`: the mask has more than one batch / head (else the term skips that stride)."""
    steps = json.loads(mask_text) if mask_text else []
    result = steps[-1][0] if steps else None  # the mask_mod's verdict
    names = {step[0] for step in steps}
    prefix = "blk"
    while any(name.startswith(prefix) for name in names):
        prefix = "_" + prefix
    t = f"t{slot}"

    def n(name):
        return prefix + name

    steps += [[n("kvn"), "load", t, 0], [n("qi"), "floordiv", "q", q_block], [n("qo"), "mul", n("qi"), n("kvn")],
              [n("ki"), "floordiv", "kv", kv_block], [n("i0"), "add", n("qo"), n("ki")]]
    index = n("i0")
    for used, leaf, at in ((batches, "b", 1), (heads, "h", 2)):
        if used:
            steps += [[n(leaf + "s"), "load", t, at], [n(leaf + "o"), "mul", leaf, n(leaf + "s")],
                      [n(leaf + "i"), "add", index, n(leaf + "o")]]
            index = n(leaf + "i")
    steps += [[n("i"), "add", index, HEADER], [n("s"), "load", t, n("i")],
              [n("full"), "eq", n("s"), FULL], [n("partial"), "eq", n("s"), PARTIAL]]
    if result is not None:
        steps += [[n("masked"), "and", n("partial"), result], [n("keep"), "or", n("full"), n("masked")]]
    else:
        steps += [[n("keep"), "or", n("full"), n("partial")]]
    return json.dumps(steps, separators=(",", ":"))
