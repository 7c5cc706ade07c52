"""Grouped GEMMs of mixture-of-experts layers (issue 14), forward, input and weight gradients: ours
(host.grouped_mm, eager) vs Inductor's grouped-mm Triton template vs eager torch._grouped_mm, bf16,
beside the matmul bound.

Per model, token count (4096, 16384) and routing, the two expert projections of the forward pass:
  up    (tokens * topk, hidden) x (E, hidden, 2 * ffn): gate and up fused
  down  (tokens * topk, ffn) x (E, ffn, hidden)
and their weight gradients (form "wgrad") as autograd asks for them: grad_out.t() (N, rows) x
x (rows, K) -> (E, N, K), the groups splitting the reduction over the routed rows; and, for
DeepSeek-V3 and Qwen3-30B-A3B (the issue's backward models), their input gradients (form "dgrad"):
grad_out (rows, N) x w (E, N, K) -> (rows, K), the forward form with N and K swapped, the weight
passed as autograd passes it: the transpose of the forward's transposed view, i.e. w itself
(N-major from the kernel's view, where the forward's operand is K-major).
The routed rows are sorted by expert; `offs` (int32, on the device) holds each expert's cumulative
end. Routing: `balanced` gives every expert tokens * topk / E rows; `skewed` draws each token's
topk distinct experts with Zipf popularity (exponent ZIPF_EXPONENT over a seeded shuffle of the
experts), EMPTY_FRACTION of the experts never chosen (empty groups).
Weights are held as torchtitan and nn.Linear hold them, (E, N, K) row-major, and passed as their
transposed (E, K, N) view (K-major), scaled by 1/sqrt(K) so outputs are O(1).

Runners (same a, b, offs):
  inductor_cute  as users get it: torch.compile(torch._grouped_mm) with inductor_cute.enable(),
                 max-autotune-no-cudagraphs with max_autotune_gemm_backends="ICUTE": our configs,
                 autotuned like Triton's below; where that compile holds no call of ours (or fails),
                 the eager call below instead, with a note
  inductor_cute_default  host.grouped_mm (ops.grouped_mm), eager, its heuristic default config
                 (in notes)
  triton         torch.compile(torch._grouped_mm), max-autotune-no-cudagraphs with
                 max_autotune_gemm_backends="TRITON": Inductor's grouped-mm template, autotuned
                 (on its own evenly split offsets), cold caches; left out with a note where it
                 fails or its output code holds no Triton template
  aten           eager torch._grouped_mm (CUTLASS); the harness checks the others against it
flops: 2 * tokens * topk * N * K (every routed row, whatever the routing). Bytes, forward: a, the
weights of the experts that have rows (an empty group's weight need not be read) and the output,
once (dgrad likewise, grad_out for a); wgrad: both token operands and every expert's gradient
(zeros for an empty one), once.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ..case import Case, named

TOKENS = (4096, 16384)
ROUTINGS = ("balanced", "skewed")
FORMS = ("fwd", "wgrad", "dgrad")
PROJECTIONS = ("up", "down")
ZIPF_EXPONENT = 1.0
EMPTY_FRACTION = 1 / 8  # of the experts, at least one, get no token in skewed routing
SEED = 0


@dataclass(frozen=True)
class MoeModel:
    name: str
    experts: int
    topk: int
    hidden: int
    ffn: int  # one expert's intermediate size


MODELS = [
    MoeModel("DeepSeek-V3", 256, 8, 7168, 2048),
    MoeModel("Qwen3-30B-A3B", 128, 8, 2048, 768),
    MoeModel("Qwen3-235B-A22B", 128, 8, 4096, 1536),
    MoeModel("Mixtral-8x7B", 8, 2, 4096, 14336),
    MoeModel("gpt-oss-120b", 128, 4, 2880, 2880),
]
_MODEL = {m.name: m for m in MODELS}


@dataclass(frozen=True)
class Grouped:
    model: MoeModel
    projection: str  # up, down
    tokens: int
    routing: str  # balanced, skewed
    form: str = "fwd"  # or "wgrad", "dgrad": the projection's weight or input gradient

    @property
    def name(self) -> str:
        return f"{self.model.name} {self.form} {self.projection} T{self.tokens} {self.routing}"

    @property
    def rows(self) -> int:
        return self.tokens * self.model.topk

    @property
    def n_k(self) -> tuple[int, int]:
        """The GEMM's (N, K): the forward's output and reduction dims (wgrad's output (E, N, K));
        swapped for dgrad, which reduces over the forward's N and outputs its K."""
        m = self.model
        n, k = (2 * m.ffn, m.hidden) if self.projection == "up" else (m.hidden, m.ffn)
        return (k, n) if self.form == "dgrad" else (n, k)


DGRAD_MODELS = ("DeepSeek-V3", "Qwen3-30B-A3B")
CASES = [Grouped(m, proj, t, r, form) for form in FORMS for m in MODELS for t in TOKENS for r in ROUTINGS
         for proj in PROJECTIONS if form != "dgrad" or m.name in DGRAD_MODELS]
QUICK = [Grouped(_MODEL["DeepSeek-V3"], "up", 16384, "balanced"),
         Grouped(_MODEL["Qwen3-30B-A3B"], "up", 16384, "skewed"),
         Grouped(_MODEL["Mixtral-8x7B"], "up", 4096, "balanced"),
         Grouped(_MODEL["Qwen3-30B-A3B"], "up", 16384, "skewed", "wgrad"),
         Grouped(_MODEL["DeepSeek-V3"], "down", 4096, "balanced", "wgrad"),
         Grouped(_MODEL["DeepSeek-V3"], "up", 16384, "skewed", "dgrad")]


def balanced_sizes(tokens: int, topk: int, experts: int) -> list[int]:
    """Rows per expert when the tokens * topk routed rows are spread evenly (the first experts take
    one more where they do not divide)."""
    rows = tokens * topk
    return [rows // experts + (e < rows % experts) for e in range(experts)]


def skewed_sizes(tokens: int, topk: int, experts: int, seed: int = SEED) -> list[int]:
    """Rows per expert when each token picks topk distinct experts with Zipf popularity: expert of
    rank r (a seeded shuffle) drawn with weight r^-ZIPF_EXPONENT, the last EMPTY_FRACTION of the
    ranks (at least one expert, leaving at least topk) with weight 0."""
    g = torch.Generator().manual_seed(seed)
    empty = min(max(1, round(experts * EMPTY_FRACTION)), experts - topk)
    weight = torch.arange(1, experts + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    weight[experts - empty:] = 0
    probs = torch.empty(experts, dtype=torch.float64)
    probs[torch.randperm(experts, generator=g)] = weight  # rank r's weight to a shuffled expert
    picks = torch.multinomial(probs.expand(tokens, experts), topk, replacement=False, generator=g)
    return torch.bincount(picks.flatten(), minlength=experts).tolist()


def group_sizes(case: Grouped) -> list[int]:
    m = case.model
    if case.routing == "balanced":
        return balanced_sizes(case.tokens, m.topk, m.experts)
    return skewed_sizes(case.tokens, m.topk, m.experts)


def offsets(sizes: list[int], device="cpu") -> torch.Tensor:
    """int32 cumulative group ends, as torch._grouped_mm takes them."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def cost(case: Grouped, sizes: list[int]) -> tuple[int, int]:
    """(flops, bytes), bf16: a, the weights of the experts with rows, and the output; wgrad: both
    token operands and every expert's gradient."""
    n, k = case.n_k
    if case.form == "wgrad":
        return 2 * case.rows * n * k, 2 * (case.rows * (k + n) + len(sizes) * k * n)
    used = sum(1 for s in sizes if s)
    return 2 * case.rows * n * k, 2 * (case.rows * k + used * k * n + case.rows * n)


def make_inputs(case: Grouped, sizes: list[int], device="cuda", seed: int = SEED):
    """a (rows, K), b (E, K, N) the transposed view of an (E, N, K) weight, offs int32 (E,); wgrad:
    a = grad_out.t() (N, rows), b = x (rows, K); dgrad (N, K the GEMM's): a = grad_out (rows, K),
    b = w (E, K, N) contiguous, the transpose of the forward's view; as autograd passes them."""
    n, k = case.n_k
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(case.rows, k, generator=g, device=device, dtype=torch.bfloat16)
    if case.form == "wgrad":
        grad = torch.randn(case.rows, n, generator=g, device=device, dtype=torch.bfloat16)
        return grad.mul_(case.rows ** -0.5).t(), a, offsets(sizes, device)
    if case.form == "dgrad":  # w (E, N_fwd, K_fwd) = (E, K, N) here, the reduction over its dim 1
        weight = torch.randn(case.model.experts, k, n, generator=g, device=device, dtype=torch.bfloat16)
        return a, weight.mul_(k ** -0.5).transpose(1, 2).transpose(1, 2), offsets(sizes, device)
    weight = torch.randn(case.model.experts, n, k, generator=g, device=device, dtype=torch.bfloat16)
    weight.mul_(k ** -0.5)
    return a, weight.transpose(1, 2), offsets(sizes, device)


def _grouped_mm(a, b, offs):
    return torch._grouped_mm(a, b, offs)


# Inductor's grouped-mm template faulted (an illegal memory access during its autotuning, which
# loses the process's CUDA context) on DeepSeek-V3's wgrad at 4096 tokens, whose output has
# 256 x 7168 x 2048 = 3.8e9 elements, on torch 2.11 / Triton 3.6 (H200, 2026-12-03); its other
# cases (outputs below 2^31 elements) ran. Probably 32-bit output indexing: not timed past it.
TRITON_MAX_OUTPUT_ELEMENTS = 2**31 - 1


def triton_runner(a, b, offs):
    """(runner or None, note): the grouped-mm Triton template, compiled and autotuned now."""
    from ...errors import first_line
    from .gemm_compiled import compile_now

    rows = offs.numel() * a.shape[0] if b.dim() == 2 else a.shape[0]  # wgrad's output is (E, M, N)
    if rows * b.shape[-1] > TRITON_MAX_OUTPUT_ELEMENTS:
        return None, (f"triton omitted: its template faulted on outputs of 2^31 elements or more (this one: "
                      f"{rows * b.shape[-1]:.2e})")
    try:
        c = compile_now(_grouped_mm, (a, b, offs), mode="max-autotune-no-cudagraphs", ours=False, backends="TRITON")
    except Exception as e:  # no valid Triton choice, or a compile failure
        return None, f"triton omitted: {first_line(e)[:200]}"
    if "triton_tem_" not in c.code:
        return None, "triton omitted: the compiled code holds no Triton template (Inductor fell back)"
    return c.run, f"triton: Inductor's grouped-mm template, compile and autotune {c.seconds:.1f} s"


# our grouped GEMM under torch.compile (inductor/grouped/): one launcher definition per call site (the
# module path alone would also count the output code's import of it)
GROUPED_CALL = "inductor_cute.inductor.grouped.runtime.GroupedLauncher("
# the fused MoE ops as fallback kernels (grouped/gate.py, grouped/gather.py), and torch's unfused
# computation where their autotuning picked it (runtime.grouped_mm_unfused)
FUSED_OP_CALLS = ("torch.ops.inductor_cute.grouped_mm_gated.default(", "torch.ops.inductor_cute.grouped_mm_rows.default(")
UNFUSED_CALL = "extern_kernels.inductor_cute_grouped_mm_unfused("
_GATED_LAUNCHER = re.compile(r"GroupedLauncher\(config=\([^)]*\), activation='\w+'\)")
_GATED_ROWS_OP = re.compile(r"grouped_mm_rows\.default\(.*'\w+'\)")


def gated_sites(code: str) -> int:
    """Call sites of the fused MoE gate in output code: a gated GroupedLauncher (one of its grouped
    GEMM sites too), or the gate's op (or the gathered op with an activation) as a fallback kernel."""
    return (len(_GATED_LAUNCHER.findall(code)) + code.count(FUSED_OP_CALLS[0])
            + len(_GATED_ROWS_OP.findall(code)))


def gathered_sites(code: str) -> int:
    """Call sites of the gathered rows' grouped GEMM: a launcher calling launch_rows, or its op."""
    return code.count(".launch_rows\n") + code.count(FUSED_OP_CALLS[1])


def tuned_runner(a, b, offs):
    """(runner or None, note): our configs as torch.compile with enable() autotunes them, and only
    ours (the stock choices left out), compiled now."""
    from ...errors import first_line
    from .gemm_compiled import compile_now

    try:
        c = compile_now(_grouped_mm, (a, b, offs), mode="max-autotune-no-cudagraphs", ours=True, backends="ICUTE")
    except Exception as e:  # no valid choice of ours, or a compile failure
        return None, f"inductor_cute tuned omitted: {first_line(e)[:200]}"
    if GROUPED_CALL not in c.code:
        return None, "inductor_cute tuned omitted: the compiled code holds no call of ours (Inductor fell back)"
    return c.run, f"inductor_cute: our configs autotuned under torch.compile, compile and autotune {c.seconds:.1f} s"


def _b_major(case: Grouped) -> str:
    """b's contiguous mode as the kernel sees it: K for the forward's transposed weight view, N for
    dgrad's weight as held and wgrad's tokens."""
    return "k" if case.form == "fwd" else "n"


def _default_config_note(case: Grouped) -> str:
    from ...host.common import sm_count
    from ...kernels.gemm import grouped_wgrad_config
    from ...kernels.gemm.grouped_config import GroupedProblem, default_config

    n, k = case.n_k
    if case.form == "wgrad":
        cfg = grouped_wgrad_config.default_config(grouped_wgrad_config.WgradProblem(), n, k, case.rows,
                                                  case.model.experts, sm_count(0))
    else:
        cfg = default_config(GroupedProblem(b_major=_b_major(case)), case.rows, n, k, case.model.experts,
                             sm_count(0))
    return f"ours default config {cfg.describe()}"


def _case(case: Grouped) -> Case:
    from ...host.grouped_gemm import grouped_mm

    torch._dynamo.reset()
    sizes = group_sizes(case)
    a, b, offs = make_inputs(case, sizes)
    flops, n_bytes = cost(case, sizes)
    triton, triton_note = triton_runner(a, b, offs)
    tuned, tuned_note = tuned_runner(a, b, offs)
    eager = lambda: grouped_mm(a, b, offs)  # noqa: E731
    n, k = case.n_k
    empty = sum(1 for s in sizes if s == 0)
    notes = [f"{case.model.experts} groups: rows min {min(sizes)} mean {case.rows / len(sizes):.0f} max {max(sizes)}, "
             f"{empty} empty", _default_config_note(case), tuned_note, triton_note]
    m = case.model
    return Case(
        name=case.name,
        params={"model": m.name, "experts": m.experts, "topk": m.topk, "hidden": m.hidden, "ffn": m.ffn,
                "projection": case.projection, "tokens": case.tokens, "routing": case.routing, "M": case.rows,
                "N": n, "K": k, "empty_groups": empty, "max_group": max(sizes), "form": case.form,
                "b_major": _b_major(case), "dtype": "bfloat16"},
        flops=flops, bytes=n_bytes, matmul=True, notes=notes,
        runners={"inductor_cute": tuned or eager, "inductor_cute_default": eager, "triton": triton,
                 "aten": lambda: torch._grouped_mm(a, b, offs)},
    )


def cases(quick: bool):
    return [named(functools.partial(_case, c), c.name) for c in (QUICK if quick else CASES)]
