"""Attention prefill forward (FlexAttention prefill) on Hopper: the problem, the compile-time
configuration and its limits. Plain Python, usable without the CuTe DSL.

One CTA owns M_BLOCK = 128 query rows of one (batch, query head): two consumer warp groups of 64
rows each take turns at the tensor cores (ping-pong), one producer warp streams each tile's Q and K/V
blocks through a `stages`-deep TMA ring. The GQA ratio stays a run-time value (query head h reads
KV head h // (Hq // Hkv)), so one compiled kernel serves every ratio.

The family's protocol, as for flex decode: a FlexPrefillProblem says what is computed, a
FlexPrefillConfig how; `unsupported_reason` names a problem the kernel cannot take,
`default_config` picks a configuration, `config_error` checks one, and `spec` makes the
KernelSpec (`from_params` reads it back in the kernel module's build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...runtime.arch import SUPPORTED

DTYPES = ("bfloat16", "float16")
M_BLOCK = 128  # query rows per CTA: two consumer warp groups of one m64 WGMMA each
CONSUMER_WARPGROUPS = 2
SMEM_BUDGET = SUPPORTED[(9, 0)].smem_per_block
MAX_STAGES = 4
TILE_CLAIM_STAGES = 2  # claimed tile indices the producer may publish ahead of the consumers

# (head_dim_qk, head_dim_v) -> kv_block. Per consumer thread S takes kv_block / 2 fp32 registers,
# P a quarter (bf16 pairs), O head_dim_v / 2: 160 at 128/128, 176 at 256/256 with 64-key blocks.
# Dv <= Dqk: O is staged in Q's shared memory (with one Q buffer).
HEAD_DIMS = {
    (64, 64): 128,
    (128, 128): 128,
    (192, 128): 128,  # DeepSeek MLA, not absorbed
    (256, 256): 64,
    (96, 96): 128,  # Phi-3/3.5-mini (64-byte swizzled rows)
    (64, 32): 128,  # PyTorch's flex tests mix 64- and 32-wide heads (V's rows 64 bytes)
}
# head dims whose kernels compile but have not yet passed their GPU tests: refused until they do
# (those tests empty this set for themselves). 96/96 and 64/32 passed on an H100 in the
# twenty-first session (tests/gpu/test_flex_prefill_gpu.py, record gpu-checks-h100-20261205-s21.txt)
GPU_UNCHECKED_HEAD_DIMS: set = set()


@dataclass(frozen=True)
class FlexPrefillProblem:
    """What a compiled prefill kernel computes; batch, heads, lengths and the GQA ratio stay dynamic."""

    head_dim_qk: int
    head_dim_v: int
    dtype_name: str
    score_program: str = ""  # a score program's text (the score_mod, programs/score.py); "" for none
    score_dtypes: tuple[str, ...] = ()  # dtype names of the program's captured tensors t0, t1, ...
    mask_program: str = ""  # a mask program's text (the mask_mod); "" for none
    mask_dtypes: tuple[str, ...] = ()  # dtype names of the mask program's captured tensors
    sparse_block: int = 0  # a BlockMask's KV block size (a multiple of kv_block); 0: no block mask
    sparse_q_block: int = 128  # the BlockMask's query block size (a multiple of M_BLOCK)
    # scale > 0 (as every model's 1/sqrt(d)): without a score program the scale is folded into the
    # softmax's exponent (an FFMA per score instead of a multiply and a subtraction); False (a scale
    # <= 0) scales the scores first, the only order that keeps masked scores at -inf
    positive_scale: bool = True
    kv_batch_broadcast: bool = False  # K and V have batch 1, shared by every query batch

    def as_params(self) -> dict:
        """The fields, kv_batch_broadcast left out when False (the specs that predate it keep their keys)."""
        params = dataclasses.asdict(self)
        if not self.kv_batch_broadcast:
            del params["kv_batch_broadcast"]
        return params


@dataclass(frozen=True)
class FlexPrefillConfig:
    """How the prefill kernel runs a problem: its tuning knobs."""

    kv_block: int  # keys per pipeline stage (S = Q K^T is M_BLOCK x kv_block)
    stages: int  # depth of the K/V TMA ring
    # 0: one CTA per tile; n: at most n CTAs (the SM count: one CTA fits an SM), each walking every
    # n-th tile, its producer loading the next tile's K/V under the last one's epilogue
    persistent_ctas: int = 0
    # Q buffers: 1, where O is staged for its store at the end of a tile (a persistent CTA's next
    # Q waits for that store); 2 (with persistent CTAs), the next tile's Q loads into the other
    # buffer while this one still runs, and O gets a staging buffer of its own
    q_stages: int = 1
    # K and V in rings of their own, each stage freed as soon as its product is done (K after S,
    # V after P V) and the producer loading K_{j+1} before V_j; off: one ring whose stage holds a
    # block's K and V and is freed after P V, so at 2 stages (192/128) the next block's K waits
    # for the other warp group's P V and its 80 KB reload is exposed every block
    split_kv: bool = False
    # n > 0: per KV block, each row's first n exponentials (of kv_block / 4 per thread) are made
    # before the wait for P_{j-1} V_{j-1} and ptxas is held to that order (accumulator.wait_after;
    # it otherwise waits before every exponential, so a warp group's softmax never overlapped its
    # own P V), the rest after it with O's rescale and P's pack; 0: the order ptxas picks
    early_exps: int = 0
    # with persistent CTAs: each CTA's next tile comes from a global counter (one atomic add per
    # tile, tile_claims.py) instead of every persistent_ctas-th one. Causal tiles differ in length,
    # and a fixed stride leaves CTAs idle at the end: in a greedy-dispatch simulation (1.5 blocks of
    # fixed cost per tile, 132 CTAs) a fixed stride takes 602.5 blocks per SM for DeepSeek-V3 MLA
    # and 582 for the Llama causal case, claiming 560.5 and 560 (512 of work)
    dynamic_tiles: bool = False
    # n > 0: per KV block, n of each row's kv_block / 4 exponentials per thread are made mostly on
    # the FMA pipe (softmax.exp2_fma, ten instructions) instead of by MUFU.EX2, whose 16 per
    # cycle per SM the d64 softmax nearly fills beside the tensor cores (528 of 640 cycles per warp
    # and block, docs/perf-notes.md); 0: every one by MUFU
    poly_exps: int = 0
    # with persistent CTAs walking a fixed stride and two Q buffers, for problems without a block
    # mask: the next tile's S_0 is issued with this tile's last P V and its softmax runs under it
    # (prefill_consumer.py), where each tile's first block and epilogue stood alone (~19% of the
    # vit d64 tile of 8 blocks, docs/perf-notes.md)
    overlap_tiles: bool = False

    @property
    def threads(self) -> int:
        return 128 * (1 + CONSUMER_WARPGROUPS)  # one producer warp group + consumers

    def as_params(self) -> dict:
        """The fields, split_kv, early_exps, dynamic_tiles, poly_exps and overlap_tiles left out
        when unset (the specs that predate them keep their keys)."""
        params = dataclasses.asdict(self)
        for field in ("split_kv", "early_exps", "dynamic_tiles", "poly_exps", "overlap_tiles"):
            if not params[field]:
                del params[field]
        return params


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def smem_bytes(problem: FlexPrefillProblem, config: FlexPrefillConfig) -> int:
    """Shared memory of one CTA: mbarriers (K/V ring, or K and V rings, and Q), Q (with one Q
    buffer, it stages O for the TMA store at the end: Dv <= Dqk; with two, O has its own) and the
    K/V ring, each buffer 1 KB aligned."""
    q = config.q_stages * M_BLOCK * problem.head_dim_qk * 2
    o = M_BLOCK * problem.head_dim_v * 2 if config.q_stages > 1 else 0
    k = config.stages * config.kv_block * problem.head_dim_qk * 2
    v = config.stages * config.kv_block * problem.head_dim_v * 2
    bars = 16 * config.stages * (2 if config.split_kv else 1) + 16 * config.q_stages
    if config.dynamic_tiles:  # the claimed tiles' ring: its mbarriers and tile indices
        bars += TILE_CLAIM_STAGES * (16 + 4)
    return _align(bars, 1024) + _align(q, 1024) + _align(o, 1024) + _align(k, 1024) + v


def unsupported_reason(head_dim_qk: int, head_dim_v: int, dtype_name: str) -> str | None:
    """Why a problem of these sizes has no prefill kernel, in one line for the user; None when
    supported."""
    if dtype_name not in DTYPES:
        return f"dtype {dtype_name} is not supported (use bfloat16 or float16)"
    if (head_dim_qk, head_dim_v) not in HEAD_DIMS:
        dims = ", ".join(f"{a}/{b}" for a, b in HEAD_DIMS if (a, b) not in GPU_UNCHECKED_HEAD_DIMS)
        return f"head dims {head_dim_qk}/{head_dim_v} (qk/v) are not supported (supported: {dims})"
    if (head_dim_qk, head_dim_v) in GPU_UNCHECKED_HEAD_DIMS:
        return f"head dims {head_dim_qk}/{head_dim_v} (qk/v) are not yet checked on a GPU"
    return None


def sparse_block_reason(kv_block_size: int, q_block_size: int, kv_block: int) -> str | None:
    """Why the kernel cannot walk a BlockMask of these block sizes; None when it can. A CTA's
    M_BLOCK rows must lie in one mask query block, and a mask KV block must be whole stages."""
    if kv_block_size <= 0 or kv_block_size % kv_block:
        return f"block mask KV block size {kv_block_size} is not a multiple of the kernel's KV block {kv_block}"
    if q_block_size <= 0 or q_block_size % M_BLOCK:
        return f"block mask query block size {q_block_size} is not a multiple of the kernel's {M_BLOCK} query rows"
    return None


def block_walk(kv_block_size: int, q_block_size: int, kv_block: int) -> tuple[int, int] | None:
    """The (KV, query) block sizes at which the kernel walks a BlockMask of these sizes: the mask's
    own where sparse_block_reason allows them, the kernel's (kv_block, M_BLOCK) where the mask's
    divide those (its lists coarsened, block_states.py keeps it exact); None when neither."""
    from .block_states import walked_size

    kv, q = walked_size(kv_block_size, kv_block), walked_size(q_block_size, M_BLOCK)
    return None if kv is None or q is None else (kv, q)


def block_mask_reason(kv_block_size: int, q_block_size: int, kv_block: int, mask_tensors: int) -> str | None:
    """Why the kernel cannot walk a BlockMask of these sizes beside a mask_mod of `mask_tensors`
    captured tensors; None when it can. Finer blocks than the kernel's take one more mask tensor
    (in a training graph the backward walks them the same way: flex_backward_config.block_walk)."""
    from .block_states import states_slot_reason

    walk = block_walk(kv_block_size, q_block_size, kv_block)
    if walk is None:
        return sparse_block_reason(kv_block_size, q_block_size, kv_block)
    return states_slot_reason(walk, kv_block_size, q_block_size, mask_tensors)


def problem_error(p: FlexPrefillProblem) -> str | None:
    """Why a problem cannot be compiled (sizes, or programs not in canonical form); None if it can."""
    problem = unsupported_reason(p.head_dim_qk, p.head_dim_v, p.dtype_name)
    if problem:
        return problem
    if p.sparse_block < 0:
        return f"block mask KV block size {p.sparse_block} is negative"
    if p.sparse_q_block <= 0 or p.sparse_q_block % M_BLOCK:
        return f"block mask query block size {p.sparse_q_block} is not a multiple of {M_BLOCK}"
    from ..common.programs.score import programs_error

    return programs_error(p.score_program, p.score_dtypes, p.mask_program, p.mask_dtypes)


def config_error(config: FlexPrefillConfig, problem: FlexPrefillProblem) -> str | None:
    """Why `config` cannot compile `problem` (the problem's own errors first); None when it can."""
    error = problem_error(problem)
    if error:
        return error
    if config.kv_block % 16 or not 16 <= config.kv_block <= 256:
        return f"kv_block {config.kv_block} must be a multiple of 16 in 16..256 (WGMMA N and K)"
    if config.persistent_ctas < 0:
        return f"persistent_ctas {config.persistent_ctas} must be 0 (a CTA per tile) or a CTA count"
    if config.stages < 2:
        # the consumers hold stage j - 1 (V for P V) while S of stage j is computed
        return "stages must be at least 2"
    if config.q_stages not in (1, 2):
        return f"q_stages {config.q_stages} must be 1 or 2"
    for name in ("early_exps", "poly_exps"):  # counts of a thread's values per row
        count = getattr(config, name)
        if not 0 <= count <= config.kv_block // 4:
            return (f"{name} {count} must be in 0..{config.kv_block // 4} (a thread's values per row "
                    f"of a {config.kv_block}-key block)")
    if config.dynamic_tiles and config.persistent_ctas == 0:
        return "dynamic_tiles needs persistent_ctas: with one CTA per tile the hardware deals the tiles"
    if config.overlap_tiles and (config.persistent_ctas == 0 or config.q_stages != 2 or config.dynamic_tiles):
        return "overlap_tiles needs persistent CTAs on a fixed stride (no dynamic_tiles) and two Q buffers"
    if config.overlap_tiles and problem.sparse_block:
        return "overlap_tiles needs a problem without a block mask (every tile walks every KV block)"
    if config.q_stages == 2 and config.persistent_ctas == 0:
        return "q_stages 2 needs persistent_ctas: with one tile per CTA there is no next Q to load early"
    if smem_bytes(problem, config) > SMEM_BUDGET:
        return f"{smem_bytes(problem, config)} bytes of shared memory exceed the {SMEM_BUDGET} available"
    if problem.sparse_block % config.kv_block:
        return (f"block mask KV block size {problem.sparse_block} is not a multiple of the kernel's KV block "
                f"{config.kv_block}")
    return None


# head dims whose default is persistent CTAs with two Q buffers, on a device whose SM count is
# given: at 64/64 they ran the vit case (B32 H16 S1024) in 338.6 us against 403 with a CTA per tile
PERSISTENT_HEAD_DIMS = {(64, 64)}
# what the sixteenth session measured fastest per head dims (flex_prefill-quick-h200-20261205-s16):
# 128/128 persistent CTAs (one Q buffer) with early_exps, Llama causal 874.2 us against 946.0;
# 192/128 split_kv with early_exps, DeepSeek-V3 MLA causal 1050.2 against 1431.0 (split_kv alone
# 1054.3). early_exps at 64/64 was slower (351.1 against 338.6)
TUNED = {(128, 128): dict(persistent=True, early_exps=20), (192, 128): dict(split_kv=True, early_exps=20)}


def plain_config(problem: FlexPrefillProblem, split_kv: bool = False) -> FlexPrefillConfig:
    """The head dims' KV block, one CTA per tile and as many stages as shared memory holds (with
    `split_kv`, in K's and V's rings), up to MAX_STAGES: what every tuned config builds on."""
    config = FlexPrefillConfig(HEAD_DIMS[(problem.head_dim_qk, problem.head_dim_v)], 2, split_kv=split_kv)
    while config.stages < MAX_STAGES and smem_bytes(problem, dataclasses.replace(config, stages=config.stages + 1)) \
            <= SMEM_BUDGET:
        config = dataclasses.replace(config, stages=config.stages + 1)
    return config


def default_config(problem: FlexPrefillProblem, num_sms: int = 0) -> FlexPrefillConfig:
    """The head dims' KV block and as many stages as shared memory holds, up to MAX_STAGES (a
    prefill is compute bound: two or three stages cover the TMA latency; 128/128 gets 3). With
    `num_sms`, head dims in PERSISTENT_HEAD_DIMS get that many persistent CTAs and two Q buffers
    where both fit; TUNED head dims get what measured fastest (persistent CTAs only with num_sms)."""
    dims = (problem.head_dim_qk, problem.head_dim_v)
    config = plain_config(problem)
    if num_sms > 0 and dims in PERSISTENT_HEAD_DIMS:
        persistent = persistent_config(config, problem, num_sms)
        if persistent.q_stages == 2:
            return persistent
    tuned = dict(TUNED.get(dims, {}))
    if tuned.pop("persistent", False) and num_sms > 0:
        config = dataclasses.replace(config, persistent_ctas=num_sms)
    return dataclasses.replace(config, **tuned)


def persistent_config(config: FlexPrefillConfig, problem: FlexPrefillProblem, num_sms: int) -> FlexPrefillConfig:
    """`config` with `num_sms` persistent CTAs, and two Q buffers where they fit beside its ring."""
    persistent = dataclasses.replace(config, persistent_ctas=num_sms)
    two_q = dataclasses.replace(persistent, q_stages=2)
    return two_q if config_error(two_q, problem) is None else persistent


def m_blocks(q_len: int) -> int:
    return -(-q_len // M_BLOCK)


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim_qk: int, head_dim_v: int,
                    causal: bool = False) -> float:
    """Matmul flops of a forward pass (2 per multiply-add, S = Q K^T and O = P V); causal halves them."""
    flops = 2.0 * batch * heads * q_len * kv_len * (head_dim_qk + head_dim_v)
    return flops / 2 if causal else flops


KERNEL_MODULE = "inductor_cute.kernels.attention.flex_prefill_sm90"
_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(FlexPrefillProblem))


def spec(problem: FlexPrefillProblem, config: FlexPrefillConfig | None = None):
    """The KernelSpec of the prefill kernel: `config`, or the default one; programs in canonical
    form (programs/score.py canonical)."""
    from ...runtime.spec import KernelSpec

    error = problem_error(problem)
    if error:
        raise ValueError(error)
    config = config or default_config(problem)
    error = config_error(config, problem)
    if error:
        raise ValueError(error)
    return KernelSpec.make(KERNEL_MODULE, **problem.as_params(), **config.as_params())


def from_params(params: dict) -> tuple[FlexPrefillProblem, FlexPrefillConfig]:
    """The (problem, config) of a spec's parameters: the inverse of `spec`."""
    problem = {k: v for k, v in params.items() if k in _PROBLEM_FIELDS}
    for k in ("score_dtypes", "mask_dtypes"):
        if k in problem:
            problem[k] = tuple(problem[k])
    config = {k: v for k, v in params.items() if k not in _PROBLEM_FIELDS}
    return FlexPrefillProblem(**problem), FlexPrefillConfig(**config)
