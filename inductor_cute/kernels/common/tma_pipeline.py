"""The TMA pipelines of single-CTA kernels (no clusters): one producer thread issues the loads
of a stage, whose mbarrier counts their bytes; every consumer warp arrives once to free it."""

import cutlass.cute as cute
import cutlass.pipeline as pipeline


def tma_pipeline(barriers, stages: int, tx_bytes, consumer_warps: int) -> pipeline.PipelineTmaAsync:
    """A `stages`-deep pipeline over the mbarriers at `barriers` (2 * stages Int64 slots: full and
    empty), each stage expecting `tx_bytes`; mbarrier_init_fence is the caller's, after all of them."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(), num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)


def stage_bytes(dtype, *staged_layouts) -> int:
    """Bytes of one stage of each staged smem layout (mode 2 the stage), summed."""
    return sum(cute.size_in_bytes(dtype, cute.slice_(layout, (None, None, 0))) for layout in staged_layouts)
