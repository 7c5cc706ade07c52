"""GEMMs with a dynamic M (CPU): the M-bucket table choice (inductor/gemm/buckets.py), offered only
for a symbolic M, all of its configs valid and precompiled; the launcher picks the bucket of each
call's M and passes the kernel what the checked path with that bucket's config passes; output
code carries the table as plain values."""

import sympy
import pytest
import torch

from inductor_cute.inductor.gemm import buckets, choices as choices_mod, runtime
from inductor_cute.inductor.gemm.runtime import GemmLauncher
from inductor_cute.kernels.gemm import family
from inductor_cute.kernels.gemm.config import GemmConfig, GemmProblem
from inductor_cute.kernels.gemm.gemv_config import GemvConfig

from test_gemm_launcher import assert_same_arguments

BF16 = torch.bfloat16
K_MAJOR = GemmProblem("bfloat16", "bfloat16", "k", "k")  # B = W.t(): the GEMV may serve small M
N_MAJOR = GemmProblem("bfloat16", "bfloat16", "k", "n")
MS = (1, 17, 512, 4096, 16384)


def _bucket_of(table, m):
    return next(cfg for bound, cfg in table if bound is None or m <= bound)


@pytest.mark.parametrize("n, k", [(11008, 4096), (4096, 11008), (256, 512)])
def test_buckets_are_the_heuristic_configs_of_their_upper_bounds(n, k):
    table = buckets.bucket_configs(K_MAJOR, n, k, num_sms=132)
    bounds = [b for b, _ in table]
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])
    assert set(bounds[:-1]) <= set(buckets.M_BOUNDS)
    assert isinstance(table[0][1], GemvConfig) and table[0][0] == 8 and table[1][0] == 16  # m_tiles 1, then 2
    assert all(isinstance(cfg, GemmConfig) for _, cfg in table[2:])
    for bound in (*buckets.M_BOUNDS, None):
        m = buckets.LARGEST_M if bound is None else bound
        cfg = _bucket_of(table, m)
        assert cfg == family.default_config(K_MAJOR, m, n, k, 1, 132)
        assert family.unsupported_reason(K_MAJOR, cfg, m=m, n=n, k=k) is None
    assert all(a[1] != b[1] for a, b in zip(table, table[1:])), "equal neighbours merge"


def test_no_gemv_bucket_where_the_problem_refuses_it():
    for problem, batch in ((N_MAJOR, 1), (K_MAJOR, 4)):  # an N-major weight; a bmm
        table = buckets.bucket_configs(problem, 4096, 4096, batch, num_sms=132)
        assert all(isinstance(cfg, GemmConfig) for _, cfg in table)
        assert table[0][0] == 64, "M <= 8, 16 and 64 share the small tile"


def test_a_table_round_trips_through_plain_values():
    table = buckets.bucket_configs(K_MAJOR, 4096, 4096, num_sms=132)
    values = buckets.as_table_tuple(table)
    assert eval(repr(values)) == values  # what output code spells
    parsed = buckets.table_of(values)
    assert parsed.configs == tuple(cfg for _, cfg in table)
    for m in (*MS, 8, 9, 16, 64, 65, 2048, 2049):
        assert parsed.pick(m) == _bucket_of(table, m)
    assert buckets.configs_of(values) == [cfg for _, cfg in table]
    assert buckets.configs_of(family.as_tuple(GemmConfig())) == [GemmConfig()]
    assert "M<=8: gemv" in buckets.describe(table) and "larger: 128x256" in buckets.describe(table)


# ---- gemm_choices with Inductor's side stood in for: which choices, which configs precompiled

class _Node:
    def __init__(self, *size):
        self.size = size

    def get_size(self):
        return self.size


class _Inputs:
    def __init__(self, m, n, k, hint):
        self.mnk, self.hint = (m, n, k), hint
        self.mats = (_Node(m, k), _Node(k, n))

    def mnk_symbolic(self):
        return self.mnk

    def mnk_hinted(self):
        return (self.hint, *self.mnk[1:])

    def mat1mat2(self):
        return self.mats

    def nodes(self):
        return list(self.mats)

    def device(self):
        return torch.device("cuda", 0)

    def output_layout(self, flexible=True):
        return None


