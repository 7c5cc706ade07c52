"""Pointwise activations in CuTe DSL on fp32 fragments, shared by the GEMM epilogues and the
programs (epilogue and score ops)."""
from typing import Callable

import cutlass.cute as cute

from .units import LOG2E


def _sigmoid_precise(x):
    # ex2.approx (~2 ulp) and an IEEE reciprocal; 1 / (1 + inf) = 0 keeps the negative tail exact
    return 1.0 / (1.0 + cute.math.exp2(x * (-LOG2E), fastmath=True))


def _sigmoid_fast(x):
    # One tanh.approx (MUFU) op; its ~5e-4 relative error is 1/8 of a bf16 ulp, while the IEEE
    # reciprocal above is a long instruction sequence per element.
    return 0.5 + 0.5 * cute.math.tanh(0.5 * x, fastmath=True)


def activations(fast: bool) -> dict[str, Callable]:
    """Pointwise activations on fp32 fragments; `fast` trades accuracy a bf16 output cannot hold."""
    sigmoid = _sigmoid_fast if fast else _sigmoid_precise
    return {
        "identity": lambda x: x,
        "relu": lambda x: cute.where(x < 0.0, 0.0, x),  # NaN stays NaN, as in torch.relu
        # 0.5 * (1 + tanh(u)) == sigmoid(2u)
        "gelu_tanh": lambda x: x * sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x)),
        "gelu_erf": lambda x: 0.5 * x * (1.0 + cute.math.erf(x * 0.7071067811865476)),
        "silu": lambda x: x * sigmoid(x),
        "sigmoid": sigmoid,
        "tanh": lambda x: cute.math.tanh(x, fastmath=fast),
    }


def gate_gradients() -> dict[str, Callable]:
    """(gradient of gate, gradient of up) of act(gate) * up from its output's gradient y, on fp32
    fragments: y * up * act'(gate) and y * act(gate). The precise sigmoid: silu' = s(1 + g(1 - s))
    for a gate g of -4 or less is small, and tanh.approx's absolute error in s (~2e-4, near s = 0)
    would cost it 1-10%, more than a bf16 output holds."""
    def silu(y, gate, up):
        s = _sigmoid_precise(gate)
        return y * up * s * (1.0 + gate * (1.0 - s)), y * gate * s

    return {"silu": silu}
