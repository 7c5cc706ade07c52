"""Tiny causal LMs of the transformers families our users run, with attn_implementation=
"flex_attention", and the three steps they compile: a decode step against a StaticCache with the
2-D attention mask generate() passes, a prefill, and a training step. Each family keeps its real
attention: head dims (Gemma 256, DeepSeek MLA 192/128, Phi-3 96, gpt-oss 64), GQA, sliding windows,
softcapping, attention sinks, MoE experts. Shared by tests/test_transformers_families.py (CPU
stand-ins) and tests/gpu/test_transformers_families_gpu.py (the kernels)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

BF16 = torch.bfloat16
VOCAB = 1024
HEADS, KV_HEADS = 4, 2
SLIDING = 96  # shorter than the steps' sequences, so windows cut in
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
              intermediate_size=512, pad_token_id=0)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]

# name -> (config class, model class, head dim (qk), config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", 128, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", 128, dict(sliding_window=SLIDING)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 128, {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 256,
               dict(sliding_window=SLIDING, attn_logit_softcapping=50.0, query_pre_attn_scalar=256)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 256,
               dict(sliding_window=SLIDING, layer_types=TWO_LAYER_TYPES)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", 128, dict(sliding_window=SLIDING, layer_types=TWO_LAYER_TYPES)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", 96, {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", 128, dict(no_rope_layers=[1, 0])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", 64,
                dict(sliding_window=SLIDING, layer_types=TWO_LAYER_TYPES, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 128,
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 192,
                    dict(num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=256, first_k_dense_replace=1, n_group=1, topk_group=1)),
}


def build(name: str, attn_implementation: str, device="cpu"):
    """(config, model) of family `name` in bf16, eval mode; the same weights for every
    attn_implementation (seeded)."""
    import transformers

    config_class, model_class, head_dim, overrides = FAMILIES[name]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    kwargs = dict(COMMON, hidden_size=HEADS * min(head_dim, 128), head_dim=head_dim, **overrides)
    if name == "deepseek_v3":
        kwargs.pop("head_dim")
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(copy.deepcopy(config), dtype=BF16,
                                                            attn_implementation=attn_implementation)
    return config, model.to(device).eval()


def padded_mask(batch: int, length: int, device="cpu") -> torch.Tensor:
    """generate()'s 2-D attention mask: the second sequence left-padded by 7 tokens."""
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[1, :7] = 0
    return mask


def token_ids(batch: int, length: int, device="cpu") -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)


def decode_logits(prefill_model, config, forward, prompt: int, cache_len: int, device="cpu") -> torch.Tensor:
    """Prefill `prompt` tokens into a StaticCache with `prefill_model` (eagerly; a twin with eager
    attention keeps the prefill out of what is tested), then one step through `forward`, both with
    the padded attention mask; the step's logits in fp32."""
    import transformers

    ids, mask = token_ids(2, prompt + 1, device), padded_mask(2, prompt + 1, device)
    cache = transformers.StaticCache(config=config, max_cache_len=cache_len)
    with torch.no_grad():
        prefill_model(input_ids=ids[:, :prompt], attention_mask=mask[:, :prompt], past_key_values=cache)
        out = forward(input_ids=ids[:, prompt:], attention_mask=mask, past_key_values=cache,
                      cache_position=torch.tensor([prompt], device=device))
    return out.logits.float()


def prefill_logits(forward, tokens: int, device="cpu") -> torch.Tensor:
    """A prefill of two unpadded sequences (no cache); logits in fp32."""
    with torch.no_grad():
        return forward(input_ids=token_ids(2, tokens, device), use_cache=False).logits.float()


def train_step(model, forward, tokens: int, device="cpu", packed: bool = False) -> torch.Tensor:
    """The LM loss of two unpadded sequences and backward: (loss, norm of every gradient) in fp32.
    `packed`: each row packs two documents (position ids restart at 5/8 of the row), which
    transformers turns into a document mask."""
    model.train()
    for p in model.parameters():
        p.grad = None
    ids = token_ids(2, tokens, device)
    kwargs = {}
    if packed:
        first = tokens * 5 // 8
        kwargs["position_ids"] = torch.cat([torch.arange(first), torch.arange(tokens - first)]).to(device).expand(2, -1)
    loss = forward(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
    loss.backward()
    grads = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
    return torch.cat([loss.detach().float().view(1), grads.norm().view(1)])


def compile_and_run(run, stock: bool = False, **switches):
    """run(torch.compile) with inductor-cute enabled (`switches`; not at all with `stock`), no
    FX-graph or autograd cache; (result, output code of every graph). On the CPU the C++ kernels
    are left unvectorized: vectorized, torch 2.13's C++ code for a sliding window's traced block
    mask does not compile (a VecMask<int> and a VecMask<float> in one `?:`; stock's, CPU only)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    import inductor_cute

    torch._dynamo.reset()
    with contextlib.nullcontext() if stock else inductor_cute.enable(**switches), \
            inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}), \
            functorch_config.patch(enable_autograd_cache=False):
        result, codes = run_and_get_code(run, torch.compile)
    torch._dynamo.reset()
    return result, "\n".join(codes)


ROUTERS = ("router", "gate")  # the MoE blocks' routing modules: gpt-oss's router, Qwen3-MoE's and DeepSeek-V3's gate


def _routers(model) -> dict:
    return {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ROUTERS}


@contextlib.contextmanager
def routing_recorded(model):
    """{router's name: its output at its latest call} while inside."""
    seen = {}
    hooks = [m.register_forward_hook(lambda _m, _args, out, name=name: seen.__setitem__(name, out))
             for name, m in _routers(model).items()]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def routing_pinned(model, seen: dict):
    """Each router of `model` returns what routing_recorded saw of the reference's (the same
    weights, so the same names) while inside: the experts then take the reference's choices, and
    a near-tie that bf16 rounding turns the other way no longer sends a token to other experts."""
    routers = _routers(model)
    assert set(routers) == set(seen), (sorted(routers), sorted(seen))
    for name, m in routers.items():
        m.forward = lambda *args, _out=seen[name], **kwargs: _out
    try:
        yield
    finally:
        for m in routers.values():
            del m.forward


def token_errors(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each token's largest logit difference relative to the reference's largest logit."""
    return (ours - ref).abs().amax(-1).flatten() / ref.abs().max()


def far_tokens(ours: torch.Tensor, ref: torch.Tensor, tol: float = 3e-2) -> int:
    return int((token_errors(ours, ref) > tol).sum())


def assert_tokens_agree(ours: torch.Tensor, ref: torch.Tensor, tol: float = 3e-2, allowed: int = 0) -> None:
    """Every token's logits agree within `tol` of the largest. In a MoE family, run `ours` with
    the reference's routing pinned (routing_pinned): unpinned, a router's near-tie that rounding
    turns the other way sends a token to other experts (on the H100, gpt-oss's 1024-token prefill
    had 17 such tokens with eager flex_attention, 22-29 compiled, with our kernels or without)."""
    errors = token_errors(ours, ref)
    far = int((errors > tol).sum())
    assert far <= allowed, f"{far} of {errors.numel()} tokens differ by up to {errors.max():.3g} ({allowed} allowed)"
