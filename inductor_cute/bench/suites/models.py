"""Whole transformers models as users run them (issue 11): one decode or prefill step of a causal LM
built from its config in code (random bf16 weights, no download), `attn_implementation=
"flex_attention"`, decode against a StaticCache.

A training step of Llama-3.1-8B (issue 15: forward with the loss, backward; the enabled runner
with enable(flex_prefill=True, flex_backward=True), so both attention graphs may run our kernels),
case `llama3-8b train B1 x4096 nocg` (not in --quick; three runners' weights, gradients and
activations at once: run it with few layers, e.g. INDUCTOR_CUTE_MODEL_LAYERS=4).

The MoE block of Qwen3-30B-A3B on its own (moe_block.py: torch._grouped_mm as MoE training code
writes it), forward and a training step, in cases named `qwen3-30b-a3b moe-block ...` (not in
--quick; run them with --match moe-block).

Runners of a case (all on the same model, inputs and cache):
  inductor_cute  torch.compile in the case's mode with inductor_cute.enable()
  triton         stock torch.compile in the same mode
  triton_traced  stock, its BlockMasks traced into the graph as enable() traces ours
                 (trace_block_masks): against it, what our kernels gain; against triton, the tracing
  aten           eager
Modes: "max-autotune-no-cudagraphs" (`nocg` in case names) and "max-autotune" (CUDA graphs, `cg`).
A step's time is wall time per step, steps issued back to back (what a serving loop sees, host cost
included), the runners interleaved in rounds. Decode steps advance the cache position by one each
call and wrap round before the end, so every step attends over about KV keys.

Environment: INDUCTOR_CUTE_MODEL_LAYERS (decoder layers of every model; default 32 for Llama, the
real depth for the others), INDUCTOR_CUTE_MODEL_ENABLE=keep_m1_mm,... (opt-in
enable() switches turned on for the inductor_cute runner, named in the notes; "-trace_block_masks"
turns that default off, and drops the triton_traced runner), INDUCTOR_CUTE_MODEL_ATTENTION_MASK=1
(decode and prefill steps pass the 2-D attention mask of ones that generate() passes each step:
transformers' check of it for zeros breaks a stock graph). transformers is an
optional extra. Cold and warm compile times in fresh processes: benchmarks/model_compile_cost.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import torch

from ..case import Case, named
from ..profile import busy_us, host_gaps_us, host_syncs_per_call, idle_and_overlap_us, kernel_timeline
from . import moe_block
from .gemm_compiled import OUR_CALL as GEMM_CALL
from .grouped_gemm import FUSED_OP_CALLS, GROUPED_CALL, UNFUSED_CALL, gated_sites, gathered_sites

MODES = {"nocg": "max-autotune-no-cudagraphs", "cg": "max-autotune"}
METHOD = ("wall time per step, 10 steps back to back then a sync, median of 5 rounds with the runners "
          "interleaved (host cost included, as a serving loop sees it); device time per step (the sum of "
          "its kernels' times, torch.profiler) in the notes")
WRAP = 256  # decode positions a runner walks through before wrapping round


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # llama, qwen3_moe, deepseek_v2
    layers: int
    config: dict


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


MODELS = {
    "llama3-8b": ModelSpec("llama3-8b", "llama", 32, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=_rope(500000.0))),
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", "qwen3_moe", 48, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters=_rope(1e6))),
    "dsv2-lite": ModelSpec("dsv2-lite", "deepseek_v2", 27, dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_parameters=_rope(10000.0))),
}
# (phase, batch, tokens): decode = KV length of the cache, prefill = prompt length
STEPS = [("decode", 1, 32768), ("decode", 8, 8192), ("decode", 32, 4096), ("prefill", 1, 4096), ("prefill", 8, 2048)]
QUICK = [("llama3-8b", "decode", 8, 8192, "nocg")]
TRAIN = [("llama3-8b", "train", 1, 4096, "nocg")]  # CUDA graphs left out: a training step rarely runs in them
# what enable() gets per phase: prefill and training attention are opt-in (see README)
ENABLE = {"decode": {}, "prefill": {}, "train": {"flex_prefill": True, "flex_backward": True}}


def enable_kwargs(phase: str) -> dict:
    """ENABLE[phase], plus the switches INDUCTOR_CUTE_MODEL_ENABLE names (comma-separated): "name"
    turns an opt-in switch on (how a feature is measured in a model before it is a default),
    "-name" a default one off."""
    names = [name.strip() for name in os.environ.get("INDUCTOR_CUTE_MODEL_ENABLE", "").split(",") if name.strip()]
    return {**ENABLE[phase], **{name.lstrip("-"): not name.startswith("-") for name in names}}


def with_attention_mask() -> bool:
    """Whether decode and prefill steps pass generate()'s 2-D attention mask (INDUCTOR_CUTE_MODEL_ATTENTION_MASK=1)."""
    return os.environ.get("INDUCTOR_CUTE_MODEL_ATTENTION_MASK", "") == "1"


