"""The torch.compile integration on the CPU: enabling, the choices hook, argument routing of the
runtime entry point, candidate configs. End-to-end GPU runs are in tests/gpu/test_inductor_gpu.py."""

import pickle

import pytest
import torch
from torch._inductor import config as inductor_config

import inductor_cute
from inductor_cute.inductor.gemm import choices as choices_mod
from inductor_cute.inductor import choices_factory, is_enabled
from inductor_cute.inductor.gemm import runtime
from inductor_cute.kernels.gemm.config import GemmConfig, GemmProblem, candidates, default_config, unsupported_reason


def test_off_by_default_enable_adds_token_once_and_disable_restores():
    before = (inductor_config.inductor_choices_class, inductor_config.max_autotune_gemm_backends)
    assert not is_enabled()
    with inductor_cute.enable():
        assert is_enabled()
        inductor_cute.enable()  # nested: still one token
        assert inductor_config.max_autotune_gemm_backends.upper().split(",").count("ICUTE") == 1
        inductor_cute.disable()
        assert is_enabled()
    assert (inductor_config.inductor_choices_class, inductor_config.max_autotune_gemm_backends) == before
    inductor_cute.disable()  # not enabled: nothing to undo
    assert not is_enabled()


def test_enable_refuses_to_replace_another_choices_class():
    from torch._inductor.choices import InductorChoices

    with inductor_config.patch(inductor_choices_class=InductorChoices):
        with pytest.raises(RuntimeError, match="inductor_choices_class is already set"):
            inductor_cute.enable()
        assert inductor_config.inductor_choices_class is InductorChoices
        assert "ICUTE" not in inductor_config.max_autotune_gemm_backends


def test_choices_factory_is_picklable_and_tags_the_cache_key():
    factory = choices_factory()
    assert pickle.loads(pickle.dumps(factory)).keywords == factory.keywords  # torch 2.11 pickles it
    tag = factory().uuid()  # torch 2.13 asks the instance
    assert tag.startswith(f"inductor-cute-{inductor_cute.__version__}-") and len(tag) > 25


def test_backend_requested_needs_token_and_max_autotune():
    with inductor_config.patch(max_autotune_gemm_backends="ATEN,ICUTE", max_autotune=False, max_autotune_gemm=False):
        assert not choices_mod.backend_requested()
    with inductor_config.patch(max_autotune_gemm_backends="ATEN, icute", max_autotune=True):
        assert choices_mod.backend_requested()
    with inductor_config.patch(max_autotune_gemm_backends="ATEN,TRITON", max_autotune=True):
        assert not choices_mod.backend_requested()


class _Graph:  # what V.graph must offer the hook: identity, weak-referenceable
    cpp_wrapper = False


class _Template:
    def __init__(self, uid):
        self.uid = uid


class _Buf:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


class _Inputs:
    def __init__(self, a, b, inp="bias"):
        self._ab = (a, b)
        self._inp = _Buf(inp)

    def mat1mat2(self):
        return self._ab

    def nodes(self):
        return [self._inp, *self._ab]


def test_attaches_once_per_gemm_at_the_main_template_call():
    from torch._inductor.virtualized import V

    chooser = choices_mod.CuteChoices(tag="t")
    a, b, other = _Buf("a"), _Buf("b"), _Buf("c")
    with V.set_graph_handler(_Graph()):
        assert not chooser._first_ask(_Inputs(a, b), [_Template("aten::addmm_contiguous")], "addmm")
        assert chooser._first_ask(_Inputs(a, b), [_Template("aten::addmm"), _Template("aten::bias_addmm")], "addmm")
        assert not chooser._first_ask(_Inputs(a, b), [_Template("triton::mm")], "addmm")  # 2.13's Triton call
        assert chooser._first_ask(_Inputs(a, b, inp="bias2"), [_Template("triton::mm")], "addmm")  # ATen off
        assert chooser._first_ask(_Inputs(a, other), [], "mm")  # only our backend enabled
        assert chooser._first_ask(_Inputs(a, b), [_Template("aten::mm")], "mm")  # another op


CFG = tuple(GemmConfig().as_params().values())
BF16 = torch.bfloat16


