"""Eager grouped GEMM for MoE (`torch._grouped_mm` with offsets): the forward form (2-D a x 3-D b,
groups of tokens) and the weight-gradient form (2-D a x 2-D b, groups splitting the reduction).
Input checks, TMA views of the operands, one persistent launch over all groups. The group offsets
stay on the device: no host sync, so a call can be captured in a CUDA graph and replayed with new
routing."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from ..runtime import get_kernel
from .common import check_cuda, sm_count
from .common import tma_view as _tma_view

NAME = "grouped_mm"


@functools.lru_cache(maxsize=256)
def _grouped_kernel(problem, config, num_sms: int):
    from ..kernels.gemm import grouped_config, grouped_wgrad_config

    module = grouped_wgrad_config if isinstance(problem, grouped_wgrad_config.WgradProblem) else grouped_config
    return get_kernel(module.spec(problem, config, num_sms))


def _b_operand(b: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The kernel's (N, K, E) view of b (E, K, N) and its major mode: K-major (the transposed view
    of an (E, N, K) weight) or N-major as given, else a K-major copy."""
    for mode, major in ((1, "k"), (2, "n")):
        view = _tma_view(b, mode)
        if view is not None:
            return view.permute(2, 1, 0), major
    packed = b.transpose(1, 2).contiguous().transpose(1, 2)
    return _tma_view(packed, 1).permute(2, 1, 0), "k"


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None = None, *,
               config=None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g] (offs[-1] taken as 0), bf16 with fp32
    accumulation: a (tokens, K), b (groups, K, N), offs int32 (groups,) cumulative group ends.
    With a 2-D b, the weight-gradient form: see `grouped_mm_wgrad`.

    With `rows` (int32 or int64, (R,)), the product of a[rows] without the gathered copy: out (R, N)
    and offs split the R rows (the MoE permute: a the tokens, rows each routed row's token). A
    negative index counts from a's end, as in a[rows]; one outside a's rows stops the kernel with a
    CUDA error (a trap: "unspecified launch failure", which ends the CUDA context), as torch's
    device-side index check does. Index entries past offs[-1] are not read.

    Rows of `out` past offs[-1] are not written (left as they are; uninitialized when `out` is
    None). Offsets must be non-decreasing and at most `tokens`: they are read on the device only,
    so they are not checked."""
    if a.dim() == 2 and b.dim() == 2 and rows is None:
        return grouped_mm_wgrad(a, b, offs, out, config=config)
    return _grouped_forward(a, b, offs, out, config, gate="", rows=rows)


def grouped_mm_gated(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, activation: str = "silu",
                     out: torch.Tensor | None = None, *, config=None, rows: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The MoE up projection with its gate fused: b (groups, K, 2F) holds the gate columns, then
    the up columns (transformers' and torchtitan's fused gate_up weight, transposed), and

        out[offs[g-1]:offs[g]] = act(a_g @ b[g][:, :F]) * (a_g @ b[g][:, F:])     out (tokens, F)

    with fp32 products rounded once; the (tokens, 2F) product is never stored. `activation`: one
    of grouped_config.GATES (silu for SwiGLU). Otherwise (`rows` too) as `grouped_mm`."""
    if not activation:
        raise UnsupportedError(f"{NAME}_gated: an activation is required")
    return _grouped_forward(a, b, offs, out, config, gate=activation, rows=rows)


def grouped_mm_gate_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, gate: torch.Tensor,
                         up: torch.Tensor, activation: str = "silu", out: torch.Tensor | None = None, *,
                         config=None) -> torch.Tensor:
    """The MoE down projection's input gradient with the gate's backward fused: gate and up
    (tokens, F) are the up projection's saved product's halves (h.chunk(2, -1) of h = [gate | up]),
    and with y = the grouped product of a and b (tokens, F) as `grouped_mm` computes it (fp32,
    never stored)

        out[:, :F] = y * up * act'(gate),   out[:, F:] = y * act(gate)          out (tokens, 2F)

    the gradient of act(gate) * up (of h). `activation`: one of grouped_config.GATE_GRADS; F a
    multiple of 32. `out` must not share memory with gate or up (a group's last tile re-reads rows
    another tile may have stored). Otherwise as `grouped_mm`."""
    name = f"{NAME}_gate_grad"
    if not activation:
        raise UnsupportedError(f"{name}: an activation is required")
    check_cuda(name, a, gate, up)
    if out is not None and any(_shares_memory(out, t) for t in (gate, up)):
        raise UnsupportedError(f"{name}: out shares memory with gate or up")
    return _grouped_forward(a, b, offs, out, config, gate="", gate_grad=activation, halves=(gate, up))


