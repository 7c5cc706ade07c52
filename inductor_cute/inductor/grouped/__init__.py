"""torch._grouped_mm under torch.compile: our grouped GEMM joins the stock lowering's autotuning
(lowering.py decides and joins, extern.py is the choice and its node, runtime.py what output code
and autotuning call); gate.py fuses the MoE up projection's silu(gate) * up into one gated grouped
GEMM (a post-grad pass, opt-in)."""