def _launched(recorder):
    """(GemmProblem flags, kernel arguments) of each recorded launch."""
    return [((spec.kwargs["has_bias"], spec.kwargs["has_c"]), args) for spec, args in recorder.launches]


def test_runtime_routes_addmm_bias_rows_and_residuals(cpu_gemm_kernels):
    a, b, out = torch.randn(32, 64, dtype=BF16), torch.randn(64, 128, dtype=BF16), torch.empty(32, 128, dtype=BF16)
    row = torch.randn(128, dtype=BF16)
    runtime.gemm(row, a, b, out=out, op="addmm", config=CFG)  # torch 2.13: 1-D bias
    runtime.gemm(row.expand(32, 128), a, b, out=out, op="addmm", config=CFG)  # 2.11: expanded bias
    runtime.gemm(row, a, b, out=out, op="addmm", config=CFG, alpha=2.0, beta=0.5)  # scaled: C
    full = torch.randn(32, 128, dtype=BF16)
    runtime.gemm(full, a, b, out=out, op="addmm", config=CFG)
    (first_kind, first), (expanded_kind, expanded), (scaled_kind, scaled), (residual_kind, residual) = \
        _launched(cpu_gemm_kernels)
    assert first_kind == expanded_kind == (True, False) and scaled_kind == residual_kind == (False, True)
    for bias in (first[4], expanded[4]):  # A, B, D, C, bias, alpha, beta
        assert bias.shape == (128,) and bias.stride() == (1,) and bias.data_ptr() == row.data_ptr()
    assert first[3] is None and first[5:] == (1.0, 0.0)
    assert scaled[4] is None and torch.equal(scaled[3][:, :, 0], row.expand(32, 128)) and scaled[5:] == (2.0, 0.5)
    assert residual[3].data_ptr() == full.data_ptr() and residual[5:] == (1.0, 1.0)
    assert all(args[2].data_ptr() == out.data_ptr() and args[0].data_ptr() == a.data_ptr()
               for _, args in _launched(cpu_gemm_kernels))


def test_runtime_routes_bmm_and_baddbmm(cpu_gemm_kernels):
    a, b, out = torch.randn(2, 32, 64, dtype=BF16), torch.randn(2, 64, 128, dtype=BF16), torch.empty(2, 32, 128,
                                                                                                       dtype=BF16)
    runtime.gemm(a, b, out=out, op="bmm", config=CFG)
    runtime.gemm(torch.randn(128, dtype=BF16).expand(2, 32, 128), a, b, out=out, op="baddbmm", config=CFG)
    runtime.gemm(torch.randn(2, 1, 128, dtype=BF16).expand(2, 32, 128), a, b, out=out, op="baddbmm", config=CFG)
    (plain_kind, plain), (row_kind, row), (per_batch_kind, per_batch) = _launched(cpu_gemm_kernels)
    assert plain_kind == (False, False) and plain[3] is None and plain[4] is None
    assert row_kind == (True, False) and row[4].shape == (128,)
    assert per_batch_kind == (False, True) and per_batch[4] is None  # differs across the batch


@pytest.mark.parametrize("sizes,strides,expected", [
    ((16,), (1,), True), ((4, 16), (0, 1), True), ((1, 16), (16, 1), True), ((2, 4, 16), (0, 0, 1), True),
    ((4, 16), (16, 1), False), ((4, 16), (1, 4), False), ((2, 4, 16), (16, 0, 1), False), ((8,), (1,), False)])
def test_is_bias_row(sizes, strides, expected):
    assert runtime.is_bias_row(sizes, strides, 16) is expected


@pytest.mark.parametrize("m,n", [(16, 4096), (128, 14336), (1000, 1000), (8192, 8192)])
def test_candidate_configs_are_valid_distinct_and_start_with_the_default(m, n):
    problem = GemmProblem("bfloat16", "bfloat16", "k", "k", has_bias=True)
    configs = candidates(problem, m, n)
    assert configs[0] == default_config(problem, m, n)
    assert len(configs) == len(set(configs)) >= 3
    assert all(unsupported_reason(problem, c) is None for c in configs)
    exhaustive = candidates(problem, m, n, exhaustive=True)
    assert len(exhaustive) > 3 * len(configs) and all(unsupported_reason(problem, c) is None for c in exhaustive)


