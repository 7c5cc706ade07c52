"""Does stock flex_attention (Triton) give wrong results with a BlockMask traced into its graph?

    python3 benchmarks/traced_mask_check.py        (a GPU; transformers for the model cases)

enable()'s trace_block_masks (inductor/block_masks.py, on by default) traces transformers'
create_block_mask into the model's graph. In the seventeenth session's models run
(llama3-8b prefill B8 x2048, max-autotune-no-cudagraphs) the stock runner with that tracing
(triton_traced) gave logits 1.21 relative error from eager while stock without it and ours with it
agreed (2.2e-2); the decode cases' traced stock runners agreed. On CPU (Inductor's C++ flex
kernel) the same model agrees. Explained on the CPU in the eighteenth session: Inductor laid the
traced mask's tensors out with a size-1 head dim's stride not H times the batch stride, and the
Triton forward and backward templates (not the decode one) assume it; the polyfill now views them
at packed strides (block_masks.with_packed_strides). This check, with that fix, decides whether
prefill masks may be traced again. Each line here: one compiled flex_attention (or a 2-layer Llama)
prefill, traced or not, in a mode, against an fp32 SDPA (or eager) reference.
"""
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from inductor_cute.inductor import block_masks

# enable() traces only decode-sized masks since this disagreement; the check traces every mask
block_masks.MAX_TRACED_Q_LEN = 1 << 30

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def flex_case(mode, traced, S=2048, B=8):
    torch._dynamo.reset()
    (block_masks.install if traced else block_masks.uninstall)()
    q = torch.randn(B, 32, S, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 8, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pad = torch.ones(B, S, dtype=torch.bool, device="cuda")
    pad[1:, S - 300:] = False  # batches' masks differ: a batch reading another's blocks shows
    def f(q, k, v, pad):
        def mask(b, h, m, n):
            return (m >= n) & pad[b, n]
        bm = create_block_mask(mask, B, None, S, S, device="cuda", _compile=True)
        return flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    keep = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()[None, None] & pad[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(4, 1),
                                                           v.float().repeat_interleave(4, 1), attn_mask=keep)
    with torch.no_grad():
        out = torch.compile(f, mode=mode)(q, k, v, pad)
    print(f"flex B{B} S{S} mode={mode} traced={traced}: rel err {rel(out, ref):.3e}", flush=True)

def model_case(mode, traced, S=2048, B=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch._dynamo.reset()
    (block_masks.install if traced else block_masks.uninstall)()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, attn_implementation="flex_attention")
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 4096, (B, S), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        out = torch.compile(model.forward, mode=mode)(input_ids=ids, use_cache=False).logits
    print(f"llama B{B} S{S} mode={mode} traced={traced}: rel err {rel(out, ref):.3e}", flush=True)

if __name__ == "__main__":
    # the cheap compiles first: the twenty-first session's run spent its 400 s in max-autotune ones
    for case, mode in ((flex_case, "default"), (model_case, "default"), (model_case, "max-autotune-no-cudagraphs"),
                       (flex_case, "max-autotune-no-cudagraphs")):
        for traced in (True, False):
            try:
                case(mode, traced)
            except Exception as e:
                print(case.__name__, mode, traced, "failed:", repr(e)[:300], flush=True)
