"""A mixture-of-experts block written with torch._grouped_mm, as MoE training code writes it (issue
14): Qwen3-30B-A3B's expert layer (hidden 2048, 128 experts, top-8, expert FFN 768, no shared
expert), bf16 parameters. The models suite runs it forward and as a training step, stock
torch.compile against torch.compile with inductor-cute enabled (models._moe_case builds the cases).

The forward, for tokens x (T, hidden):
  route     logits = x @ router^T in x's dtype (Qwen3's gate), softmax in fp32, top-k, the k weights
            renormalised to sum to 1 (Qwen3's norm_topk_prob)
  permute   the T*k (token, slot) pairs sorted by expert (a stable argsort of the flattened expert
            ids); x's rows gathered in that order
  offsets   rows per expert counted into a fixed-length vector, cumulative, int32
  experts   grouped_mm(rows, w_gate_up^T) -> [gate | up]; silu(gate) * up; grouped_mm(h, w_down^T)
  combine   every row back at its (token, slot) place, scaled by its router weight, the k slots of
            a token summed in fp32
The weights are held as nn.Linear holds its weight, (E, out, in), and passed to torch._grouped_mm as
their transposed (E, in, out) views. `MoeBlock.grouped_mm` is the one place the grouped matmul
happens, so a test or a reference can swap in `looped_grouped_mm`.

Routing is a seeded random router (weights N(0, 1/hidden)) over N(0, 1) tokens: every expert gets
about T*k/E rows, give or take the sampling spread (the notes give min, mean, max).

Correctness: every runner's output (and for a training step, every gradient) against `reference`,
an fp32 per-expert loop over the same routing (the block's own bf16 router logits, as eager computes
them: bf16 logits tie at the k-th place for a few % of the tokens, and only the experts' arithmetic
should be judged). A compiled router matmul that rounds a logit differently can still move a token or
two to another expert; that shows as a small error in every compiled runner alike.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .grouped_gemm import MODELS, MoeModel

QWEN3_30B_A3B = next(m for m in MODELS if m.name == "Qwen3-30B-A3B")
MODEL_NAME = "qwen3-30b-a3b"
CASES = [("fwd", 4096, "nocg"), ("fwd", 16384, "nocg"), ("train", 4096, "nocg")]  # (step, tokens, mode key)
SEED = 0


def case_name(step: str, tokens: int, mode_key: str) -> str:
    return f"{MODEL_NAME} moe-block {step} T{tokens} {mode_key}"


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 (T, k) summing to 1 per token, expert ids int64 (T, k)) from router logits."""
    weights, experts = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def expert_offsets(flat_experts: torch.Tensor, experts: int) -> torch.Tensor:
    """int32 cumulative end of each expert's rows, as torch._grouped_mm takes `offs`. The count is
    a scatter-add into a vector of fixed length: torch.bincount's length depends on the data, which
    torch.compile cannot trace without breaking the graph."""
    counts = torch.zeros(experts, dtype=torch.int32, device=flat_experts.device)
    counts = counts.scatter_add(0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32))
    return counts.cumsum(0, dtype=torch.int32)