def test_compiled_cpu_model_is_untouched_by_our_hook(caplog):
    model = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    with inductor_cute.enable(), inductor_config.patch(max_autotune_gemm_backends="ATEN,ICUTE",
                                                       fx_graph_cache=False), caplog.at_level("INFO", "inductor_cute"):
        torch._dynamo.reset()
        out = torch.compile(model, mode="max-autotune-no-cudagraphs")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, model(x))
    assert "inductor-cute skips addmm 8x32x64: device cpu is not CUDA" in caplog.text


def test_fusion_installs_our_cuda_scheduling_and_restores_everything():
    from torch._inductor.codegen import common

    from inductor_cute.inductor.gemm.template import CuteCUDAScheduling, scheduling_installed
    from inductor_cute.inductor.install import active_settings

    def fusion_enabled():  # what the lowering reads: the settings of V.choices
        return active_settings().fuse_epilogues

    if not common.device_codegens:
        common.init_backend_registration()
    stock = common.device_codegens["cuda"]
    before = inductor_config.benchmark_epilogue_fusion
    with inductor_cute.enable(fuse_epilogues=True):
        assert scheduling_installed() and fusion_enabled()
        assert isinstance(common.device_codegens["cuda"].scheduling(None), CuteCUDAScheduling)
        assert common.device_codegens["cuda"].wrapper_codegen is stock.wrapper_codegen
        assert inductor_config.benchmark_epilogue_fusion is False
        assert inductor_config.inductor_choices_class().uuid().endswith("fuse1-flex1-prefill0-bwd0-ggemv1-pdl0-m1mm0-tbm1-gatea-gathera-route1-scat1")
    assert common.device_codegens["cuda"] is stock and not fusion_enabled()
    assert inductor_config.benchmark_epilogue_fusion == before
    with inductor_cute.enable():
        assert not scheduling_installed() and not fusion_enabled()


def test_runtime_passes_a_gemv_config_through(cpu_gemm_kernels):
    from inductor_cute.kernels.gemm.family import as_tuple
    from inductor_cute.kernels.gemm.gemv_config import GemvConfig

    a, b, out = torch.randn(4, 1024, dtype=BF16), torch.randn(256, 1024, dtype=BF16).t(), torch.empty(4, 256,
                                                                                                       dtype=BF16)
    runtime.gemm(a, b, out=out, op="mm", config=as_tuple(GemvConfig(8, 1024, 8, 1)))
    (spec, args), = cpu_gemm_kernels.launches
    assert spec.kwargs["warps"] == 8 and spec.kwargs["k_slice"] == 1024 and len(args) == 9  # with the workspace


class _Node:
    def __init__(self, *size):
        self.size = size

    def get_size(self):
        return self.size


class _Sizes:
    def __init__(self, m, n, k, batch=None):
        self.mnk = (m, n, k)
        lead = (batch,) if batch else ()
        self.mats = (_Node(*lead, m, k), _Node(*lead, k, n))

    def mnk_symbolic(self):
        return self.mnk

    def mat1mat2(self):
        return self.mats


def test_gemv_candidates_only_for_static_small_m_against_a_k_major_weight():
    import sympy

    from inductor_cute.kernels.gemm.config import GemmProblem
    from inductor_cute.kernels.gemm.gemv_config import candidates as gemv_candidates

    weight = GemmProblem("bfloat16", "bfloat16", "k", "k")
    expected = gemv_candidates(weight, 8, 4096, 4096, num_sms=132)
    assert choices_mod._gemv_candidates(_Sizes(8, 4096, 4096), weight, 132) == expected
    assert choices_mod._gemv_candidates(_Sizes(17, 4096, 4096), weight, 132) == []
    assert choices_mod._gemv_candidates(_Sizes(sympy.Symbol("s0"), 4096, 4096), weight, 132) == []  # dynamic M
    assert choices_mod._gemv_candidates(_Sizes(8, 4096, 4096, batch=1), weight, 132) == []  # bmm
    n_major = GemmProblem("bfloat16", "bfloat16", "k", "n")
    assert choices_mod._gemv_candidates(_Sizes(8, 4096, 4096), n_major, 132) == []