def case_name(model: str, phase: str, batch: int, tokens: int, mode: str) -> str:
    size = f"KV{tokens}" if phase == "decode" else f"x{tokens}"
    return f"{model} {phase} B{batch} {size} {mode}"


def layers_of(spec: ModelSpec) -> int:
    return int(os.environ.get("INDUCTOR_CUTE_MODEL_LAYERS", spec.layers))


def build_model(spec: ModelSpec, layers: int, device="cuda", dtype=torch.bfloat16, **overrides):
    """The causal LM of `spec` with `layers` decoder layers and random weights, in eval mode."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                  "deepseek_v2": transformers.DeepseekV2Config}[spec.family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                 "deepseek_v2": transformers.DeepseekV2ForCausalLM}[spec.family]
    config = config_cls(**{**spec.config, "num_hidden_layers": layers, **overrides})
    config._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(dtype)
    return model.eval().requires_grad_(False)


class DecodeStep:
    """One new token per sequence against a StaticCache of `kv` slots filled with random K/V. Each
    call writes the next position; the position wraps round within the last WRAP slots."""

    def __init__(self, model, batch: int, kv: int, device="cuda"):
        from transformers import StaticCache

        self.model, self.kv = model, kv
        self.cache = StaticCache(config=model.config, max_cache_len=kv)
        self.first = kv - min(WRAP, kv // 2)
        prompt = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
        with torch.no_grad():  # initialises the cache's tensors (lazily sized by transformers)
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True)
        gen = torch.Generator(device=device).manual_seed(1)
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t.normal_(generator=gen)
        self.ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        # generate()'s mask covers the tokens seen so far; one as long as the cache keeps the shape static
        self.mask = torch.ones(batch, kv, dtype=torch.long, device=device) if with_attention_mask() else None
        self._set(self.first)

    def _set(self, pos: int) -> None:
        self.pos = pos
        self.position.fill_(pos)
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(pos)

    def __call__(self, forward):
        if self.pos >= self.kv - 1:
            self._set(self.first)
        out = forward(input_ids=self.ids, past_key_values=self.cache, cache_position=self.position,
                      position_ids=self.position.expand(self.ids.shape[0], 1), attention_mask=self.mask,
                      use_cache=True).logits
        self.pos += 1
        self.position.add_(1)
        return out

    def reference_inputs(self):
        """Rewind to the first position (a deterministic step to compare runners on)."""
        self._set(self.first)

    def late_positions(self) -> tuple[int, int]:
        """Where runners are compared again after timing: the first position, and the last one a
        step reaches (in the cache's last block, where a block mask's lists are longest)."""
        return self.first, self.kv - 2


class TrainStep:
    """One training step on `tokens` tokens per sequence: the causal LM loss on the input ids
    themselves, then backward; gradients are dropped before each step. Returns (loss, the norm of
    the first layer's q_proj gradient): what the runners are compared on."""

    def __init__(self, model, batch: int, tokens: int, device="cuda"):
        self.model = model.train().requires_grad_(True)
        self.ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
        self.probe = model.model.layers[0].self_attn.q_proj.weight

    def __call__(self, forward):
        for p in self.model.parameters():
            p.grad = None
        loss = forward(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        return torch.stack([loss.detach().float(), self.probe.grad.float().norm()])

    def reference_inputs(self):
        pass


class PrefillStep:
    def __init__(self, model, batch: int, tokens: int, device="cuda"):
        self.model = model
        self.ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
        self.mask = torch.ones_like(self.ids) if with_attention_mask() else None

    def __call__(self, forward):
        return forward(input_ids=self.ids, attention_mask=self.mask, use_cache=False).logits

    def reference_inputs(self):
        pass


def step_cost(spec: ModelSpec, layers: int, phase: str, batch: int, tokens: int, model) -> tuple[float, float]:
    """(flops, bytes) of one step: every weight read once (MoE: only the experts a step can touch,
    at most tokens * top-k of them; the embedding table: only the new tokens' rows), the KV cache
    read once (decode), logits written; flops 2 per weight element per token plus attention's two
    matmuls."""
    if phase == "train":  # the forward, then input and weight gradients: 3x its GEMMs' flops and bytes
        if spec.family != "llama":
            raise ValueError("training steps are costed for Llama-like attention (one head dim) only")
        flops, n_bytes = step_cost(spec, layers, "prefill", batch, tokens, model)
        cfg = model.config
        pairs = batch * cfg.num_attention_heads * tokens * tokens // 2 * layers  # causal
        attn_fwd, attn_bwd = 2 * pairs * 2 * cfg.head_dim, 2 * pairs * 5 * cfg.head_dim  # 2 and 5 products
        return float(3 * (flops - attn_fwd) + attn_fwd + attn_bwd), 3 * n_bytes
    cfg = model.config
    new = batch * (1 if phase == "decode" else tokens)
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding + min(new, cfg.vocab_size) * cfg.hidden_size
    weights = params
    active = params
    if spec.family != "llama":
        experts = cfg.num_experts if spec.family == "qwen3_moe" else cfg.n_routed_experts
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        moe_layers = layers - getattr(cfg, "first_k_dense_replace", 0)
        touched = min(experts, new * cfg.num_experts_per_tok)
        weights = params - moe_layers * (experts - touched) * per_expert
        active = params - moe_layers * (experts - cfg.num_experts_per_tok) * per_expert
    heads = cfg.num_attention_heads
    if spec.family == "deepseek_v2":
        dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        kv_bytes_per_token = 2 * heads * (dqk + dv)  # transformers caches decompressed K and V
    else:
        dqk = dv = cfg.head_dim
        kv_bytes_per_token = 2 * cfg.num_key_value_heads * 2 * cfg.head_dim
    keys = tokens
    attn_flops = 2 * batch * heads * (1 if phase == "decode" else tokens) * keys * (dqk + dv) * layers
    if phase == "prefill":
        attn_flops //= 2  # causal
    cache_bytes = layers * batch * tokens * kv_bytes_per_token if phase == "decode" else 0
    flops = 2 * active * new + attn_flops
    n_bytes = 2 * weights + cache_bytes + 2 * new * cfg.vocab_size
    return float(flops), float(n_bytes)


def wall_us(fns: dict, calls: int = 10, rounds: int = 5, warmup: int = 3) -> dict:
    """Wall time per call of each fn, `calls` back to back then a sync, interleaved in rounds
    (the order rotating); the median over rounds."""
    keys = list(fns)
    for k in keys:
        for _ in range(warmup):
            fns[k]()
    torch.cuda.synchronize()
    samples = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            start = time.perf_counter()
            for _ in range(calls):
                fns[k]()
            torch.cuda.synchronize()
            samples[k].append((time.perf_counter() - start) / calls * 1e6)
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


SHARED_A_CALL = "torch.ops.inductor_cute.gemv_shared_a.default("  # the grouped decode GEMV (shared_a pass)


def our_kernel_calls(code: str) -> int:
    """Call sites of our kernels in Inductor's output code."""
    return (code.count(GEMM_CALL)  # one definition per GEMM call site
            + sum(code.count(f"inductor_cute.inductor.flex.runtime.{name}(")
                  for name in ("FlexDecodeLauncher", "FlexPrefillLauncher", "FlexBackwardLauncher"))
            + code.count(GROUPED_CALL)
            + sum(code.count(call) for call in FUSED_OP_CALLS)
            + code.count(SHARED_A_CALL))


def gemm_picks(code: str) -> str:
    """Which kind of kernel each GEMM call site of Inductor's output code runs: what autotuning
    picked, per runner (stock's picks can differ from run to run: one benchmarking round per shape)."""
    import re

    cublas = len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm|baddbmm)\(", code))
    # a template kernel's name lists the ops fused into it; a flex_attention template's may list a bmm
    templates = re.findall(r"\b(triton_tem_\w+)\.run\(", code)
    triton = sum(1 for name in templates
                 if "flex" not in name and {"mm", "bmm", "addmm", "baddbmm"} & set(name.split("_")))
    ours = code.count(GEMM_CALL) + code.count(SHARED_A_CALL)
    return f"GEMM call sites: cuBLAS {cublas}, Triton {triton}, ours {ours}"


def _compile(step, mode: str, ours: bool, enable_kwargs: dict | None = None, traced_stock: bool = False):
    """Compile the model's forward in `mode`, run one step; (forward, logits, seconds, output code).
    `traced_stock`: a stock compile with only our BlockMask tracing installed (block_masks.py),
    which tells a graph-break gain from a kernel gain.

    The runners compile the same forward: their options differ (the GEMM backends, as
    gemm_compiled.compile_now's do; the two stock runners list the same backends in another
    order) so that dynamo keeps one compiled graph for each, and nothing resets dynamo between
    them (a reset drops the other runners' graphs: they would recompile when timed, outside
    their config, i.e. stock). A later call that compiles again raises."""
    import inductor_cute
    from torch._inductor import config, list_mode_options

    from ...inductor import block_masks
    from .gemm_compiled import COLD, OUR_BACKENDS, STOCK_BACKENDS, _fresh_cache, capture

    codes: list[str] = []
    if ours:
        backends, enabled = OUR_BACKENDS, inductor_cute.enable(**(enable_kwargs or {}))
    elif traced_stock:
        backends, enabled = ",".join(reversed(STOCK_BACKENDS.split(","))), _installed(block_masks)
    else:
        backends, enabled = STOCK_BACKENDS, contextlib.nullcontext()
    # a training step compiles its backward graph at its first backward(): inside the config too
    with enabled, config.patch(max_autotune_gemm_backends=backends, **COLD), _fresh_cache(), \
            capture(codes, []), _grad_mode(step):
        options = {**list_mode_options(mode), "max_autotune_gemm_backends": backends}
        forward = torch.compile(step.model.forward, options=options, dynamic=False)
        step.reference_inputs()
        start = time.perf_counter()
        logits = step(forward).clone()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        for _ in range(2):  # CUDA graphs record and replay inside the config
            step(forward)
    late: list[str] = []
    with capture(late, []), _grad_mode(step):
        for _ in range(2):
            step(forward)
    torch.cuda.synchronize()
    if late:
        raise RuntimeError(f"the {'enabled' if ours else 'stock'} forward recompiled outside its config")
    return forward, logits, seconds, "\n".join(codes)


@contextlib.contextmanager
def _installed(hook_module):
    hook_module.install()
    try:
        yield
    finally:
        hook_module.uninstall()


def _agreement(logits, ref) -> float:
    """Relative error of an output against its reference (eager's logits, the MoE block's fp32
    reference): ||out - ref|| / ||ref||."""
    return ((logits.float() - ref.float()).norm() / ref.float().norm()).item()


def _case(model_name: str, phase: str, batch: int, tokens: int, mode_key: str) -> Case:
    spec = MODELS[model_name]
    layers = layers_of(spec)
    model = build_model(spec, layers)
    step = {"decode": DecodeStep, "prefill": PrefillStep, "train": TrainStep}[phase](model, batch, tokens)
    flops, n_bytes = step_cost(spec, layers, phase, batch, tokens, model)
    params = {"model": model_name, "layers": layers, "phase": phase, "batch": batch, "tokens": tokens,
              "mode": MODES[mode_key], "dtype": "bfloat16"}
    notes = [f"{layers} decoder layers"]
    if phase != "train" and with_attention_mask():
        params["attention_mask"] = True
        notes.append("steps pass a 2-D attention mask of ones, as generate() does")
    kwargs = enable_kwargs(phase)
    if kwargs:
        notes.append("inductor_cute: enable(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")")
    with _grad_mode(step):
        step.reference_inputs()
        ref = step(model.forward).clone()
    runners = {"aten": functools.partial(_run_step, step, model.forward)}
    torch._dynamo.reset()  # once per case: every runner's graphs must stay (see _compile)
    compiled = [("inductor_cute", True, False), ("triton", False, False)]
    if kwargs.get("trace_block_masks", True):  # stock with our tracing: what the kernels alone gain
        compiled.append(("triton_traced", False, True))
    for backend, ours, traced_stock in compiled:
        forward, logits, seconds, code = _compile(step, MODES[mode_key], ours, kwargs, traced_stock)
        runners[backend] = functools.partial(_run_step, step, forward)
        if phase == "train":  # each on its own scale: the loss is ~12, a gradient norm far smaller
            what = (f"loss rel err {_agreement(logits[:1], ref[:1]):.2e}, q_proj grad norm rel err "
                    f"{_agreement(logits[1:], ref[1:]):.2e}")
        else:
            what = f"logits rel err {_agreement(logits, ref):.2e}"
        # graphs lowered: more than one means graph breaks (transformers' create_block_mask is
        # compiled apart from the model), each a separate launch with host work between
        notes.append(f"{backend}: cold compile {seconds:.1f} s, {what}, {our_kernel_calls(code)} call site(s) "
                     f"of our kernels, {code.count('# AOT ID:')} graph(s) lowered, {gemm_picks(code)}")
    times = wall_us(runners)
    if phase == "decode":
        notes.append(late_agreement(step, runners))
    notes.append(device_note(runners))
    new = batch * (1 if phase == "decode" else tokens)
    notes.append("tokens/s " + ", ".join(f"{k} {new / t * 1e6:.0f}" for k, t in times.items()))
    return Case(name=case_name(model_name, phase, batch, tokens, mode_key), params=params, flops=flops,
                bytes=n_bytes, matmul=True, runners=runners, notes=notes, atol=float("inf"), rtol=float("inf"),
                wall_times_us=times)


def late_agreement(step: DecodeStep, runners: dict) -> str:
    """After timing (hundreds of steps, CUDA graphs replayed), each compiled runner's logits against
    eager's at the same positions (late_positions): a fault that shows only in replays or at
    other positions (a stale block list, an unwritten workspace) shows here; the logits of the
    first step, compared at compile time, cannot show it. A step at position p reads the cache
    below p, which no step of this check writes, and writes slot p: every runner sees the same
    cache. A runner with non-finite logits is disqualified (its runner dropped, MISMATCH noted)."""
    errors = {backend: [] for backend in runners if backend != "aten"}
    for pos in step.late_positions():
        step._set(pos)
        ref = runners["aten"]().float()
        for backend in errors:
            step._set(pos)
            out = runners[backend]().float()
            finite = bool(torch.isfinite(out).all())
            errors[backend].append(_agreement(out, ref) if finite else float("nan"))
    step.reference_inputs()
    parts, bad = [], []
    for backend, errs in errors.items():
        parts.append(f"{backend} " + "/".join(f"{e:.2e}" for e in errs))
        if any(e != e for e in errs):  # NaN: non-finite logits
            bad.append(backend)
            runners[backend] = None
    note = f"late logits rel err at positions {'/'.join(map(str, step.late_positions()))}: " + ", ".join(parts)
    return note + "".join(f"; MISMATCH: {b} gave non-finite logits after timing" for b in bad)


def device_note(runners: dict, calls: int = 5) -> str:
    """Per step and runner: the time its kernels cover (a wall time above it is the host's or the
    boundaries'), the idle time between consecutive kernels, the overlap of early (PDL) starts,
    the device's idle time between steps (gaps over 50 us: waiting on the host) and the host's
    syncs per step (which make the device wait for the next step's launches)."""
    parts = []
    for k, fn in runners.items():
        if fn is None:  # disqualified
            continue
        timeline = kernel_timeline(fn, calls)
        idle, overlap = idle_and_overlap_us(timeline)
        parts.append(f"{k} {busy_us(timeline) / calls:.0f} ({idle / calls:.0f} idle between kernels, "
                     f"{overlap / calls:.0f} overlapped, {host_gaps_us(timeline) / calls:.0f} waiting on the "
                     f"host between steps, {host_syncs_per_call(fn, calls):.1f} host syncs per step)")
    return "device us/step " + ", ".join(parts)


def _grad_mode(step):
    """Autograd on for a training step, off for the others."""
    return torch.enable_grad() if isinstance(step, TrainStep) else torch.no_grad()


def _run_step(step, forward):
    with _grad_mode(step):
        return step(forward)


def _moe_case(step: str, tokens: int, mode_key: str) -> Case:
    """The MoE block (moe_block.py), one forward or training step, each runner against the fp32
    reference."""
    train = step == "train"
    torch._dynamo.reset()
    block, x = moe_block.make_inputs(tokens, train)
    sizes = moe_block.rows_per_expert(block, x)
    ref_out, ref_grads = moe_block.reference(block, x, train)
    notes = [moe_block.routing_note(sizes)]
    runners = {}
    kwargs = enable_kwargs("train" if train else "prefill")
    if kwargs:
        notes.append("inductor_cute: enable(" + ", ".join(f"{k}={v}" for k, v in kwargs.items()) + ")")
    for backend in ("aten", "inductor_cute", "triton"):
        r = moe_block.make_runner(step, block, x, MODES[mode_key], backend, kwargs)
        runners[backend] = r.run
        errors = [f"out {_agreement(r.out, ref_out):.2e}"]
        errors += [f"grad {name} {_agreement(r.grads[name], g):.2e}" for name, g in ref_grads.items()]
        note = f"{backend}: rel err vs fp32 " + ", ".join(errors)
        if r.code:
            note += (f"; cold compile {r.seconds:.1f} s, {our_kernel_calls(r.code)} call site(s) of our kernels, "
                     f"{r.code.count(GROUPED_CALL)} of them grouped GEMMs, {gated_sites(r.code)} gated, "
                     f"{gathered_sites(r.code)} gathered, {r.code.count(UNFUSED_CALL)} fused op(s) run unfused")
        notes.append(note)
    del ref_out, ref_grads
    times = wall_us(runners)
    notes.append(device_note(runners))
    m = block.model
    flops, n_bytes = moe_block.cost(m, tokens, sum(1 for s in sizes if s), train)
    params = {"model": moe_block.MODEL_NAME, "block": "moe", "step": step, "tokens": tokens, "hidden": m.hidden,
              "experts": m.experts, "top_k": m.topk, "ffn": m.ffn, "mode": MODES[mode_key], "dtype": "bfloat16"}
    return Case(name=moe_block.case_name(step, tokens, mode_key), params=params, flops=flops, bytes=n_bytes,
                matmul=True, runners=runners, notes=notes, atol=float("inf"), rtol=float("inf"),
                wall_times_us=times)


def cases(quick: bool):
    if quick:
        chosen = QUICK
    else:
        chosen = [(m, *s, mode) for m in MODELS for s in STEPS for mode in MODES]
    if not quick:
        chosen += TRAIN
    out = [named(functools.partial(_case, *c), case_name(*c)) for c in chosen]
    if not quick:
        out += [named(functools.partial(_moe_case, *c), moe_block.case_name(*c)) for c in moe_block.CASES]
    return out
