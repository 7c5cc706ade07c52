"""The models suite's MoE block runners on the H200, at a small size: eager, stock torch.compile and
torch.compile with inductor-cute enabled each take a forward and a training step, compile once
(inside their own config: a later compile raises), and match the fp32 per-expert loop."""

import pytest
import torch

from inductor_cute.bench.suites import moe_block as B
from inductor_cute.bench.suites.grouped_gemm import MoeModel

pytestmark = pytest.mark.gpu
SMALL = MoeModel("small", experts=16, topk=4, hidden=256, ffn=128)
MODE = "max-autotune-no-cudagraphs"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("step", ["fwd", "train"])
@pytest.mark.parametrize("backend", ["aten", "triton", "inductor_cute"])
def test_runner_steps_match_the_fp32_reference(step, backend):
    torch._dynamo.reset()
    train = step == "train"
    block, x = B.make_inputs(500, train, model=SMALL)
    ref_out, ref_grads = B.reference(block, x, train)
    runner = B.make_runner(step, block, x, MODE, backend)
    assert _rel(runner.out, ref_out) < 2e-2
    assert set(runner.grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert _rel(runner.grads[name], g) < 3e-2, name
    again = runner.run()  # a later step: same output, no compile
    torch.testing.assert_close(again, runner.out, rtol=2e-2, atol=2e-2)
    if backend != "aten":
        assert "def call(" in runner.code
    if backend == "inductor_cute" and train:  # the gate's backward fused (autotuning then picks ours or torch's)
        assert "launch_gate_grad" in runner.code or "grouped_mm_unfused" in runner.code
    torch._dynamo.reset()
