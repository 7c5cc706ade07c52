"""enable(group_gemv=True) end to end on the H200: torch.compile of q/k/v-like projections sharing
one decode activation runs one gemv_shared_a call (inductor/gemm/shared_a.py), matching an fp32
eager reference; without the switch the code has no such call; at batch 1 under coordinate descent only with
enable(keep_m1_mm=True)."""

import pytest
import torch
import torch.nn as nn
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import inductor_cute

pytestmark = pytest.mark.gpu
OP_CALL = "torch.ops.inductor_cute.gemv_shared_a.default("
K = 4096


class Projections(nn.Module):
    """nn.Linear(K, N_i, bias=False) on one input, as q/k/v (3) or gate/up (2)."""

    def __init__(self, ns):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(K, n, bias=False) for n in ns)

    def forward(self, x):
        h = x * 2  # a computed activation, as the RMSNorm output in a decoder layer
        return tuple(lin(h) for lin in self.linears)


@pytest.fixture(autouse=True)
def fresh_compile():
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        yield
    torch._dynamo.reset()


def reference(module, x):
    h = x.float() * 2
    return [h @ lin.weight.float().t() for lin in module.linears]


@pytest.mark.parametrize("ns,x_shape", [((4096, 1024, 1024), (8, K)), ((4096, 1024, 1024), (8, 1, K)),
                                        ((6144, 6144), (8, 1, K)), ((1024, 1024), (1, K))],
                         ids=["qkv-2d", "qkv-decode", "gate-up-decode", "kv-m1"])
def test_grouped_projections_run_one_call_and_match_fp32(ns, x_shape):
    torch.manual_seed(0)
    module = Projections(ns).to("cuda", torch.bfloat16)
    x = torch.randn(x_shape, device="cuda", dtype=torch.bfloat16)
    with inductor_cute.enable(group_gemv=True):
        compiled = torch.compile(module)
        outs, codes = run_and_get_code(compiled, x)
        again = compiled(torch.zeros_like(x))  # the same compiled code on new data
    code = "\n".join(codes)
    assert code.count(OP_CALL) == 1, code
    for out, ref, n in zip(outs, reference(module, x), ns):
        assert out.shape == (*x_shape[:-1], n) and out.dtype == torch.bfloat16
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    assert all(not o.any() for o in again)


def test_switched_off_the_projections_stay_separate():
    module = Projections((4096, 1024, 1024)).to("cuda", torch.bfloat16)
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    with inductor_cute.enable(group_gemv=False):
        _, codes = run_and_get_code(torch.compile(module), x)
    assert OP_CALL not in "\n".join(codes)


def test_fp32_and_large_m_are_left_to_inductor():
    module = Projections((1024, 1024)).to("cuda")
    with inductor_cute.enable(group_gemv=True):
        _, fp32_codes = run_and_get_code(torch.compile(module), torch.randn(8, K, device="cuda"))
        torch._dynamo.reset()
        module = module.to(torch.bfloat16)
        _, m32_codes = run_and_get_code(torch.compile(module),
                                        torch.randn(32, K, device="cuda", dtype=torch.bfloat16))
    assert OP_CALL not in "\n".join(fp32_codes) and OP_CALL not in "\n".join(m32_codes)


def test_under_coordinate_descent_batch_1_is_grouped_only_with_keep_m1_mm():
    torch.manual_seed(0)
    module = Projections((4096, 1024, 1024)).to("cuda", torch.bfloat16)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    codes = {}
    for keep in (False, True):
        torch._dynamo.reset()
        with inductor_cute.enable(keep_m1_mm=keep), inductor_config.patch(coordinate_descent_tuning=True):
            outs, code = run_and_get_code(torch.compile(module), x)
        codes[keep] = "\n".join(code)
        for out, ref in zip(outs, reference(module, x)):
            torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    assert OP_CALL not in codes[False]  # Inductor's mul + sum reductions
    assert codes[True].count(OP_CALL) == 1
