"""Persistent CTAs that claim their tiles from a global counter (FlexPrefillConfig.dynamic_tiles).

A CTA starts on tile blockIdx.x; its producer warp claims each next tile with one atomic add on
a counter in global memory, `ctas + counter++`, so the CTA that frees up first takes the next
tile in the kernel's order (longest first), as the hardware deals the tiles of a launch with one
CTA per tile, while every CTA keeps its producer loading ahead under its consumers' epilogue.

The producer hands each claim to the consumer warp groups through a ring of TILE_CLAIM_STAGES
tile indices in shared memory, an mbarrier pair per slot (PipelineAsync: the producer warp's 32
lanes arrive on a slot's full barrier after writing it, every consumer thread on its empty
barrier after reading it). A claim past the last tile ends both loops.

The counter (int32 [2], zero before the launch) is left zero: [0] counts claims, [1] the CTAs
whose producer has claimed past the end; the last of those (acq_rel: after every other CTA's
last claim) zeroes both. So one zeroed workspace serves every launch on a stream
(host.common.stream_scratch), and a CUDA graph replays the kernel as it ran.
"""

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from .flex_prefill_config import TILE_CLAIM_STAGES


def claim_ring(bars, consumer_threads: int) -> pipeline.PipelineAsync:
    """The ring of claimed tiles over the mbarriers at `bars` (2 * TILE_CLAIM_STAGES Int64); the
    caller's mbarrier_init_fence covers them."""
    return pipeline.PipelineAsync.create(
        barrier_storage=bars.data_ptr(), num_stages=TILE_CLAIM_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads), defer_sync=True)


@cute.jit
def claim_next(counter: cute.Tensor, ctas: Int32) -> Int32:
    """The producer warp's next tile: one lane adds to the counter, every lane gets its tile."""
    claimed = Int32(0)
    if cute.arch.lane_idx() == 0:
        claimed = cute.arch.atomic_add(counter.iterator, Int32(1))
    return ctas + cute.arch.shuffle_sync(claimed, 0)


def publish(ring: pipeline.PipelineAsync, state, tile_ids: cute.Tensor, tile: Int32) -> None:
    """The producer warp writes `tile` into the ring's slot `state` (the caller advances state)."""
    ring.producer_acquire(state)
    tile_ids[state.index] = tile
    ring.producer_commit(state)


def receive(ring: pipeline.PipelineAsync, state, tile_ids: cute.Tensor) -> Int32:
    """A consumer thread reads the tile in the ring's slot `state` (the caller advances state)."""
    ring.consumer_wait(state)
    tile = tile_ids[state.index]
    ring.consumer_release(state)
    return tile


@cute.jit
def retire(counter: cute.Tensor, ctas: Int32) -> None:
    """After the producer's claim past the end: the last CTA to get there zeroes the counter."""
    if cute.arch.lane_idx() == 0:
        done = cute.arch.atomic_add(counter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
        if done == ctas - 1:
            counter[0] = Int32(0)
            counter[1] = Int32(0)
