"""Eager GEMM entry points (mm, bmm): input checks, TMA views of the operands, the WGMMA GEMM or
the decode GEMV, and a fast path for repeated calls; gemv_shared_a: the decode GEMV over several
weights that share A, in one launch."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..runtime import get_kernel
from .common import ALIGN_BYTES, DTYPE_NAMES, check_cuda, sm_count, stream_scratch
from .common import alias as _alias
from .common import tma_view as _tma_view

_GEMM_INPUT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


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
    from ..kernels.gemm import family

    return get_kernel(family.spec(problem, config, num_sms))


def _gemv_workspace(device, sizes: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's split-K partials and arrival counters, reused call after call (common.
    stream_scratch): partials are written before they are read within a launch, and the kernel's
    last CTA on each N block sets its counter back to zero. Without a split the kernel touches
    neither, so every stream shares them."""
    n_partials, n_counters, split = sizes
    return stream_scratch(device, (((n_partials,), torch.float32, False), ((n_counters,), torch.int32, True)),
                          per_stream=split)


def _prepare_gemm(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config=None, epilogue=""):
    """Checks and TMA views for one GEMM: ((problem, config, num_sms), kernel arguments, out);
    the plan and arguments are None when the output is empty."""
    from ..kernels.gemm import family
    from ..kernels.gemm.config import GemmProblem
    from ..kernels.gemm.gemv_config import GemvConfig, splits, workspace_sizes

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
    error = family.unsupported_reason(problem)
    if error:
        raise UnsupportedError(f"{name}: {error}")
    num_sms = sm_count(a.device.index or 0)
    if config is None:
        config = family.default_config(problem, m, n, k, batch, num_sms)
    else:
        error = family.unsupported_reason(problem, config, m=m, n=n, k=k, batch=batch)
        if error:
            raise UnsupportedError(f"{name}: config {config} cannot run this problem: {error}")
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
    check_cuda(name, a, b, *(t for t in (bias, c, out) if t is not None))
    if name == "mm":
        if a.dim() != 2 or b.dim() != 2:
            raise UnsupportedError(f"mm: expected 2-D tensors, got {a.dim()}-D and {b.dim()}-D")
        return (a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0) if c is not None and c.dim() == 2 else c,
                out.unsqueeze(0) if out is not None else None)
    if a.dim() != 3 or b.dim() != 3:
        raise UnsupportedError(f"bmm: expected 3-D tensors, got {a.dim()}-D and {b.dim()}-D")
    return a, b, c, out


class GemmLaunch:
    """A checked GEMM call reduced to what repeating it needs; it holds no tensor. `operands`
    says where each tensor argument of the kernel (A, B, D, C, bias) comes from: None (absent),
    (i, None, None) for the caller's `sources[i]` itself (its layout already is the kernel's), or
    (i, sizes, strides) for that view of `sources[i]` from its own storage offset (as_strided's,
    taken without the dispatcher). Then the GEMV's workspace (fresh), then the scalars. Valid only for sources of
    the layouts it was made from (shapes, strides, dtypes, device, 16-byte alignment): callers key
    it on them."""

    __slots__ = ("kernel", "operands", "scalars", "workspace", "device")

    def __init__(self, kernel, operands: tuple, scalars: tuple, workspace: tuple | None, device) -> None:
        self.kernel, self.operands, self.scalars = kernel, operands, scalars
        self.workspace, self.device = workspace, device

    def arguments(self, sources) -> list:
        """The kernel's arguments for these sources, a fresh workspace included."""
        args = []
        for op in self.operands:
            if op is None:
                args.append(None)
            elif op[1] is None:
                args.append(sources[op[0]])
            else:
                args.append(_alias(sources[op[0]], op[1], op[2], 0))
        if self.workspace is not None:
            args += _gemv_workspace(self.device, self.workspace)
        args += self.scalars
        return args

    def __call__(self, sources) -> None:
        self.kernel(*self.arguments(sources))


