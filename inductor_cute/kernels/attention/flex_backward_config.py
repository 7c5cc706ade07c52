"""Attention backward (FlexAttention backward) on Hopper: the problem, the compile-time
configuration and its limits. Plain Python, usable without the CuTe DSL.

    dV = P^T dO    dP = dO V^T    dS = P * (dP - delta)    dK = scale dS^T Q    dQ = scale dS K
    with P = exp(scale q k^T - lse) recomputed and delta[i] = sum_d dO[i, d] O[i, d]

Three kernels, run in this order:

  * preprocess (flex_backward_preprocess.py): delta and the logsumexp in log2 units per query row,
    padded to whole Q_PAD rows (padding: delta 0, lse +inf, so P = 0 there without a bounds check;
    a row with nothing to attend, lse -inf, also gets +inf: its gradients are 0).
  * dK/dV (flex_backward_sm90.py): one CTA per (KV_BLOCK keys, KV head, batch); two consumer warp
    groups own 64 keys each and walk the query blocks (Q_STEP rows) of every query head of the KV
    head, holding dK and dV in registers: S^T = K Q^T and dP^T = V dO^T (SS WGMMA), then
    dV += P^T dO and dK += dS^T Q (RS WGMMA: P^T and dS^T straight from registers).
  * dQ (flex_backward_dq_sm90.py): one CTA per (DQ_Q_BLOCK query rows, query head, batch) walking
    the KV blocks (DQ_KV_STEP keys) like the forward: S = Q K^T, dP = dO V^T (SS), dQ += dS K (RS).

By default dQ gets its own kernel: S and dP are recomputed (7 matmuls of the forward's size
instead of 5, 1.4x the floor's flops), for no dQ accumulator, no transposition of dS through
shared memory and a deterministic result. With `dq_reduce` (the five-product schedule, 64/64 and
128/128, not yet run on a GPU) the dK/dV CTA computes dQ as well: each block's dS goes through
shared memory, each consumer warp group multiplies it by half of K's columns (64/64: by its own
64 keys' rows of K) and adds the product to an fp32 workspace with a TMA reduce; the host casts
the workspace to dq and the dQ kernel does not run. Its sum order varies from run to run (not deterministic).

Same protocol as flex_prefill_config: a FlexBackwardProblem says what is computed, a
FlexBackwardConfig how; `unsupported_reason`, `default_config`, `config_error`, and `specs` makes
the three KernelSpecs (`from_params` reads one back in a kernel module's build).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...runtime.arch import SUPPORTED

DTYPES = ("bfloat16", "float16")
CONSUMER_WARPGROUPS = 2
KV_BLOCK = 128  # keys per dK/dV CTA: 64 per consumer warp group (one m64 WGMMA row tile)
Q_STEP = 64  # query rows per dK/dV pipeline stage (the N of S^T and dP^T)
DQ_Q_BLOCK = 128  # query rows per dQ CTA: 64 per consumer warp group
DQ_KV_STEP = 64  # keys per dQ pipeline stage
Q_PAD = 128  # preprocess rows are padded to a multiple of every kernel's query tile
SMEM_BUDGET = SUPPORTED[(9, 0)].smem_per_block
MAX_STAGES = 4

# Per dK/dV consumer thread: dK and dV take (Dqk + Dv) / 2 fp32 registers, S^T and dP^T 32 each:
# 224 at 192/128, which ptxas fits in the consumers' 240 without spills.
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (64, 32))  # 64/32: PyTorch's tests
# head dims whose kernels compile but have not yet passed their GPU tests, as in the forward
# configs: the torch.compile lowering refuses them (the eager entry takes HEAD_DIMS). 192/128
# passed in the seventeenth session, 64/32 in the twenty-first (H100, test_head_dims_64_32)
GPU_UNCHECKED_HEAD_DIMS: set = set()
# dq_reduce's dQ product per consumer warp group: at 128/128 half of Dqk's columns (64: one 128-byte
# swizzle atom of K) over the CTA's 128 keys; at 64/64, where half would split an atom, all 64
# columns over the warp group's own 64 keys (both warp groups add into the same rows)
DQ_REDUCE_HEAD_DIMS = ((64, 64), (128, 128))
MAX_OVERLAP_DIMS = 128  # Dqk + Dv up to which the dK/dV kernel's overlapped schedule fits in registers

KERNELS = ("preprocess", "dkdv", "dq")
KERNEL_MODULES = {
    "preprocess": "inductor_cute.kernels.attention.flex_backward_preprocess",
    "dkdv": "inductor_cute.kernels.attention.flex_backward_sm90",
    "dq": "inductor_cute.kernels.attention.flex_backward_dq_sm90",
}


@dataclass(frozen=True)
class FlexBackwardProblem:
    """What the backward kernels compute; batch, heads, lengths and the GQA ratio stay dynamic.
    A score program (score_mod) is recomputed on S and differentiated (programs/score_grad.py);
    its captured tensors get no gradient."""

    head_dim_qk: int
    head_dim_v: int
    dtype_name: str
    mask_program: str = ""  # a mask program's text (the mask_mod); "" for none
    mask_dtypes: tuple[str, ...] = ()  # dtype names of the mask program's captured tensors
    sparse_block: int = 0  # the BlockMask's KV block size (a multiple of KV_BLOCK); 0: no block mask
    sparse_q_block: int = 128  # the BlockMask's query block size (a multiple of DQ_Q_BLOCK)
    score_program: str = ""  # a score program's text (the score_mod); "" for none
    score_dtypes: tuple[str, ...] = ()  # dtype names of its captured tensors

    def as_params(self) -> dict:
        params = dataclasses.asdict(self)
        if not self.score_program:  # specs without one keep their keys
            del params["score_program"], params["score_dtypes"]
        return params


@dataclass(frozen=True)
class FlexBackwardConfig:
    """How the backward kernels run a problem: the depths of their TMA rings."""

    stages: int  # dK/dV: (Q, dO) blocks of Q_STEP rows in flight
    dq_stages: int  # dQ: (K, V) blocks of DQ_KV_STEP keys in flight
    # Block j's S and dP products issued with block j - 1's gradient products, j's elementwise
    # math under them (dK/dV: `overlap`, dQ: `dq_overlap`); off (strictly in sequence) until the
    # plain schedule is checked on a GPU. dK/dV's spills registers past 64/64.
    overlap: bool = False
    dq_overlap: bool = False
    dq_reduce: bool = False  # dQ from the dK/dV CTAs (five products; see the module docstring)
    # The strictly sequential schedules (overlap / dq_overlap off) commit S and dP apart and
    # exponentiate S while dP still computes; off: one group, the math after both. Without a
    # score program only (its derivative needs dP before the exponential).
    exp_under_dp: bool = False
    # dq_reduce: dS blocks in shared memory. 1: the consumers meet twice per block (before one
    # writes dS, so that the other's last dQ product has read it; before dQ reads it), and both do
    # their softmax-gradient math at once, under no product (measured 10% slower than the plain
    # schedule). 2: one buffer per block parity, one meeting per block, after each has issued its
    # dV and dK (their products run while the later warp group's math finishes).
    ds_buffers: int = 1

    @property
    def threads(self) -> int:
        return 128 * (1 + CONSUMER_WARPGROUPS)  # one producer warp group + consumers

    def as_params(self) -> dict:
        params = dataclasses.asdict(self)
        for flag in ("dq_reduce", "exp_under_dp"):
            if not params[flag]:  # specs without it keep their keys
                del params[flag]
        if params["ds_buffers"] == 1:
            del params["ds_buffers"]
        return params


def dq_reduce_split(head_dim_qk: int) -> tuple[int, int]:
    """(dQ columns, keys) of one consumer warp group's dQ product under dq_reduce."""
    return (head_dim_qk, KV_BLOCK // CONSUMER_WARPGROUPS) if head_dim_qk < 128 else \
        (head_dim_qk // CONSUMER_WARPGROUPS, KV_BLOCK)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def smem_bytes(problem: FlexBackwardProblem, config: FlexBackwardConfig, kernel: str = "dkdv") -> int:
    """Shared memory of one CTA of `kernel` ("dkdv" or "dq"): mbarriers (ring and the resident
    tiles), the resident tiles (K and V of the CTA's keys, or Q and dO of its rows) and the ring
    (Q and dO, or K and V, blocks), each buffer 1 KB aligned."""
    dqk, dv = problem.head_dim_qk, problem.head_dim_v
    if kernel == "dkdv":
        resident_rows, ring_rows, stages = KV_BLOCK, Q_STEP, config.stages
    elif kernel == "dq":
        resident_rows, ring_rows, stages = DQ_Q_BLOCK, DQ_KV_STEP, config.dq_stages
    else:
        return 0  # the preprocess kernel uses none
    total = (_align(16 * stages + 16, 1024) + _align(resident_rows * dqk * 2, 1024) +
             _align(resident_rows * dv * 2, 1024) + _align(stages * ring_rows * dqk * 2, 1024) +
             stages * ring_rows * dv * 2)
    if kernel == "dkdv" and config.dq_reduce:  # a block's dS (16-bit) and its dQ products (fp32)
        cols, _ = dq_reduce_split(dqk)
        total = (_align(total, 1024) + _align(config.ds_buffers * KV_BLOCK * Q_STEP * 2, 1024) +
                 CONSUMER_WARPGROUPS * Q_STEP * cols * 4)
    return total


def unsupported_reason(head_dim_qk: int, head_dim_v: int, dtype_name: str) -> str | None:
    """Why a problem of these sizes has no backward kernel, in one line; None when supported."""
    if dtype_name not in DTYPES:
        return f"dtype {dtype_name} is not supported (use bfloat16 or float16)"
    if (head_dim_qk, head_dim_v) not in HEAD_DIMS:
        dims = ", ".join(f"{a}/{b}" for a, b in HEAD_DIMS)
        return f"head dims {head_dim_qk}/{head_dim_v} (qk/v) are not supported by the backward (supported: {dims})"
    return None


def sparse_block_reason(kv_block_size: int, q_block_size: int) -> str | None:
    """Why the kernels cannot walk a BlockMask of these block sizes; None when they can: a dK/dV
    CTA's keys must lie in one mask KV block and a dQ CTA's rows in one mask query block."""
    if kv_block_size <= 0 or kv_block_size % KV_BLOCK:
        return f"block mask KV block size {kv_block_size} is not a multiple of the backward's {KV_BLOCK} keys"
    if q_block_size <= 0 or q_block_size % DQ_Q_BLOCK:
        return f"block mask query block size {q_block_size} is not a multiple of the backward's {DQ_Q_BLOCK} rows"
    return None


def block_walk(kv_block_size: int, q_block_size: int) -> tuple[int, int] | None:
    """The (KV, query) block sizes at which the kernels walk a BlockMask of these sizes: the mask's
    own where sparse_block_reason allows them, (KV_BLOCK, DQ_Q_BLOCK) where the mask's divide those
    (its lists coarsened, block_states.py keeps it exact, as the prefill does); None when neither."""
    from .block_states import walked_size

    kv, q = walked_size(kv_block_size, KV_BLOCK), walked_size(q_block_size, DQ_Q_BLOCK)
    return None if kv is None or q is None else (kv, q)


def block_mask_reason(kv_block_size: int, q_block_size: int, mask_tensors: int) -> str | None:
    """Why the kernels cannot walk a BlockMask of these sizes beside a mask_mod of `mask_tensors`
    captured tensors; None when they can. Finer blocks than the kernels' take one more mask tensor."""
    from .block_states import states_slot_reason

    walk = block_walk(kv_block_size, q_block_size)
    if walk is None:
        return sparse_block_reason(kv_block_size, q_block_size)
    return states_slot_reason(walk, kv_block_size, q_block_size, mask_tensors)


def problem_error(p: FlexBackwardProblem) -> str | None:
    """Why a problem cannot be compiled (sizes, block sizes, a mask program not in canonical form)."""
    problem = unsupported_reason(p.head_dim_qk, p.head_dim_v, p.dtype_name)
    if problem:
        return problem
    if p.sparse_block:
        problem = sparse_block_reason(p.sparse_block, p.sparse_q_block)
        if problem:
            return problem
    elif p.sparse_q_block <= 0 or p.sparse_q_block % DQ_Q_BLOCK:
        return f"block mask query block size {p.sparse_q_block} is not a multiple of {DQ_Q_BLOCK}"
    from ..common.programs.score import programs_error
    from ..common.programs.score_grad import derivative_error

    error = programs_error(p.score_program, p.score_dtypes, p.mask_program, p.mask_dtypes)
    if error or not p.score_program:
        return error
    return derivative_error(p.score_program, p.score_dtypes)


def config_error(config: FlexBackwardConfig, problem: FlexBackwardProblem) -> str | None:
    """Why `config` cannot compile `problem` (the problem's own errors first); None when it can."""
    error = problem_error(problem)
    if error:
        return error
    for name, stages in (("stages", config.stages), ("dq_stages", config.dq_stages)):
        if not 1 <= stages <= MAX_STAGES:
            return f"{name} must be in 1..{MAX_STAGES}, got {stages}"
    for name, on, stages in (("overlap", config.overlap, config.stages),
                             ("dq_overlap", config.dq_overlap, config.dq_stages)):
        if on and stages < 2:
            return f"{name} needs at least 2 stages (block j - 1's stays in use while j is read)"
    if config.dq_reduce and (problem.head_dim_qk, problem.head_dim_v) not in DQ_REDUCE_HEAD_DIMS:
        return f"dq_reduce is built for head dims 64/64 and 128/128, not {problem.head_dim_qk}/{problem.head_dim_v}"
    if config.ds_buffers not in (1, 2) or (config.ds_buffers == 2 and not config.dq_reduce):
        return f"ds_buffers {config.ds_buffers} must be 1, or 2 with dq_reduce (the dS blocks it stages)"
    if config.dq_reduce and config.overlap:
        return "dq_reduce runs the plain dK/dV schedule only (not overlap)"
    if config.dq_reduce and config.dq_overlap:
        return "dq_reduce runs no dQ kernel: dq_overlap must be off"
    if config.exp_under_dp and problem.score_program:
        return "exp_under_dp needs no score program (its derivative needs dP before the exponential)"
    if config.exp_under_dp and (config.overlap or config.dq_overlap):
        return "exp_under_dp changes the sequential schedules only: overlap and dq_overlap must be off"
    if config.exp_under_dp and problem.head_dim_qk > 128:
        # dK (96 fp32 registers) beside S^T and dP^T in flight apart: ptxas spills and serializes
        return (f"exp_under_dp serializes the dK/dV kernel's WGMMAs at head dims "
                f"{problem.head_dim_qk}/{problem.head_dim_v}")
    if config.overlap and problem.head_dim_qk + problem.head_dim_v > MAX_OVERLAP_DIMS:
        return (f"overlap (dK/dV) spills registers at head dims {problem.head_dim_qk}/{problem.head_dim_v}: dK, dV, "
                "S^T, dP^T and both 16-bit operands would be live at once")
    for kernel in ("dkdv",) if config.dq_reduce else ("dkdv", "dq"):
        if smem_bytes(problem, config, kernel) > SMEM_BUDGET:
            return (f"{kernel}: {smem_bytes(problem, config, kernel)} bytes of shared memory exceed the "
                    f"{SMEM_BUDGET} available")
    return None


def default_config(problem: FlexBackwardProblem, dq_reduce: bool = False) -> FlexBackwardConfig:
    """As many stages (from 2, up to MAX_STAGES) as each kernel's shared memory holds, with or
    without the five-product dq_reduce (and its two dS buffers where they fit beside that ring)."""
    config = FlexBackwardConfig(2, 2, dq_reduce=dq_reduce)
    for field, kernel in (("stages", "dkdv"), ("dq_stages", "dq")):
        while getattr(config, field) < MAX_STAGES:
            bigger = dataclasses.replace(config, **{field: getattr(config, field) + 1})
            if smem_bytes(problem, bigger, kernel) > SMEM_BUDGET:
                break
            config = bigger
    two = dataclasses.replace(config, ds_buffers=2)
    if dq_reduce and smem_bytes(problem, two) <= SMEM_BUDGET:
        config = two
    return config


def padded_rows(q_len: int) -> int:
    """Rows of the preprocess outputs (delta, lse in log2 units) for q_len queries."""
    return _align(max(q_len, 1), Q_PAD)


def backward_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim_qk: int, head_dim_v: int,
                   causal: bool = False) -> float:
    """The floor's matmul flops of a backward: 5 products (S = Q K^T and dK = dS^T Q, dQ = dS K
    of Dqk; dP = dO V^T and dV = P^T dO of Dv), 2.5x the forward's two; causal halves them."""
    flops = 2.0 * batch * heads * q_len * kv_len * (3 * head_dim_qk + 2 * head_dim_v)
    return flops / 2 if causal else flops


_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(FlexBackwardProblem))


