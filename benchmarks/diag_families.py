"""Where gpt-oss's prefill tokens drift from the eager model's (prints, asserts nothing; one GPU call).

With each router pinned to the eager twin's outputs, a compiled gpt-oss prefill had 16-23 of 1024
tokens off by more than 3% of the largest logit, stock or enabled, with or without our kernels,
where eager flex_attention had none (benchmarks/results/gpu-checks-h100-20261205-s22.txt). Runs
stock, enabled without our flex kernels, the same with our grouped GEMM declined, and with our
prefill; then our prefill op alone on gpt-oss's attention (sliding window, lse) against fp32.

    python3 benchmarks/diag_families.py    (tests/ on the path; a GPU)
"""
import sys
import traceback

import torch

from inductor_cute.inductor.flex import lowering as flex

sys.path.insert(0, "tests")
import transformers_families as tf  # noqa: E402

seen = []  # the flex lowering's decline reasons of the current section
_decide = flex.decline_reason


def record(problem):
    seen.append(_decide(problem))
    return seen[-1]


flex.decline_reason = record


def section(name, fn):
    print(f"\n=== {name}", flush=True)
    seen.clear()
    try:
        fn()
    except Exception as e:
        print("EXC", type(e).__name__, str(e)[:5000]); traceback.print_exc(limit=-12)
    print("decline reasons:", seen[:12], flush=True)


def gptoss(mode):
    def run():
        _, model = tf.build("gpt_oss", "flex_attention", "cuda")
        _, twin = tf.build("gpt_oss", "eager", "cuda")
        with tf.routing_recorded(twin) as routing:
            ref = tf.prefill_logits(twin, 512, "cuda")
        with tf.routing_pinned(model, routing):
            eager_flex = tf.prefill_logits(model, 512, "cuda")
            ours, code = tf.compile_and_run(lambda c: tf.prefill_logits(c(model), 512, "cuda"), **mode)
        e = tf.token_errors(ours, ref)
        far = (e > 3e-2).nonzero().flatten().tolist()
        print(mode, "pinned: far", len(far), "max", e.max().item(), "at", far[:24],
              "eager-flex far", int((tf.token_errors(eager_flex, ref) > 3e-2).sum()),
              "launchers", code.count("FlexPrefillLauncher("), "grouped", code.count("Grouped"),
              "cute", code.count("inductor_cute"), flush=True)
    return run


def gptoss_layers(mode):
    """Each layer's output (hidden states) against the eager twin's, routing pinned: which layer and
    which tokens the drift starts at (the first layer's attention reads the same inputs in every run)."""
    def hidden(forward):
        with torch.no_grad():
            out = forward(input_ids=tf.token_ids(2, 512, "cuda"), use_cache=False, output_hidden_states=True)
        return torch.stack([h.float() for h in out.hidden_states])

    def far_per_layer(states, ref):  # per layer: (far token positions, largest relative error)
        result = []
        for got, want in zip(states, ref):
            errors = ((got - want).abs().amax(-1) / want.abs().max()).flatten()
            result.append(((errors > 3e-2).nonzero().flatten().tolist()[:12], round(errors.max().item(), 4)))
        return result

    def run():
        _, model = tf.build("gpt_oss", "flex_attention", "cuda")
        _, twin = tf.build("gpt_oss", "eager", "cuda")
        with tf.routing_recorded(twin) as routing:
            ref = hidden(twin)
        with tf.routing_pinned(model, routing):
            eager_flex = hidden(model)
            ours, _ = tf.compile_and_run(lambda c: hidden(c(model)), **mode)
        print(mode, "eager flex per layer (far tokens, max):", far_per_layer(eager_flex, ref))
        print(mode, "compiled per layer (far tokens, max):", far_per_layer(ours, ref), flush=True)
    return run


def gptoss_op():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import inductor_cute
    torch.manual_seed(0)
    for B, H, KH, S, D in [(2, 4, 2, 512, 64), (2, 64, 8, 512, 64)]:
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, KH, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, KH, S, D, device="cuda", dtype=torch.bfloat16)
        def sw(b, h, m, n):  # causal within gpt-oss's tiny sliding window (tf.SLIDING)
            return (n <= m) & (m - n < tf.SLIDING)
        bm = create_block_mask(sw, B, None, S, S, device="cuda")
        f = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True))
        torch._dynamo.reset()
        with inductor_cute.enable(flex_prefill=True), torch.no_grad():
            out, lse = f(q, k, v)
        ro, rl = flex_attention(q.float(), k.float(), v.float(), block_mask=bm, enable_gqa=True, return_lse=True)
        print(B, H, S, D, "out nan", out.isnan().sum().item(), "lse nan", lse.isnan().sum().item(),
              "out err", (out.float() - ro).abs().max().item(), "lse err", (lse - rl).abs().max().item(), "decisions", seen)


def gptoss_no_grouped():
    from inductor_cute.inductor.grouped import lowering as g
    keep = g.decline_reason
    g.decline_reason = lambda *a, **k: "diag: grouped off"
    try:
        gptoss(dict(flex_decode=False))()
    finally:
        g.decline_reason = keep


if __name__ == "__main__":
    section("gptoss layers, stock", gptoss_layers(dict(stock=True)))
    section("gptoss layers, our prefill", gptoss_layers(dict(flex_prefill=True)))
    section("gptoss stock", gptoss(dict(stock=True)))
    section("gptoss enabled, flex off", gptoss(dict(flex_decode=False)))
    section("gptoss enabled, flex off, grouped off", gptoss_no_grouped)
    section("gptoss enabled, prefill", gptoss(dict(flex_prefill=True)))
    section("gptoss op", gptoss_op)
