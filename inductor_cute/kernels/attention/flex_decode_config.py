"""Split-KV attention decoding (FlexAttention decode) on Hopper: the problem, the compile-time
configuration, limits and the split heuristic. Plain Python, usable without the CuTe DSL.

One CTA owns (64 packed query rows, batch, KV head, KV split). The packed rows are the
`q_per_kv * Lq` queries that share one KV head, so K and V are read once per split, not once
per query head; a block mask per query head under GQA runs unpacked, a CTA per query head.

The family's protocol, as for the other kernel families: a FlexDecodeProblem says what is
computed (head dims, dtype, GQA ratio, programs, block mask), a FlexDecodeConfig how (tuning
knobs); `unsupported_reason` names a problem the kernel cannot take, `default_config` picks a
configuration, `config_error` checks one, and `spec` makes the KernelSpec (`from_params` reads it
back in the kernel module's build).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...runtime.arch import SUPPORTED

DTYPES = ("bfloat16", "float16")
ROWS = 64  # packed query rows per CTA: the M of one WGMMA
MAX_Q_LEN = 64  # decoding and speculative decoding; longer queries belong to a prefill kernel
SMEM_BUDGET = SUPPORTED[(9, 0)].smem_per_block
DEFAULT_SM_COUNT = SUPPORTED[(9, 0)].sm_count  # for split counts chosen without a GPU
MAX_STAGES = 8
MAX_SPLITS = 256
MIN_BLOCKS_PER_SPLIT = 4  # each split streams at least this many KV blocks (hides the pipeline fill)

# (head_dim_qk, head_dim_v) -> (kv_block, consumer warp groups). A WGMMA's N is at most 256, so
# V 512 is split over two warp groups, each holding 256 output columns (128 fp32 registers).
HEAD_DIMS = {
    (64, 64): (128, 1),
    (64, 32): (128, 1),  # PyTorch's decoding tests mix 32- and 64-wide heads
    (32, 64): (128, 1),
    (128, 128): (128, 1),
    (256, 256): (64, 1),
    (192, 128): (64, 1),  # DeepSeek MLA, not absorbed
    (576, 512): (32, 2),  # absorbed MLA: one KV head, 512 latent + 64 rope dims
    (96, 96): (128, 1),  # Phi-3/3.5-mini (64-byte swizzled rows)
}
# head dims whose kernels compile but have not yet passed their GPU tests: refused until they do
# (those tests empty this set for themselves). 96/96 passed on an H100 in the twenty-second
# session, after its query copy's fix (tests/gpu/test_flex_decode_gpu.py, gpu-checks-h100-20261205-s22.txt)
GPU_UNCHECKED_HEAD_DIMS: set = set()


@dataclass(frozen=True)
class FlexDecodeProblem:
    """What a compiled decode kernel computes; batch, heads and lengths stay dynamic."""

    head_dim_qk: int
    head_dim_v: int
    dtype_name: str
    q_per_kv: int  # query heads per KV head (GQA group), packed into the rows of one CTA
    has_kv_len: bool = False  # a per-batch int32 length tensor masks the tail of each sequence
    score_program: str = ""  # a score program's text (the score_mod, programs/score.py); "" for none
    score_dtypes: tuple[str, ...] = ()  # dtype names of the program's captured tensors t0, t1, ...
    mask_program: str = ""  # a mask program's text (the mask_mod); "" for none
    mask_dtypes: tuple[str, ...] = ()  # dtype names of the mask program's captured tensors
    sparse_block: int = 0  # a BlockMask's KV block size (a multiple of kv_block); 0: no block mask
    kv_batch_broadcast: bool = False  # K and V have batch 1, shared by every query batch (a paged cache)
    # each query head in its own CTA instead of q_per_kv packed into one: a block mask per query
    # head under GQA gives the heads of a KV head different block lists
    gqa_unpacked: bool = False

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def pack_factor(problem: FlexDecodeProblem) -> int:
    """Query heads whose rows share one CTA (PackGQA's group)."""
    return 1 if problem.gqa_unpacked else problem.q_per_kv


def q_copy_threads_per_row(head_dim_qk: int) -> int:
    """Threads that copy one stretch of a query row into shared memory, 16 bytes each: 8 (64
    columns), 4 where 64 does not divide the row (32 and 96 columns). A stretch running past the
    row's end read the next row and wrote into the next row of sQ: 96/96 under GQA failed on the GPU."""
    return math.gcd(8, head_dim_qk // 8)


def unpacks_gqa(mask_heads: int, q_per_kv: int) -> bool:
    """Whether a block mask of `mask_heads` heads needs one CTA per query head: torch indexes the
    mask by query head, so under GQA only a broadcast mask (1 head) gives a KV head one list."""
    return mask_heads != 1 and q_per_kv != 1


@dataclass(frozen=True)
class FlexDecodeConfig:
    """How the decode kernel runs a problem: its tuning knobs."""

    kv_block: int  # KV rows per pipeline stage
    stages: int  # depth of the TMA ring: bytes in flight per SM = stages * stage_bytes
    v_warpgroups: int  # consumer warp groups; each owns head_dim_v / v_warpgroups output columns

    @property
    def threads(self) -> int:
        return 128 * (1 + self.v_warpgroups)  # one producer warp group + consumers

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def stage_bytes(head_dim_qk: int, head_dim_v: int, kv_block: int) -> int:
    return kv_block * (head_dim_qk + head_dim_v) * 2


def smem_bytes(problem: FlexDecodeProblem, config: FlexDecodeConfig) -> int:
    """Shared memory of one CTA: mbarriers, Q, and the K/V ring (each buffer 1 KB aligned)."""
    q = ROWS * problem.head_dim_qk * 2
    k = config.stages * config.kv_block * problem.head_dim_qk * 2
    v = config.stages * config.kv_block * problem.head_dim_v * 2
    return _align(16 * config.stages, 1024) + _align(q, 1024) + _align(k, 1024) + v


def unsupported_reason(head_dim_qk: int, head_dim_v: int, dtype_name: str, q_per_kv: int = 1,
                       q_len: int = 1) -> str | None:
    """Why a problem of these sizes has no decode kernel, in one line for the user; None when
    supported. Callers ask before they hold a FlexDecodeProblem (its programs untranslated)."""
    if dtype_name not in DTYPES:
        return f"dtype {dtype_name} is not supported (use bfloat16 or float16)"
    if (head_dim_qk, head_dim_v) not in HEAD_DIMS:
        dims = ", ".join(f"{a}/{b}" for a, b in HEAD_DIMS if (a, b) not in GPU_UNCHECKED_HEAD_DIMS)
        return f"head dims {head_dim_qk}/{head_dim_v} (qk/v) are not supported (supported: {dims})"
    if (head_dim_qk, head_dim_v) in GPU_UNCHECKED_HEAD_DIMS:
        return f"head dims {head_dim_qk}/{head_dim_v} (qk/v) are not yet checked on a GPU"
    if q_per_kv < 1:
        return f"query heads per KV head must be at least 1, got {q_per_kv}"
    if not 1 <= q_len <= MAX_Q_LEN:
        return f"query length {q_len} is outside the decode kernel's range 1..{MAX_Q_LEN}"
    return None


def problem_error(p: FlexDecodeProblem) -> str | None:
    """Why a problem cannot be compiled (sizes, or programs not in canonical form); None if it can."""
    problem = unsupported_reason(p.head_dim_qk, p.head_dim_v, p.dtype_name, p.q_per_kv)
    if problem:
        return problem
    if p.sparse_block < 0:
        return f"block mask KV block size {p.sparse_block} is negative"
    from ..common.programs.score import programs_error

    return programs_error(p.score_program, p.score_dtypes, p.mask_program, p.mask_dtypes)


def config_error(config: FlexDecodeConfig, problem: FlexDecodeProblem) -> str | None:
    """Why `config` cannot compile `problem` (the problem's own errors first); None when it can."""
    error = problem_error(problem)
    if error:
        return error
    if config.kv_block % 16 or not 16 <= config.kv_block <= 256:
        return f"kv_block {config.kv_block} must be a multiple of 16 in 16..256 (WGMMA N and K)"
    if config.v_warpgroups not in (1, 2) or problem.head_dim_v // config.v_warpgroups > 256:
        return f"{config.v_warpgroups} consumer warp groups cannot hold {problem.head_dim_v} output columns"
    if config.stages < 1:
        return "stages must be at least 1"
    if smem_bytes(problem, config) > SMEM_BUDGET:
        return f"{smem_bytes(problem, config)} bytes of shared memory exceed the {SMEM_BUDGET} available"
    if problem.sparse_block % config.kv_block:
        return (f"block mask KV block size {problem.sparse_block} is not a multiple of the kernel's KV block "
                f"{config.kv_block}")
    return None


def kv_block_for(head_dim_qk: int, head_dim_v: int, sparse_block: int = 0) -> int:
    """KV rows per pipeline stage: the head dims' default, or for a BlockMask whose KV block is not
    a multiple of it (create_block_mask's BLOCK_SIZE=64), a half or a quarter of it (at least 32,
    the smallest stage a tested variant uses) that divides the mask's block, so that a mask block
    is whole stages. Smaller stages hold as many bytes in flight: default_config fits more."""
    kv_block = HEAD_DIMS[(head_dim_qk, head_dim_v)][0]
    if sparse_block > 0:
        for smaller in (kv_block, kv_block // 2, kv_block // 4):
            if smaller >= 32 and sparse_block % smaller == 0:
                return smaller
    return kv_block


def default_config(problem: FlexDecodeProblem) -> FlexDecodeConfig:
    """As many stages as shared memory holds: decoding is bound by the bytes kept in flight."""
    wgs = HEAD_DIMS[(problem.head_dim_qk, problem.head_dim_v)][1]
    kv_block = kv_block_for(problem.head_dim_qk, problem.head_dim_v, problem.sparse_block)
    config = FlexDecodeConfig(kv_block, 1, wgs)
    while config.stages < MAX_STAGES and smem_bytes(problem, dataclasses.replace(config, stages=config.stages + 1)) \
            <= SMEM_BUDGET:
        config = dataclasses.replace(config, stages=config.stages + 1)
    return config


def sparse_block_reason(sparse_block: int, kv_block: int, q_block: int, q_len: int) -> str | None:
    """Why the kernel cannot walk a BlockMask of these sizes; None when it can. The kernel streams
    kv_block keys per stage, so a mask block must be whole stages; a CTA's queries share one block
    list, so every query must be in query block 0 (q_idx // q_block). (A mask per query head under
    GQA runs unpacked: unpacks_gqa.)"""
    if sparse_block <= 0 or sparse_block % kv_block:
        return f"block mask KV block size {sparse_block} is not a multiple of the kernel's KV block {kv_block}"
    if q_len > q_block:
        return f"query length {q_len} spans more than one block mask query block ({q_block})"
    return None


def m_tiles(q_per_kv: int, q_len: int) -> int:
    return -(-(q_per_kv * q_len) // ROWS)


def num_splits(batch: int, kv_heads: int, row_tiles: int, kv_len: int, kv_block: int,
               num_sms: int = DEFAULT_SM_COUNT) -> int:
    """KV splits per (batch, KV head, row tile), chosen at run time from the problem size.

    Among 1 to `most` splits, minimise waves x (blocks per split + 1), the time model of a kernel
    that keeps one CTA per SM busy streaming (the +1 stands for a CTA's fixed cost: Q load,
    pipeline fill, writing partials). One round of CTAs that leaves a few SMs idle beats two
    rounds that fill them all: measured at Llama-3.1-8B decode shapes (benchmarks/
    sweep_flex_splits.py, perf notes, twelfth session), 16 splits (128 CTAs) took 38.7 us against
    47.7 for 32 (256 CTAs) at B1 KV32768, and 2 splits 68.6 against 70.8 for 4 at B8 KV8192.
    Splits never get fewer than MIN_BLOCKS_PER_SPLIT blocks.
    """
    blocks = max(1, -(-kv_len // kv_block))
    base = max(1, batch * kv_heads * row_tiles)
    most = max(1, min(MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))

    def cost(s):
        return -(-base * s // num_sms) * (-(-blocks // s) + 1)

    return min(range(1, most + 1), key=lambda s: (cost(s), s))


KERNEL_MODULE = "inductor_cute.kernels.attention.flex_decode_sm90"
_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(FlexDecodeProblem))


def spec(problem: FlexDecodeProblem, config: FlexDecodeConfig | None = None):
    """The KernelSpec of the split-KV decode kernel (with its combine step): `config`, or the
    default one; programs in canonical form (programs/score.py canonical)."""
    from ...runtime.spec import KernelSpec

    config = config or default_config(problem)
    error = config_error(config, problem)
    if error:
        raise ValueError(error)
    return KernelSpec.make(KERNEL_MODULE, **problem.as_params(), **config.as_params())


def from_params(params: dict) -> tuple[FlexDecodeProblem, FlexDecodeConfig]:
    """The (problem, config) of a spec's parameters: the inverse of `spec`."""
    problem = {k: v for k, v in params.items() if k in _PROBLEM_FIELDS}
    for k in ("score_dtypes", "mask_dtypes"):
        if k in problem:
            problem[k] = tuple(problem[k])
    config = {k: v for k, v in params.items() if k not in _PROBLEM_FIELDS}
    return FlexDecodeProblem(**problem), FlexDecodeConfig(**config)


def flex_decode_spec(head_dim_qk: int, head_dim_v: int, dtype_name: str, q_per_kv: int,
                     has_kv_len: bool = False, config: FlexDecodeConfig | None = None,
                     score_program: str = "", score_dtypes: tuple[str, ...] = (), mask_program: str = "",
                     mask_dtypes: tuple[str, ...] = (), sparse_block: int = 0, kv_batch_broadcast: bool = False,
                     gqa_unpacked: bool = False):
    """`spec` of the problem these arguments spell."""
    return spec(FlexDecodeProblem(head_dim_qk, head_dim_v, dtype_name, q_per_kv, has_kv_len, score_program,
                                  tuple(score_dtypes), mask_program, tuple(mask_dtypes), sparse_block,
                                  kv_batch_broadcast, gqa_unpacked), config)