def _shares_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def _row_index(name: str, rows: torch.Tensor) -> tuple[torch.Tensor, str]:
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise UnsupportedError(f"{name}: rows must be a 1-D int32 or int64 index, got {rows.dtype} of shape "
                               f"{tuple(rows.shape)}")
    return rows.contiguous(), str(rows.dtype).removeprefix("torch.")


def _grouped_forward(a, b, offs, out, config, gate: str, rows=None, gate_grad: str = "", halves=()) -> torch.Tensor:
    from ..kernels.gemm.grouped_config import GroupedProblem, default_config, unsupported_reason

    name = f"{NAME}_gated" if gate else f"{NAME}_gate_grad" if gate_grad else NAME
    check_cuda(name, a, b, offs, *(t for t in (out, rows) if t is not None))
    rows, rows_dtype = _row_index(name, rows) if rows is not None else (None, "")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise UnsupportedError(f"{name}: dtypes {a.dtype} and {b.dtype} are not supported (use bfloat16)")
    if a.dim() != 2 or b.dim() != 3:
        raise UnsupportedError(f"{name}: expected a (tokens, K) and b (groups, K, N), or a (M, tokens) and "
                               f"b (tokens, N), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    tokens, k = (rows.shape[0], a.shape[1]) if rows is not None else a.shape  # out's rows, the reduction
    groups, kb, n_b = b.shape
    n = n_b // 2 if gate else 2 * n_b if gate_grad else n_b  # output columns
    if kb != k:
        raise UnsupportedError(f"{name}: a has K={k} but b has K={kb}")
    if rows is not None and tokens and a.shape[0] == 0:
        raise UnsupportedError(f"{name}: rows index a's rows, but a has none")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] != groups:
        raise UnsupportedError(f"{name}: offs must be int32 of shape ({groups},), got {offs.dtype} "
                               f"of shape {tuple(offs.shape)}")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (tokens, n)):
        raise UnsupportedError(f"{name}: out must be bfloat16 of shape {(tokens, n)}, got {out.dtype} "
                               f"of shape {tuple(out.shape)}")
    for half in halves:
        if half.dtype != torch.bfloat16 or tuple(half.shape) != (tokens, n_b):
            raise UnsupportedError(f"{name}: gate and up must be bfloat16 of shape {(tokens, n_b)}, got "
                                   f"{half.dtype} of shape {tuple(half.shape)}")
    reason = unsupported_reason(GroupedProblem(gate=gate, rows=rows_dtype, gate_grad=gate_grad), config, n=n_b, k=k,
                                groups=groups)
    if reason:
        raise UnsupportedError(f"{name}: {reason}")
    a_view = _row_major(a)
    b_view, b_major = _b_operand(b)
    problem = GroupedProblem("bfloat16", "bfloat16", "k", b_major, gate, rows_dtype, gate_grad)
    if out is None:
        out = torch.empty(tokens, n, device=a.device, dtype=torch.bfloat16)
    out_view = _tma_view(out, 1)
    if out_view is None:
        raise UnsupportedError(f"{name}: out must be row-major with 16-byte aligned rows, got strides "
                               f"{tuple(out.stride())}")
    gate_view, up_view = (_row_major(t) for t in halves) if halves else (None, None)
    if tokens == 0:
        return out
    num_sms = sm_count(a.device.index or 0)
    config = config or default_config(problem, tokens, n_b, k, groups, num_sms)
    kernel = _grouped_kernel(problem, config, num_sms)
    kernel(a_view, b_view, offs.contiguous(), out_view, rows, gate_view, up_view)
    return out


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """`t` as a view with unit-stride rows 16 bytes aligned (TMA's, and the gate's gradient's plain
    loads' assumption), or a packed copy where it cannot be."""
    view = _tma_view(t, 1)
    return view if view is not None else _tma_view(t.clone(memory_format=torch.contiguous_format), 1)