def _in_place(view: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `view` reads `t`'s memory from `t`'s own start, so that a view of `t` remakes it."""
    return (view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            and view.storage_offset() == t.storage_offset() and view.dtype == t.dtype)


def _launch_of(kernel, kernel_args: tuple, workspace, sources: tuple, origins: tuple) -> GemmLaunch | None:
    """The GemmLaunch that repeats `kernel(*kernel_args)` on `sources`; `origins[j]` is the index in
    `sources` of the tensor that kernel argument j (A, B, D, C, bias) was made from. None when an
    argument is not a view of its source (a copy: misaligned, cast, or a layout TMA cannot read)."""
    operands = []
    for arg, origin in zip(kernel_args[:5], origins):
        if arg is None:
            operands.append(None)
            continue
        source = sources[origin] if origin is not None else None
        if not isinstance(source, torch.Tensor) or not _in_place(arg, source):
            return None
        same = arg.shape == source.shape and arg.stride() == source.stride()
        operands.append((origin, None, None) if same else (origin, tuple(arg.shape), tuple(arg.stride())))
    return GemmLaunch(kernel, tuple(operands), tuple(kernel_args[5:]), workspace, kernel_args[2].device)


def _checked(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config, epilogue):
    """One GEMM through every check, launched: (result, (kernel, kernel arguments, workspace)),
    the second None when the output is empty (nothing to launch)."""
    a3d, b3d, c3d, out3 = _batched(name, a, b, bias, c, out)
    plan, kernel_args, out3 = _prepare_gemm(name, a3d, b3d, bias, c3d, alpha, beta, activation, out_dtype, out3, config,
                                            epilogue)
    result = out3[0] if name == "mm" else out3
    if plan is None:
        return result, None
    kernel = _gemm_kernel(*plan[:3])
    _launch(kernel, kernel_args, plan[3], out3.device)
    return result, (kernel, kernel_args, plan[3])


def run_checked(name: str, a, b, *, bias, c, alpha, beta, activation: str = "identity", out, config, epilogue: str,
                sources: tuple, origins: tuple) -> GemmLaunch | None:
    """`name` ("mm" or "bmm") into `out` through every check that mm/bmm make, then the GemmLaunch
    that repeats it on `sources` (the caller's tensors, `out` among them; `origins` as for
    _launch_of, in the order A, B, D, C, bias), or None where it cannot (an operand was copied,
    or the output is empty). Raises UnsupportedError as mm/bmm do."""
    _, launched = _checked(name, a, b, bias, c, alpha, beta, activation, None, out, config, epilogue)
    return _launch_of(*launched, sources, origins) if launched is not None else None


# Eager calls whose checks passed and whose kernel operands are views of the caller's tensors are
# remembered by their arguments' layouts, so a repeat (a training step, a decode loop) skips the
# checks: a layout key, the views and the kernel call. With out=None the output is allocated from
# the remembered shape. Calls that copied an operand are not remembered. gemv_shared_a keeps its
# plans here too, under keys that start with its name.
_FAST_PATHS: dict[tuple, tuple] = {}
_FAST_PATHS_MAX = 4096
_EAGER_ORIGINS = (0, 1, 4, 2, 3)  # kernel A, B, D, C, bias from (a, b, c, bias, out)


def _layout(t):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):  # never remembered: the checks will refuse it
        return ("not a tensor", id(t))
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % ALIGN_BYTES == 0)


def _gemm(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config=None, epilogue=""):
    key = (name, _layout(a), _layout(b), _layout(c), _layout(bias), _layout(out), alpha, beta, activation,
           out_dtype, config, epilogue)
    hit = _FAST_PATHS.get(key)
    if hit is not None:
        launch, out_shape, result_dtype = hit
        if out is None:
            out = torch.empty(out_shape, device=launch.device, dtype=result_dtype)
        launch((a, b, c, bias, out))
        return out
    result, launched = _checked(name, a, b, bias, c, alpha, beta, activation, out_dtype, out, config, epilogue)
    if launched is not None:
        launch = _launch_of(*launched, (a, b, c, bias, result), _EAGER_ORIGINS)
        if launch is not None:
            if len(_FAST_PATHS) >= _FAST_PATHS_MAX:
                _FAST_PATHS.clear()
            _FAST_PATHS[key] = (launch, tuple(result.shape), result.dtype)
    return result


def mm(a, b, *, bias=None, c=None, alpha=1.0, beta=None, activation="identity", out_dtype=None, out=None,
       config=None, epilogue=""):
    """D = activation(alpha * a @ b + bias + beta * c) for 2-D a (M, K) and b (K, N).

    bf16/fp16 inputs, fp32 accumulation, output in `out_dtype` (default: a's dtype). Any layout
    of a and b is accepted (nn.Linear weights as `w.t()` are read in place); `c` broadcasts to
    (M, N) and `beta` defaults to 1 when it is given; `bias` has shape (N,). M <= 16 against a
    K-major b (an nn.Linear weight) runs the decode GEMV, anything else the WGMMA GEMM; `config`
    (a kernels.gemm.config.GemmConfig or kernels.gemm.gemv_config.GemvConfig) overrides that choice
    and its configuration. `epilogue` (a
    kernels.common.programs.epilogue text) replaces alpha/beta/activation: the program computes the output
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
    a3d, b3d, c3d, out3 = _batched(name, a, b, bias, c, out)
    plan, _, _ = _prepare_gemm(name, a3d, b3d, bias, c3d, alpha, beta, activation, out_dtype, out3, config, epilogue)
    if plan is None:
        raise UnsupportedError(f"{name}: an empty output needs no kernel")
    return plan[:3]


def gemm_spec_for(a, b, **kwargs):
    """The KernelSpec that `mm` or `bmm` would run on these inputs (same arguments), for precompiling."""
    from ..kernels.gemm import family

    return family.spec(*gemm_plan(a, b, **kwargs))


def _gemv_shared_a_plan(a, weights: tuple, config):
    """Checks for gemv_shared_a: (kernel, N of each weight, A's strides for the kernel or None for
    its own, workspace sizes); the kernel is None when M is 0."""
    from ..kernels.gemm import gemv_config
    from ..kernels.gemm.config import GemmProblem

    name = "gemv_shared_a"
    if (not isinstance(weights, tuple) or not 1 <= len(weights) <= gemv_config.MAX_WEIGHTS
            or not all(isinstance(w, torch.Tensor) for w in weights)):
        raise UnsupportedError(f"{name}: expected a list of 1 to {gemv_config.MAX_WEIGHTS} weight tensors")
    check_cuda(name, a, *weights)
    if a.dtype not in _GEMM_INPUT or any(w.dtype != a.dtype for w in weights):
        raise UnsupportedError(f"{name}: A and every weight must be bfloat16 or float16 alike, got "
                               f"{a.dtype} and {', '.join(str(w.dtype) for w in weights)}")
    if a.dim() != 2 or any(w.dim() != 2 for w in weights):
        raise UnsupportedError(f"{name}: expected a 2-D A (M, K) and 2-D weights (N, K)")
    (m, k), ns = a.shape, tuple(w.shape[0] for w in weights)
    if any(w.shape[1] != k for w in weights):
        raise UnsupportedError(f"{name}: every weight must have K={k} columns, got "
                               f"{', '.join(str(tuple(w.shape)) for w in weights)}")
    problem = GemmProblem(_GEMM_INPUT[a.dtype], _GEMM_INPUT[a.dtype], "k", "k")
    if m == 0:
        return None, ns, None, None
    error = gemv_config.unsupported_reason(problem, config, m=m, n=ns, k=k, weights=len(weights))
    if error:  # (a config of more token tiles takes M past the default's 16)
        raise UnsupportedError(f"{name}: {error}" if config is None else
                               f"{name}: config {config} cannot run this problem: {error}")
    a_view = _tma_view(a, 1)
    if a_view is None or any(_tma_view(w, 1) is None for w in weights):
        raise UnsupportedError(f"{name}: A and the weights need contiguous rows (unit column stride) with "
                               "16-byte aligned starts and row strides")
    if config is None:
        config = gemv_config.default_config(problem, m, ns, k, num_sms=sm_count(a.device.index or 0))
    kernel = get_kernel(gemv_config.spec(problem, config, weights=len(weights)))
    n_partials, n_counters = gemv_config.workspace_sizes(ns, k, config)
    a_strides = None if a_view.stride() == a.stride() else a_view.stride()  # M = 1: any row stride
    return kernel, ns, a_strides, (n_partials, n_counters, gemv_config.splits(k, config) > 1)


def gemv_shared_a(a, weights, *, config=None) -> list:
    """[a @ w.t() for w in weights] in one launch, for 1 to 3 nn.Linear weights (N_i, K) that
    share the activation a (M, K) of a decode step (M <= 16): the q/k/v or gate/up projections
    cost one launch's ramp instead of one each, with no copy of the weights. bf16/fp16 alike,
    fp32 accumulation, outputs (M, N_i) in a's dtype; rows contiguous and 16-byte aligned, N_i and
    K multiples of 8. `config` (a kernels.gemm.gemv_config.GemvConfig) overrides the default,
    which is the single GEMV's heuristic for the summed N."""
    weights = tuple(weights) if isinstance(weights, (list, tuple)) else weights
    key = ("gemv_shared_a", _layout(a), tuple(_layout(w) for w in weights) if isinstance(weights, tuple) else None,
           config)
    plan = _FAST_PATHS.get(key)
    if plan is None:
        plan = _gemv_shared_a_plan(a, weights, config)
        if len(_FAST_PATHS) >= _FAST_PATHS_MAX:
            _FAST_PATHS.clear()
        _FAST_PATHS[key] = plan
    kernel, ns, a_strides, workspace = plan
    m = a.shape[0]
    outs = [torch.empty(m, n, device=a.device, dtype=a.dtype) for n in ns]
    if kernel is not None:
        a_arg = a if a_strides is None else _alias(a, tuple(a.shape), a_strides, 0)
        w_arg, d_arg = (weights[0], outs[0]) if len(weights) == 1 else (weights, tuple(outs))
        kernel(a_arg, w_arg, d_arg, None, None, *_gemv_workspace(a.device, workspace), 1.0, 0.0)
    return outs