@pytest.fixture
def offered(monkeypatch):
    """gemm_choices(inputs, "mm") for a K-major weight on 132 SMs: (choices, precompiled configs)."""
    from types import SimpleNamespace

    from inductor_cute.inductor.gemm import specs

    compiled = []

    def precompile(problem, configs, num_sms):
        compiled.extend(configs)
        return [(cfg, f"key-{cfg.describe()}") for cfg in configs]

    binds = []
    fake_choice = SimpleNamespace(bind=lambda nodes, layout, **kw: binds.append(kw) or kw)
    monkeypatch.setattr(choices_mod, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(specs, "problem_for", lambda inputs, op: (K_MAJOR, 1))
    monkeypatch.setattr(specs, "precompile_choices", precompile)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr("inductor_cute.inductor.gemm.extern.gemm_choice", lambda: fake_choice)

    def offer(inputs):
        compiled.clear()
        return choices_mod.gemm_choices(inputs, "mm"), list(compiled)
    return offer


@pytest.mark.parametrize("hint", [17, 4096])
def test_a_dynamic_m_gets_one_choice_whose_table_is_all_precompiled(offered, hint):
    got, compiled = offered(_Inputs(sympy.Symbol("s0"), 11008, 4096, hint=hint))
    (kw,) = got  # no single config of ours: one tuned at the hint would serve every M if it won
    table = buckets.bucket_configs(K_MAJOR, 11008, 4096, num_sms=132)
    assert kw["config"] == buckets.as_table_tuple(table) and kw["op"] == "mm"
    assert kw["description"] == buckets.describe(table) and kw["spec_key"].startswith("m_buckets-")
    assert compiled == [cfg for _, cfg in table]


def test_a_static_m_gets_no_table(offered):
    got, compiled = offered(_Inputs(4096, 11008, 4096, hint=4096))
    assert got and not any(buckets.is_table(kw["config"]) for kw in got)
    assert not any(isinstance(cfg, GemvConfig) for cfg in compiled)


def test_a_static_decode_m_gets_only_gemv_configs(offered):
    from inductor_cute.kernels.gemm import gemv_config

    got, compiled = offered(_Inputs(8, 4096, 4096, hint=8))
    assert compiled == gemv_config.candidates(K_MAJOR, 8, 4096, 4096, 1, 132) and len(got) == len(compiled)
    got, compiled = offered(_Inputs(17, 4096, 4096, hint=17))  # past the GEMV's 16 rows: WGMMA tiles
    assert compiled and not any(isinstance(cfg, GemvConfig) for cfg in compiled)


def test_no_table_when_one_of_its_configs_fails_to_compile(offered, monkeypatch):
    from inductor_cute.inductor.gemm import specs

    monkeypatch.setattr(specs, "precompile_choices", lambda problem, configs, num_sms: [
        (cfg, "key") for cfg in configs if not isinstance(cfg, GemvConfig)])
    got, _ = offered(_Inputs(sympy.Symbol("s0"), 11008, 4096, hint=4096))
    assert got == []  # the stock choices serve it



@pytest.mark.parametrize("m, backends, triton_kept", [
    (sympy.Symbol("s0"), "ATEN,TRITON,ICUTE", False),  # dynamic M: cuBLAS and our table only
    (4096, "ATEN,TRITON,ICUTE", True),  # static M: every choice is timed at the M it serves
    (sympy.Symbol("s0"), "TRITON,ICUTE", True),  # no cuBLAS to fall back on: Triton stays
])
def test_a_dynamic_m_keeps_only_the_choices_that_adapt_to_each_calls_m(monkeypatch, m, backends, triton_kept):
    from types import SimpleNamespace

    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices

    def stock(uid):
        return SimpleNamespace(template=SimpleNamespace(uid=uid))

    stock_choices = [stock("aten::mm"), stock("triton::mm"), stock("triton::mm_persistent_tma")]
    monkeypatch.setattr(InductorChoices, "get_template_configs", lambda *a, **k: list(stock_choices))
    monkeypatch.setattr(choices_mod, "backend_requested", lambda: True)
    monkeypatch.setattr(choices_mod, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(choices_mod, "gemm_choices", lambda inputs, op: ["ours"])
    monkeypatch.setattr(choices_mod.CuteChoices, "_first_ask", lambda self, *a: True)
    with inductor_config.patch(max_autotune_gemm_backends=backends):
        got = choices_mod.CuteChoices().get_template_configs(_Inputs(m, 11008, 4096, hint=17), [], "mm")
    uids = [choices_mod._template_uid(c) for c in got]
    assert uids[0] == "aten::mm" and got[-1] == "ours"
    assert any(u.startswith("triton") for u in uids) == triton_kept


# ---- the launcher: the bucket of each call's M, remembered per layout

N, K = 256, 512


@pytest.mark.parametrize("weight", ["k-major", "n-major"])
def test_the_launcher_picks_each_calls_bucket_and_passes_what_the_checked_path_would(weight, cpu_gemm_kernels):
    problem = K_MAJOR if weight == "k-major" else N_MAJOR
    table = buckets.bucket_configs(problem, N, K, num_sms=132)
    launcher = GemmLauncher(op="mm", config=buckets.as_table_tuple(table))
    b = torch.randn(N, K, dtype=BF16).t() if weight == "k-major" else torch.randn(K, N, dtype=BF16)
    for m in MS:
        a, out = torch.randn(m, K, dtype=BF16), torch.empty(m, N, dtype=BF16)
        launcher.launch(a, b, out)
        spec, got = cpu_gemm_kernels.launches[-1]
        want_cfg = _bucket_of(table, m)
        assert spec == family.spec(problem, want_cfg, 132), m
        GemmLauncher(op="mm", config=family.as_tuple(want_cfg)).checked((a, b, out))
        want_spec, want = cpu_gemm_kernels.launches[-1]
        assert want_spec == spec
        assert_same_arguments(got, want)
    assert isinstance(_bucket_of(table, 1), GemvConfig) == (weight == "k-major")


def test_a_remembered_m_skips_the_checked_path(cpu_gemm_kernels, monkeypatch):
    from inductor_cute.host import gemm as host_gemm

    runs = []
    prepare = host_gemm._prepare_gemm
    monkeypatch.setattr(host_gemm, "_prepare_gemm", lambda *a, **k: runs.append(1) or prepare(*a, **k))
    launcher = GemmLauncher(op="addmm", config=buckets.as_table_tuple(buckets.bucket_configs(
        GemmProblem("bfloat16", "bfloat16", "k", "n", has_bias=True), N, K, num_sms=132)))
    bias, b = torch.randn(N, dtype=BF16), torch.randn(K, N, dtype=BF16)
    for m in (17, 512, 17, 512):
        launcher.launch(bias, torch.randn(m, K, dtype=BF16), b, torch.empty(m, N, dtype=BF16))
    assert len(runs) == 2 and len(cpu_gemm_kernels.launches) == 4
    assert cpu_gemm_kernels.launches[0][0] != cpu_gemm_kernels.launches[1][0]  # two buckets, two kernels
    runtime.gemm(bias, torch.randn(3, K, dtype=BF16), b, out=torch.empty(3, N, dtype=BF16), op="addmm",
                 config=launcher.config)  # autotuning's entry takes a table too
    assert cpu_gemm_kernels.launches[-1][0].kwargs["tile_m"] == 64


# ---- output code: the table as plain values in the launcher's definition, fused or not

def test_output_code_of_a_fused_gemm_defines_its_launcher_with_the_table():
    import test_epilogue_translation as lowering_tests

    table = buckets.as_table_tuple(buckets.bucket_configs(GemmProblem("bfloat16", "bfloat16", "k", "k", True),
                                                          2048, 1024, num_sms=132))
    shapes = [(2048, 1024), (2048,), (300, 1024), (300, 2048)]
    nodes, code = lowering_tests.scheduled(lowering_tests.LINEAR["gelu_tanh+residual"], shapes, (300,),
                                           codegen=True, config=table)  # what our chosen addmm carries
    definitions, calls = lowering_tests.our_launchers(code)
    assert nodes == [["op0", "op1"]]  # every bucket's config takes the epilogue
    (definition,) = definitions.values()
    assert f"config={table!r}" in definition and "epilogue='[[" in definition
    launcher = eval(definition.removesuffix(".launch"), {"inductor_cute": __import__("inductor_cute")})
    assert launcher.config == table


def test_the_unfused_launcher_definition_carries_the_table():
    from inductor_cute.inductor.gemm.codegen import define_launcher

    class Wrapper:
        def __init__(self):
            self.imports, self.kernels = [], {}

        def add_import_once(self, line):
            self.imports.append(line)

        def next_kernel_suffix(self):
            return str(len(self.kernels))

        def define_kernel(self, name, text, gpu=True):
            self.kernels[name] = text

    table = buckets.as_table_tuple(buckets.bucket_configs(K_MAJOR, 4096, 4096, num_sms=132))
    wrapper = Wrapper()
    name = define_launcher(wrapper, op="addmm", config=table, alpha=1.0, beta=0.5)
    text = wrapper.kernels[name]
    assert f"config={table!r}" in text and text.endswith(".launch")
    launcher = eval(text.removesuffix(".launch"), {"inductor_cute": __import__("inductor_cute")})
    assert (launcher.op, launcher.config, launcher.beta) == ("addmm", table, 0.5)


def test_a_failing_robustness_check_keeps_every_choice(monkeypatch):
    from types import SimpleNamespace

    from torch._inductor.choices import InductorChoices

    stock_choices = [SimpleNamespace(template=SimpleNamespace(uid=u)) for u in ("aten::mm", "triton::mm")]
    monkeypatch.setattr(InductorChoices, "get_template_configs", lambda *a, **k: list(stock_choices))
    monkeypatch.setattr(choices_mod, "backend_requested", lambda: True)
    monkeypatch.setattr(choices_mod.CuteChoices, "_first_ask", lambda self, *a: False)

    def broken(*args):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(choices_mod, "unsupported_reason", broken)
    got = choices_mod.CuteChoices().get_template_configs(_Inputs(sympy.Symbol("s0"), 11008, 4096, hint=17), [], "mm")
    assert got == stock_choices