def _operand(t: torch.Tensor, modes: tuple[tuple[int, str], ...]) -> tuple[torch.Tensor, str]:
    """A TMA view of 2-D `t` with the first of `modes` ((unit-stride mode, major) pairs) that
    fits in place, else a copy with the first mode contiguous."""
    for mode, major in modes:
        view = _tma_view(t, mode)
        if view is not None:
            return view, major
    mode, major = modes[0]
    fresh = (t.t() if mode == 0 else t).clone(memory_format=torch.contiguous_format)  # an aligned copy
    return _tma_view(fresh.t() if mode == 0 else fresh, mode), major


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None = None, *,
                     config=None) -> torch.Tensor:
    """out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g], :] (offs[-1] taken as 0), bf16 with
    fp32 accumulation: a (M, tokens), b (tokens, N), offs int32 (groups,) cumulative group ends
    over the tokens; out (groups, M, N). The weight gradient of an MoE layer: autograd of
    `_grouped_mm(x, w.transpose(-2, -1), offs)` asks for a = grad.t(), b = x.

    Every group's output is written, zeros for an empty one. Tokens past offs[-1] do not
    contribute; offsets must be non-decreasing (they are read on the device only, not checked;
    offsets past `tokens` count as `tokens`)."""
    from ..kernels.gemm.grouped_wgrad_config import WgradProblem, default_config, unsupported_reason

    check_cuda(NAME, a, b, offs, *([] if out is None else [out]))
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise UnsupportedError(f"{NAME}: dtypes {a.dtype} and {b.dtype} are not supported (use bfloat16)")
    if a.dim() != 2 or b.dim() != 2:
        raise UnsupportedError(f"{NAME}: expected a (M, tokens) and b (tokens, N), got shapes "
                               f"{tuple(a.shape)} and {tuple(b.shape)}")
    m, tokens = a.shape
    tokens_b, n = b.shape
    if tokens_b != tokens:
        raise UnsupportedError(f"{NAME}: a has {tokens} tokens but b has {tokens_b}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise UnsupportedError(f"{NAME}: offs must be 1-D int32, got {offs.dtype} of shape {tuple(offs.shape)}")
    groups = offs.shape[0]
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (groups, m, n)):
        raise UnsupportedError(f"{NAME}: out must be bfloat16 of shape {(groups, m, n)}, got {out.dtype} "
                               f"of shape {tuple(out.shape)}")
    reason = unsupported_reason(WgradProblem(), config, m=m, n=n, groups=groups)
    if reason:
        raise UnsupportedError(f"{NAME}: {reason}")
    if out is None:
        out = torch.empty(groups, m, n, device=a.device, dtype=torch.bfloat16)
    out_view = _tma_view(out, 2)
    if out_view is None:
        raise UnsupportedError(f"{NAME}: out must be row-major with 16-byte aligned rows, got strides "
                               f"{tuple(out.stride())}")
    if tokens == 0:  # no token descriptor to build: every group is empty
        return out.zero_()
    token_major = tokens % 8 == 0  # the kernel's contiguous extents are multiples of 16 bytes
    a_view, a_major = _operand(a, ((0, "m"), (1, "k"))[:1 + token_major])  # (M, tokens)
    b_view, b_major = _operand(b, ((1, "n"), (0, "k"))[:1 + token_major])  # (tokens, N)
    problem = WgradProblem("bfloat16", "bfloat16", a_major, b_major)
    num_sms = sm_count(a.device.index or 0)
    config = config or default_config(problem, m, n, tokens, groups, num_sms)
    kernel = _grouped_kernel(problem, config, num_sms)
    kernel(a_view, b_view.t(), offs.contiguous(), out_view.permute(1, 2, 0))
    return out