def specs(problem: FlexBackwardProblem, config: FlexBackwardConfig | None = None) -> dict:
    """{kernel name: KernelSpec} of the backward kernels, with `config` or the default one (no "dq"
    with dq_reduce); the preprocess kernel's spec carries only what it depends on (head dim and
    dtype)."""
    from ...runtime.spec import KernelSpec

    error = problem_error(problem)
    if error:
        raise ValueError(error)
    config = config or default_config(problem)
    error = config_error(config, problem)
    if error:
        raise ValueError(error)
    params = {**problem.as_params(), **config.as_params()}
    return {"preprocess": KernelSpec.make(KERNEL_MODULES["preprocess"], head_dim_v=problem.head_dim_v,
                                          dtype_name=problem.dtype_name),
            "dkdv": KernelSpec.make(KERNEL_MODULES["dkdv"], **params),
            **({} if config.dq_reduce else {"dq": KernelSpec.make(KERNEL_MODULES["dq"], **params)})}


def from_params(params: dict) -> tuple[FlexBackwardProblem, FlexBackwardConfig]:
    """The (problem, config) of a dK/dV or dQ spec's parameters: the inverse of `specs`."""
    problem = {k: v for k, v in params.items() if k in _PROBLEM_FIELDS}
    for key in ("mask_dtypes", "score_dtypes"):
        if key in problem:
            problem[key] = tuple(problem[key])
    config = {k: v for k, v in params.items() if k not in _PROBLEM_FIELDS}
    return FlexBackwardProblem(**problem), FlexBackwardConfig(**config)
