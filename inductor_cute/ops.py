"""Eager entry points: call our kernels on torch tensors, no torch.compile needed.

Every check that can fail is made here, before a kernel runs, and raises UnsupportedError with
one line that names the problem.
"""

from __future__ import annotations

import functools

import torch

from .errors import UnsupportedError
from .runtime import device_arch, get_kernel

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ALIGN_BYTES = 16  # every kernel reads and writes rows with 16-byte vectors


@functools.lru_cache(maxsize=None)
def _check_device(index: int) -> None:
    device_arch(index)  # raises for a GPU we have no kernels for; remembered once it passes


def _check_cuda(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError(f"{name}: expected torch.Tensor arguments, got {type(t).__name__}")
        if t.device.type != "cuda":
            raise UnsupportedError(f"{name}: tensors must be on a CUDA device, got {t.device}")
        if t.device != tensors[0].device:
            raise UnsupportedError(f"{name}: tensors are on {tensors[0].device} and {t.device}; expected one device")
    _check_device(tensors[0].device.index or 0)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous and 16-byte aligned, else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=256)
def _rmsnorm_kernel(n: int, dtype_name: str):
    from .kernels.rmsnorm_config import rmsnorm_spec, unsupported_reason

    problem = unsupported_reason(n, dtype_name)
    if problem:
        raise UnsupportedError(f"rmsnorm: {problem}")
    return get_kernel(rmsnorm_spec(n, dtype_name))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x**2, -1) + eps) * weight, accumulated in fp32, returned in x's dtype."""
    _check_cuda("rmsnorm", x, weight)
    dtype_name = DTYPE_NAMES.get(x.dtype)
    if dtype_name is None:
        raise UnsupportedError(f"rmsnorm: dtype {x.dtype} is not supported (use bfloat16, float16 or float32)")
    if weight.dtype != x.dtype:
        raise UnsupportedError(f"rmsnorm: weight dtype {weight.dtype} differs from input dtype {x.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise UnsupportedError(f"rmsnorm: weight of shape {tuple(weight.shape)} does not match input {tuple(x.shape)}")
    if weight.device != x.device:
        raise UnsupportedError(f"rmsnorm: weight is on {weight.device}, input on {x.device}")
    n = x.shape[-1]
    kernel = _rmsnorm_kernel(n, dtype_name)
    if x.numel() == 0:
        return torch.empty_like(x)
    x = _aligned(x)
    out = torch.empty_like(x)
    kernel(x.view(-1, n), _aligned(weight), out.view(-1, n), float(eps))
    return out


# ---------------------------------------------------------------------------------------- GEMM

_GEMM_INPUT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tma_view(t: torch.Tensor, unit_mode: int) -> torch.Tensor | None:
    """`t` (3-D) restrided for TMA with `unit_mode` contiguous, or None if its layout cannot be.

    TMA needs a unit-stride mode, every other stride a multiple of 16 bytes and a 16-byte aligned
    base. Modes of extent 1 have no meaningful stride, so they get a packed one."""
    sizes, strides = list(t.shape), list(t.stride())
    if t.data_ptr() % _ALIGN_BYTES or (sizes[unit_mode] > 1 and strides[unit_mode] != 1):
        return None
    strides[unit_mode] = 1
    packed = max(sz * st for sz, st in zip(sizes, strides))
    for i in range(3):
        if i == unit_mode:
            continue
        if sizes[i] == 1:
            strides[i] = -(-packed // 8) * 8
        elif strides[i] % 8 or strides[i] == 0:
            return None
    return t.as_strided(sizes, strides)


def _operand(t: torch.Tensor, modes: tuple[int, ...]) -> tuple[torch.Tensor | None, int]:
    """The TMA view of `t` with the first workable unit mode among `modes`, copying `t` into a
    packed layout with `modes[0]` contiguous when none is; (None, mode) if even that cannot be."""
    for mode in modes:
        view = _tma_view(t, mode)
        if view is not None:
            return view, mode
    order = [i for i in (2, 0, 1) if i != modes[0]] + [modes[0]]  # batch outermost, unit mode last
    packed = t.permute(order).clone(memory_format=torch.contiguous_format)
    return _tma_view(packed.permute([order.index(i) for i in range(3)]), modes[0]), modes[0]


@functools.lru_cache(maxsize=1024)
def _gemm_kernel(problem, config, num_sms: int):
    from .kernels.gemm_kernels import kernel_spec

    return get_kernel(kernel_spec(problem, config, num_sms))


def _gemv_workspace(device, sizes: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's split-K partials and arrival counters, fresh per call: a cached buffer could be
    shared by two streams, or live in a CUDA graph's private pool that the graph later reuses.
    The counters are zeroed only when the kernel splits K (otherwise it touches neither)."""
    n_partials, n_counters, split = sizes
    ws = torch.empty(n_partials + n_counters, device=device, dtype=torch.float32)
    counters = ws[n_partials:].view(torch.int32)
    if split:
        counters.zero_()
    return ws[:n_partials], counters


def _default_gemm_config(problem, batch: int, m: int, n: int, k: int, num_sms: int):
    """The decode GEMV for one matrix of at most 16 rows against a K-major weight, else the WGMMA
    GEMM's heuristic tile."""
    from .kernels import gemv_config
    from .kernels.gemm_config import default_config

    if batch == 1 and gemv_config.unsupported_reason(m, n, k, problem) is None:
        gemv = gemv_config.default_config(m, n, k, num_sms)
        if gemv_config.config_error(gemv, problem, m=m, k=k) is None:  # a K past 64 full A slices cannot
            return gemv
    return default_config(m, n, problem, batch, num_sms)


def _prepare_gemm(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config=None, epilogue=""):
    """Checks and TMA views for one GEMM: ((problem, config, num_sms), kernel arguments, out);
    the plan and arguments are None when the output is empty."""
    from .kernels.gemm_config import GemmProblem, problem_error
    from .kernels.gemm_kernels import config_problem
    from .kernels.gemv_config import GemvConfig, splits, workspace_sizes

    if a.dtype not in _GEMM_INPUT or b.dtype != a.dtype:
        raise UnsupportedError(f"{name}: A and B must both be bfloat16 or float16, got {a.dtype} and {b.dtype}")
    batch, m, k = a.shape
    if b.shape[0] != batch or b.shape[1] != k:
        raise UnsupportedError(f"{name}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    n = b.shape[2]
    out_dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    if out_dtype not in DTYPE_NAMES:
        raise UnsupportedError(f"{name}: output dtype {out_dtype} is not supported")
    if out is None:
        out = torch.empty(batch, m, n, device=a.device, dtype=out_dtype)
    elif out.shape != (batch, m, n) or out.dtype != out_dtype:
        raise UnsupportedError(f"{name}: out must be {(batch, m, n)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.numel() == 0:
        return None, None, out  # nothing to compute
    if k == 0:
        raise UnsupportedError(f"{name}: K must be at least 1")
    if n % 8:
        raise UnsupportedError(f"{name}: N={n} must be a multiple of 8 (16-byte output rows for TMA)")
    a3, a_unit = _operand(a.permute(1, 2, 0), (1, 0))  # (M, K, L): K- or M-major
    if a_unit == 0 and m % 8:  # M-major A needs 16-byte columns; a K-major copy may still work
        a3, a_unit = _operand(a.permute(1, 2, 0), (1,))
    b3, b_unit = _operand(b.permute(2, 1, 0), (0, 1))  # (N, K, L): N- or K-major
    a_major, b_major = ("k" if a_unit == 1 else "m"), ("n" if b_unit == 0 else "k")
    if a3 is None or b3 is None or ("k" in (a_major, b_major) and k % 8) or (a_major == "m" and m % 8):
        raise UnsupportedError(f"{name}: the contiguous dimension of each operand must be a multiple of 8 "
                               f"elements (TMA reads 16-byte rows); got M={m}, K={k}, N={n}")
    d3 = _tma_view(out.permute(1, 2, 0), 1)
    if d3 is None:
        raise UnsupportedError(f"{name}: out must be row-major with 16-byte aligned rows")
    c3 = None
    if c is not None:
        try:
            c = c.expand(batch, m, n)
        except RuntimeError:
            raise UnsupportedError(f"{name}: C of shape {tuple(c.shape)} does not broadcast to {(batch, m, n)}") from None
        c3, _ = _operand(c.to(out_dtype).permute(1, 2, 0), (1,))  # never None: N % 8 == 0
        beta = 1.0 if beta is None else beta
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n:
            raise UnsupportedError(f"{name}: bias must have shape ({n},), got {tuple(bias.shape)}")
        bias = bias.to(out_dtype).contiguous()
    problem = GemmProblem(_GEMM_INPUT[a.dtype], DTYPE_NAMES[out_dtype], a_major, b_major,
                          bias is not None, c is not None, activation, epilogue or "")
    error = problem_error(problem)
    if error:
        raise UnsupportedError(f"{name}: {error}")
    num_sms = _sm_count(a.device.index or 0)
    if config is None:
        config = _default_gemm_config(problem, batch, m, n, k, num_sms)
    else:
        error = config_problem(config, problem, m, k)
        if error or (batch > 1 and isinstance(config, GemvConfig)):
            raise UnsupportedError(f"{name}: config {config} cannot run this problem: {error or 'gemv is not batched'}")
    scalars = (float(alpha), float(beta or 0.0))
    if isinstance(config, GemvConfig):  # 2-D operands; the workspace is added at each launch
        n_partials, n_counters = workspace_sizes(n, k, config)
        plan = (problem, config, num_sms, (n_partials, n_counters, splits(k, config) > 1))
        two_d = (t[:, :, 0] if t is not None else None for t in (a3, b3, d3, c3))
        return plan, (*two_d, bias, *scalars), out
    return (problem, config, num_sms, None), (a3, b3, d3, c3, bias, *scalars), out


def _launch(kernel, args: tuple, workspace: tuple | None, device) -> None:
    if workspace is None:
        kernel(*args)
    else:
        kernel(*args[:5], *_gemv_workspace(device, workspace), *args[5:])


def _batched(name, a, b, bias, c, out):
    """mm's operands as bmm's (a batch of one), after the checks every GEMM input needs."""
    _check_cuda(name, a, b, *(t for t in (bias, c, out) if t is not None))
    if name == "mm":
        if a.dim() != 2 or b.dim() != 2:
            raise UnsupportedError(f"mm: expected 2-D tensors, got {a.dim()}-D and {b.dim()}-D")
        return (a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0) if c is not None and c.dim() == 2 else c,
                out.unsqueeze(0) if out is not None else None)
    if a.dim() != 3 or b.dim() != 3:
        raise UnsupportedError(f"bmm: expected 3-D tensors, got {a.dim()}-D and {b.dim()}-D")
    return a, b, c, out


# Calls whose checks passed and whose kernel operands are plain views of the caller's tensors
# are remembered by their argument layout, so a repeat (a compiled graph's GEMM, a training
# step) skips the checks and only restrides: ~60 us of host time down to a few.
_FAST_PATHS: dict[tuple, tuple] = {}
_FAST_PATHS_MAX = 4096


def _layout(t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):  # never remembered: the checks will refuse it
        return ("not a tensor", id(t))
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % _ALIGN_BYTES == 0)


def _view_of(view, t):
    """(sizes, strides) that make `view` from `t` with as_strided, or None if it is not a view of t."""
    if view is None or t is None or view.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() \
            or view.storage_offset() != t.storage_offset() or view.dtype != t.dtype:
        return None
    return tuple(view.shape), tuple(view.stride())


def _remember(key, kernel, kernel_args, workspace, a, b, c, out, bias):
    a3, b3, d3, c3, bias_arg = kernel_args[:5]
    views = [_view_of(a3, a), _view_of(b3, b), _view_of(d3, out)]
    if None in views or (c is not None and _view_of(c3, c) is None) or bias_arg is not bias:
        return
    if len(_FAST_PATHS) >= _FAST_PATHS_MAX:
        _FAST_PATHS.clear()
    _FAST_PATHS[key] = (kernel, views, _view_of(c3, c) if c is not None else None, kernel_args[5:], workspace)


def _gemm(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config=None, epilogue="", launch=True):
    key = None
    if launch and out is not None:
        key = (name, _layout(a), _layout(b), _layout(c), _layout(bias), _layout(out), alpha, beta, activation,
               out_dtype, config, epilogue)
        hit = _FAST_PATHS.get(key)
        if hit is not None:
            kernel, views, c_view, scalars, workspace = hit
            c3 = c.as_strided(*c_view) if c is not None else None
            _launch(kernel, (a.as_strided(*views[0]), b.as_strided(*views[1]), out.as_strided(*views[2]), c3, bias,
                             *scalars), workspace, out.device)
            return out
    a3d, b3d, c3d, out3 = _batched(name, a, b, bias, c, out)
    plan, kernel_args, out3 = _prepare_gemm(name, a3d, b3d, bias, c3d, alpha, beta, activation, out_dtype, out3, config,
                                            epilogue)
    if not launch:
        return plan[:3] if plan is not None else None
    if plan is not None:
        kernel = _gemm_kernel(*plan[:3])
        _launch(kernel, kernel_args, plan[3], out3.device)
        if key is not None:
            _remember(key, kernel, kernel_args, plan[3], a, b, c, out, bias)
    return out3[0] if name == "mm" else out3


def mm(a, b, *, bias=None, c=None, alpha=1.0, beta=None, activation="identity", out_dtype=None, out=None,
       config=None, epilogue=""):
    """D = activation(alpha * a @ b + bias + beta * c) for 2-D a (M, K) and b (K, N).

    bf16/fp16 inputs, fp32 accumulation, output in `out_dtype` (default: a's dtype). Any layout
    of a and b is accepted (nn.Linear weights as `w.t()` are read in place); `c` broadcasts to
    (M, N) and `beta` defaults to 1 when it is given; `bias` has shape (N,). M <= 16 against a
    K-major b (an nn.Linear weight) runs the decode GEMV, anything else the WGMMA GEMM; `config`
    (a kernels.gemm_config.GemmConfig or kernels.gemv_config.GemvConfig) overrides that choice
    and its configuration. `epilogue` (a
    kernels.epilogue_program text) replaces alpha/beta/activation: the program computes the output
    from the accumulator, `bias` (its "row") and `c` (its "full")."""
    return _gemm("mm", a, b, bias, c, alpha, beta, activation, out_dtype, out, config, epilogue)


def bmm(a, b, *, bias=None, c=None, alpha=1.0, beta=None, activation="identity", out_dtype=None, out=None,
        config=None, epilogue=""):
    """The batched form of `mm`: a (L, M, K), b (L, K, N), any batch strides; returns (L, M, N)."""
    return _gemm("bmm", a, b, bias, c, alpha, beta, activation, out_dtype, out, config, epilogue)


def gemm_plan(a, b, *, bias=None, c=None, alpha=1.0, beta=None, activation="identity", out_dtype=None,
              out=None, config=None, epilogue=""):
    """(GemmProblem, GemmConfig, SM count) that `mm` (2-D inputs) or `bmm` (3-D) would run."""
    name = "mm" if a.dim() == 2 else "bmm"
    plan = _gemm(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config, epilogue, launch=False)
    if plan is None:
        raise UnsupportedError(f"{name}: an empty output needs no kernel")
    return plan


def gemm_spec_for(a, b, **kwargs):
    """The KernelSpec that `mm` or `bmm` would run on these inputs (same arguments), for precompiling."""
    from .kernels.gemm_kernels import kernel_spec

    return kernel_spec(*gemm_plan(a, b, **kwargs))


# ---------------------------------------------------------------------------- attention decoding

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=256)
def _flex_decode_kernel(head_dim_qk: int, head_dim_v: int, dtype_name: str, q_per_kv: int, has_kv_len: bool,
                        score_program: str = "", score_dtypes: tuple[str, ...] = (), mask_program: str = "",
                        mask_dtypes: tuple[str, ...] = (), sparse_block: int = 0):
    from .kernels.flex_decode_config import flex_decode_spec

    return get_kernel(flex_decode_spec(head_dim_qk, head_dim_v, dtype_name, q_per_kv, has_kv_len,
                                       score_program=score_program, score_dtypes=score_dtypes,
                                       mask_program=mask_program, mask_dtypes=mask_dtypes, sparse_block=sparse_block))


def _score_mod_operands(score_mod: str | None, score_tensors, device, kind: str = "score"
                        ) -> tuple[str, tuple[str, ...], list]:
    """(canonical program text or "", captured tensors' dtype names, the kernel's captured-tensor
    slots: the tensors contiguous, then None). `kind` "mask": the mask_mod's mask program."""
    from .kernels import score_program as sp

    if score_mod is None:
        if score_tensors:
            raise UnsupportedError(f"flex_decode: {kind}_tensors were given without a {kind}_mod")
        return "", (), [None] * sp.MAX_TENSORS
    if not isinstance(score_mod, str):
        raise UnsupportedError(f"flex_decode: {kind}_mod must be a {kind} program's text (kernels.score_program)")
    tensors = list(score_tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.device != device:
            raise UnsupportedError(f"flex_decode: {kind} tensor t{i} must be a 1-D tensor on {device}")
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
    try:
        text = sp.canonical(score_mod, dtypes, mask=kind == "mask")
    except ValueError as e:
        raise UnsupportedError(f"flex_decode: {kind}_mod: {e}") from None
    return text, dtypes, [t.contiguous() for t in tensors] + [None] * (sp.MAX_TENSORS - len(tensors))


def _block_mask_operands(block_mask: tuple, kv_block_size: int, q_block_size: int, heads: int, group: int,
                         q_len: int, kv_block: int, device) -> list:
    """The kernel's four block-mask arguments (int32, contiguous; without full blocks, zero counts
    over kv_indices) from (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)."""
    from .kernels.flex_decode_config import sparse_block_reason

    num, idx, full_num, full_idx = block_mask
    if num is None or idx is None or (full_num is None) != (full_idx is None):
        raise UnsupportedError("flex_decode: a block mask needs kv_num_blocks and kv_indices, and full_kv_num_blocks "
                               "and full_kv_indices together or not at all")
    if full_num is None:
        full_num, full_idx = torch.zeros_like(num), idx
    for name, t, dim in (("kv_num_blocks", num, 3), ("kv_indices", idx, 4), ("full_kv_num_blocks", full_num, 3),
                         ("full_kv_indices", full_idx, 4)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or t.device != device or \
                t.dtype not in (torch.int32, torch.int64) or t.shape[:3] != num.shape or 0 in t.shape:
            raise UnsupportedError(f"flex_decode: {name} must be a non-empty {dim}-D int32 tensor on {device} "
                                   f"sharing kv_num_blocks' (batch, heads, query blocks) dims")
    problem = sparse_block_reason(kv_block_size, kv_block, q_block_size, q_len, num.shape[1], group)
    if problem:
        raise UnsupportedError(f"flex_decode: {problem}")
    if num.shape[1] not in (1, heads):
        raise UnsupportedError(f"flex_decode: the block mask has {num.shape[1]} heads; expected 1 or {heads}")
    return [t.to(torch.int32).contiguous() for t in (num, idx, full_num, full_idx)]


def _decode_operand(name: str, t: torch.Tensor, copy_ok: bool) -> torch.Tensor:
    """`t` (4-D) as TMA and 16-byte loads need it: unit last stride, other strides multiples of 8
    elements, 16-byte aligned base. Modes of extent 1 get a packed stride. A layout that does not
    fit is copied when `copy_ok` (q is small) and refused otherwise (k and v are the cache)."""
    sizes, strides = list(t.shape), list(t.stride())
    if strides[3] == 1:
        packed = -(-max(sz * st for sz, st in zip(sizes, strides)) // 8) * 8
        strides[:3] = [packed if sz == 1 else st for sz, st in zip(sizes[:3], strides[:3])]
        if t.data_ptr() % _ALIGN_BYTES == 0 and all(st % 8 == 0 and st > 0 for st in strides[:3]):
            return t.as_strided(sizes, strides)
    if copy_ok:
        return t.clone(memory_format=torch.contiguous_format)
    raise UnsupportedError(f"flex_decode: {name} must have a contiguous last dim, other strides multiples of "
                           f"8 elements and a 16-byte aligned start; got strides {tuple(t.stride())}")


def flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                kv_len: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
                score_mod: str | None = None, score_tensors=(), mask_mod: str | None = None, mask_tensors=(),
                kv_num_blocks: torch.Tensor | None = None, kv_indices: torch.Tensor | None = None,
                full_kv_num_blocks: torch.Tensor | None = None, full_kv_indices: torch.Tensor | None = None,
                kv_block_size: int = 128, q_block_size: int = 128):
    """Attention for decoding, split over the KV length: softmax(scale * q k^T) v per query head.

    q (B, Hq, Lq, Dqk), k (B, Hkv, Lkv, Dqk), v (B, Hkv, Lkv, Dv), bf16 or fp16, Hq a multiple of
    Hkv (GQA/MQA: query head h reads KV head h // (Hq // Hkv)), Lq at most 64. `kv_len` (B,)
    limits each batch's keys to its first kv_len[b]; a row with no key gets out 0 and lse -inf.
    `scale` defaults to 1/sqrt(Dqk). With `return_lse`, also returns the fp32 logsumexp (B, Hq,
    Lq) of the scaled scores in natural-log units, as torch's flex_attention returns it.
    `num_splits` overrides the number of KV splits chosen from the problem size.
    `score_mod` is a score program's text (kernels.score_program: flex_attention's score_mod as
    data) reading `score_tensors` (1-D, on q's device) as t0, t1, ...; it modifies the scaled
    scores before the softmax, exactly as flex_attention's score_mod does.

    A BlockMask's tensors (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices; (Z, H,
    Qb[, C]) as torch builds them) and block sizes restrict the keys to its blocks: `mask_mod`, a
    mask program's text reading `mask_tensors` as t0, t1, ..., masks keys of the partial blocks
    (of all keys without block tensors). As in torch, batch b reads mask row b % Z and query head
    h row h % H; H must be 1 unless Hq == Hkv, kv_block_size a multiple of the kernel's KV block,
    and Lq at most q_block_size (every query in query block 0).
    """
    from .kernels import flex_decode_config as fdc

    _check_cuda("flex_decode", q, k, v, *(t for t in (kv_len,) if t is not None))
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UnsupportedError(f"flex_decode: q, k and v must all be bfloat16 or float16, got {q.dtype}, "
                               f"{k.dtype} and {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise UnsupportedError(f"flex_decode: expected 4-D q, k, v (batch, heads, length, dim), got "
                               f"{q.dim()}-D, {k.dim()}-D and {v.dim()}-D")
    batch, heads, q_len, dqk = q.shape
    kv_heads, seq = k.shape[1], k.shape[2]
    dv = v.shape[3]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise UnsupportedError(f"flex_decode: batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != dqk or v.shape[1] != kv_heads or v.shape[2] != seq:
        raise UnsupportedError(f"flex_decode: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                               "do not match")
    if kv_heads == 0 or heads % kv_heads:
        raise UnsupportedError(f"flex_decode: {heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    problem = fdc.unsupported_reason(dqk, dv, DTYPE_NAMES[q.dtype], group, max(q_len, 1))
    if problem:
        raise UnsupportedError(f"flex_decode: {problem}")
    if kv_len is not None:
        if kv_len.shape != (batch,) or kv_len.dtype not in (torch.int32, torch.int64):
            raise UnsupportedError(f"flex_decode: kv_len must be an int32 or int64 tensor of shape ({batch},), got "
                                   f"{kv_len.dtype} of shape {tuple(kv_len.shape)}")
        kv_len = kv_len.to(torch.int32).contiguous()
    if batch * kv_heads > 65535:
        raise UnsupportedError(f"flex_decode: batch * KV heads = {batch * kv_heads} exceeds 65535 (grid limit)")
    if num_splits is not None and not 1 <= num_splits <= fdc.MAX_SPLITS:
        raise UnsupportedError(f"flex_decode: num_splits must be in 1..{fdc.MAX_SPLITS}, got {num_splits}")
    program, score_dtypes, score_slots = _score_mod_operands(score_mod, score_tensors, q.device)
    mask_program, mask_dtypes, mask_slots = _score_mod_operands(mask_mod, mask_tensors, q.device, "mask")
    kv_block = fdc.HEAD_DIMS[(dqk, dv)][0]
    block_mask = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    sparse_block, block_slots, keys = 0, [None] * 4, seq
    if any(t is not None for t in block_mask):
        block_slots = _block_mask_operands(block_mask, kv_block_size, q_block_size, heads, group, q_len, kv_block,
                                           q.device)
        sparse_block = kv_block_size
        # counted on the arguments: without full blocks, the kernel's full-index slot repeats kv_indices
        columns = kv_indices.shape[-1] + (full_kv_indices.shape[-1] if full_kv_indices is not None else 0)
        keys = min(seq, kv_block_size * columns)  # partial and full blocks bound the keys: no sync to count

    out = torch.empty(batch, heads, q_len, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)
    if out.numel() == 0 or seq == 0:  # nothing to attend to: flex_attention's empty rows
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out
    q4 = _decode_operand("q", q, copy_ok=True)
    k4, v4 = _decode_operand("k", k, copy_ok=False), _decode_operand("v", v, copy_ok=False)
    kernel = _flex_decode_kernel(dqk, dv, DTYPE_NAMES[q.dtype], group, kv_len is not None, program, score_dtypes,
                                 mask_program, mask_dtypes, sparse_block)
    if num_splits is None:
        num_splits = fdc.num_splits(batch, kv_heads, fdc.m_tiles(group, q_len), keys, kv_block,
                                    _sm_count(q.device.index or 0))
    o_part = torch.empty(num_splits, batch, heads, q_len, dv, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(num_splits, batch, heads, q_len, device=q.device, dtype=torch.float32)
    scale = 1.0 / dqk ** 0.5 if scale is None else float(scale)
    kernel(q4, k4, v4, kv_len, o_part, lse_part, out, lse, scale * _LOG2E, scale, *score_slots, *block_slots,
           *mask_slots)
    return (out, lse) if return_lse else out
