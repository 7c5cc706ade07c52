"""Named hardware barrier ids (`bar.sync id, threads`), one table for every kernel.

Id 0 is the whole CTA's barrier (__syncthreads). Ids are a per-kernel resource (16 per CTA): two
kernels may use the same id, but within one kernel each role below needs its own range, so a
kernel that combines roles (a GEMM epilogue in an attention kernel, say) takes them from here.
"""

CTA = 0
# GEMM: the epilogue warps of consumer warp group `slot` (one id per slot).
GEMM_EPILOGUE = 1  # .. 1 + slot
# GEMM: two consumer warp groups take turns at the tensor cores and the epilogue (ping-pong):
# id GEMM_TURN + 2 * phase + slot.
GEMM_TURN = 3  # .. 6
# Attention: all consumer warp groups of a CTA (softmax statistics shared through shared memory).
ATTENTION_CONSUMERS = 1
# Attention prefill: two consumer warp groups take turns at the tensor cores (ping-pong): warp
# group `slot` syncs on id ATTENTION_TURN + slot, the other arrives when it hands the turn over.
ATTENTION_TURN = 2  # .. 3
# Attention prefill with O in a buffer of its own: the threads of consumer warp group `slot`
# around the staging of its half of O.
ATTENTION_EPILOGUE = 4  # .. 5
# Attention backward (dq_reduce): the threads of consumer warp group `slot` around the staging of
# its dQ product for the TMA reduce.
BACKWARD_DQ_STAGE = 2  # .. 3
MAX_ID = 15


def gemm_epilogue(slot):
    return GEMM_EPILOGUE + slot


def gemm_turn(phase, slot):
    return GEMM_TURN + 2 * phase + slot


def attention_turn(slot):
    return ATTENTION_TURN + slot


def attention_epilogue(slot):
    return ATTENTION_EPILOGUE + slot


def backward_dq_stage(slot):
    return BACKWARD_DQ_STAGE + slot