def looped_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs) for 2-D a, 3-D b, one matmul per group."""
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out


class MoeBlock(nn.Module):
    """The routed experts of one Qwen3-MoE layer, run as two grouped GEMMs (module docstring)."""

    def __init__(self, model: MoeModel = QWEN3_30B_A3B, device="cpu", dtype=torch.bfloat16, seed: int = SEED):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)

        def param(*size: int) -> nn.Parameter:  # N(0, 1/fan_in): O(1) outputs from O(1) inputs
            w = torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5
            return nn.Parameter(w.to(dtype))

        e, h, f = model.experts, model.hidden, model.ffn
        self.model = model
        self.top_k = model.topk
        self.router = param(e, h)
        self.w_gate_up = param(e, 2 * f, h)  # per expert: gate rows, then up rows
        self.w_down = param(e, h, f)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.router), self.top_k)

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offs)

    def experts(self, rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = self.grouped_mm(rows, self.w_gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
        return self.grouped_mm(F.silu(gate) * up, self.w_down.transpose(1, 2), offs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        flat = experts.flatten()  # pair p = token * k + slot
        order = torch.argsort(flat, stable=True)  # sorted row j holds pair order[j]
        offs = expert_offsets(flat, self.model.experts)
        rows = self.experts(x[order // k], offs)
        # where each pair's row went: a gather brings the rows back into (token, slot) order
        place = torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))
        pairs = rows[place].view(tokens, k, -1)
        return (pairs.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def forward_and_loss(block: MoeBlock, x: torch.Tensor):
    """What a training step compiles: the block and the loss on its output."""
    out = block(x)
    return out, loss_of(out)


def run_block(block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """What a forward step compiles."""
    return block(x)


def make_inputs(tokens: int, train: bool, device="cuda", model: MoeModel = QWEN3_30B_A3B):
    """(block, x): seeded parameters and N(0, 1) bf16 tokens; both require grad for training."""
    block = MoeBlock(model, device=device).requires_grad_(train)
    gen = torch.Generator(device=device).manual_seed(SEED + 1)
    x = torch.randn(tokens, model.hidden, generator=gen, device=device).to(torch.bfloat16)
    return block, x.requires_grad_(train)


def reference(block: MoeBlock, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    """(output fp32, {name: fp32 gradient of loss_of(output)} for the parameters and "x" when
    `train`, else {}), by a loop over experts in fp32: each expert's (token, slot) pairs through its
    FFN, added into their tokens. Routing as the block routes (its own router logits, evaluated
    eagerly); the gradient reaches the router through fp32 logits."""
    params = {name: p.detach().float().requires_grad_(train) for name, p in block.named_parameters()}
    x32 = x.detach().float().requires_grad_(train)
    with torch.set_grad_enabled(train):
        logits = F.linear(x32, params["router"])
        with torch.no_grad():
            as_block = F.linear(x.detach(), block.router.detach()).float()
        weights, experts = route(logits + (as_block - logits).detach(), block.top_k)
        out = torch.zeros_like(x32)
        for e in range(block.model.experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = (x32[token] @ params["w_gate_up"][e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ params["w_down"][e].T
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
        if not train:
            return out, {}
        loss_of(out).backward()
    grads = {name: p.grad for name, p in params.items()}
    grads["x"] = x32.grad
    return out.detach(), grads


def rows_per_expert(block: MoeBlock, x: torch.Tensor) -> list[int]:
    with torch.no_grad():
        _, experts = block.route(x)
        offs = expert_offsets(experts.flatten(), block.model.experts)
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def routing_note(sizes: list[int]) -> str:
    return (f"routing: seeded random router over N(0,1) tokens, rows per expert min {min(sizes)} "
            f"mean {sum(sizes) / len(sizes):.0f} max {max(sizes)}, {sizes.count(0)} empty")


def cost(model: MoeModel, tokens: int, touched: int, train: bool) -> tuple[float, float]:
    """(flops, bytes) of a step. flops: the experts' matmuls, 2 * T * k * 3 * hidden * ffn forward,
    3x that for a training step (the router's 2 * T * hidden * E, under 1 % of it, left out).
    bytes (bf16): the router and the `touched` experts' weights read once, x read and the output
    written; a training step also writes those weights' gradients and x's gradient."""
    flops = 2 * tokens * model.topk * 3 * model.hidden * model.ffn
    weights = model.experts * model.hidden + touched * 3 * model.hidden * model.ffn
    if not train:
        return float(flops), float(2 * (weights + 2 * tokens * model.hidden))
    return float(3 * flops), float(2 * (2 * weights + 3 * tokens * model.hidden))


# ------------------------------------------------------------------------------------- runners

@dataclass
class Runner:
    """One backend's step on the case's block and tokens: `run()` does a step and returns the output."""

    run: Callable
    out: torch.Tensor  # of the first step
    grads: dict = field(default_factory=dict)  # after the first step (training): name -> gradient
    seconds: float = 0.0  # the first step (compiled: dynamo, lowering, autotuning, kernel compiles)
    code: str = ""  # Inductor's output code (forward and backward graphs)


def _forward_step(fn, block, x):
    with torch.no_grad():
        return fn(block, x)


def _train_step(fn, block, x):
    """Forward and backward of loss_of(output), gradients set to None first; the output."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    out, loss = fn(block, x)
    loss.backward()
    return out.detach()


def _grads(block, x) -> dict:
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    grads["x"] = x.grad.clone()
    return grads


def make_runner(step: str, block: MoeBlock, x: torch.Tensor, mode: str, backend: str,
                enable_kwargs: dict | None = None) -> Runner:
    """The backend's runner: `aten` eager, `triton` stock torch.compile in `mode`, `inductor_cute`
    the same with inductor_cute.enable(**enable_kwargs). Compiled runners compile at their first step, inside their
    own config with cold Inductor caches (so for a training step the backward graph too), and must
    not compile again later (they would compile outside that config): checked."""
    train = step == "train"
    fn, do_step = (forward_and_loss, _train_step) if train else (run_block, _forward_step)
    if backend == "aten":
        start = time.perf_counter()
        out = do_step(fn, block, x)
        torch.cuda.synchronize()
        return Runner(lambda: do_step(fn, block, x), out.clone(), _grads(block, x) if train else {},
                      time.perf_counter() - start)
    compiled, out, seconds, code = _compile(fn, lambda f: do_step(f, block, x), mode, ours=backend == "inductor_cute",
                                            enable_kwargs=enable_kwargs)
    grads = _grads(block, x) if train else {}
    return Runner(lambda: do_step(compiled, block, x), out, grads, seconds, code)


def _compile(fn, do_step, mode: str, ours: bool, enable_kwargs: dict | None = None):
    """torch.compile `fn` and take one step with it inside its config; (compiled, output, seconds,
    output code). The config is gemm_compiled.compile_now's (backends, cold caches); the step here
    may run a backward."""
    import inductor_cute
    from torch._inductor import config, list_mode_options

    from ...inductor import is_enabled
    from .gemm_compiled import COLD, OUR_BACKENDS, STOCK_BACKENDS, _fresh_cache, capture

    backends = OUR_BACKENDS if ours else STOCK_BACKENDS
    codes: list[str] = []
    enabled = inductor_cute.enable(**(enable_kwargs or {})) if ours else contextlib.nullcontext()
    with enabled, config.patch(max_autotune_gemm_backends=backends, **COLD), _fresh_cache(), capture(codes, []):
        if is_enabled() != ours:
            raise RuntimeError(f"inductor-cute enabled={is_enabled()} while compiling a runner with ours={ours}")
        # the backends in the options too: compiled functions with equal options share dynamo's code
        compiled = torch.compile(fn, options={**list_mode_options(mode), "max_autotune_gemm_backends": backends},
                                 dynamic=False)
        start = time.perf_counter()
        out = do_step(compiled).clone()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    late: list[str] = []
    with capture(late, []):
        for _ in range(2):
            do_step(compiled)
    torch.cuda.synchronize()
    if late:
        raise RuntimeError("the compiled step compiled again outside its config")
    return compiled, out, seconds, "\n".join(codes)

