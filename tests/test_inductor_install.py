"""inductor/install.py on the CPU: what enable() changes in torch, and that disable() puts back
exactly that, however calls nest and whatever a `with` block raises."""

import concurrent.futures
import contextvars
import threading

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor import decomposition, lowering, select_algorithm
from torch._inductor.choices import InductorChoices
from torch._inductor.codegen import common
from torch._inductor.kernel import mm_grouped
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from torch._inductor.scheduler import Scheduler
from torch._inductor.virtualized import V

import inductor_cute
from inductor_cute.inductor.grouped import gate
from inductor_cute.inductor import install
from inductor_cute.inductor.compat import feedback_savers
from inductor_cute.inductor.gemm.choices import CuteChoices
from inductor_cute.inductor.gemm.template import CudaSchedulingConstructor

HOP = torch.ops.higher_order.flex_attention
BACKWARD_HOP = torch.ops.higher_order.flex_attention_backward
GROUPED_MM = torch.ops.aten._grouped_mm.default
CONFIG_KEYS = ("inductor_choices_class", "max_autotune_gemm_backends", "benchmark_epilogue_fusion",
               "post_grad_custom_post_pass", "post_grad_custom_pre_pass", "joint_custom_pre_pass", "triton.enable_pdl")

# the Settings enable() makes of its defaults: the grouped GEMV, MoE routing and scatter passes on,
# the MoE fusions where autotuned (None)
ENABLE_DEFAULTS = dict(group_gemv=True, moe_routing=True, fuse_moe_gate=None, fuse_moe_gather=None,
                       moe_scatters=True)


def state() -> dict:
    """Everything a hook or enable() may replace, by identity."""
    return {**{key: getattr(inductor_config, key) for key in CONFIG_KEYS},
            "flex lowering": lowering.lowerings[HOP],
            "flex backward lowering": lowering.lowerings[BACKWARD_HOP],
            "grouped_mm lowering": lowering.lowerings[GROUPED_MM],
            "grouped_mm autotuning": mm_grouped.autotune_select_algorithm,
            "choice timing": vars(select_algorithm.AlgorithmSelectorCache)["benchmark_choice"],
            "fusion timing of fused nodes": vars(Scheduler)["benchmark_fused_nodes"],
            "fusion timing of modules": vars(Scheduler)["benchmark_codegened_module"],
            "run-time tuning timing": vars(CachingAutotuner)["bench"],
            "mm decomposition": decomposition.decompositions[torch.ops.aten.mm.default],
            "mm decomposition (fast random table)": decomposition.fast_random_decomps()[torch.ops.aten.mm.default],
            "cuda codegen": common.device_codegens.get("cuda"),
            "extern kernel": getattr(select_algorithm.extern_kernels, "inductor_cute_gemm", None),
            "grouped extern kernel": getattr(select_algorithm.extern_kernels, "inductor_cute_grouped_mm", None),
            "gated op lowering": lowering.lowerings[gate.OP],  # the fallback kernel gate.py registers
            "gated extern kernel": getattr(select_algorithm.extern_kernels, "inductor_cute_grouped_mm_gated", None),
            "feedback savers": tuple(feedback_savers())}


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key == "feedback savers":
            assert len(value) == len(after[key]) and all(a is b for a, b in zip(value, after[key])), key
        elif isinstance(value, (str, bool)):
            assert after[key] == value, key
        else:
            assert after[key] is value, key


@pytest.fixture(autouse=True)
def stock():
    """Each test starts and ends with nothing of ours installed and the CUDA backend registered."""
    common.init_backend_registration()
    assert not install._saved
    before = state()
    yield before
    while install._saved:  # a failed test must not leave the rest enabled
        inductor_cute.disable()
    assert_same(before, state())


def installed() -> dict:
    return {h.name: h.installed() for h in install.HOOKS}


def test_enable_installs_what_its_settings_ask_for(stock):
    with inductor_cute.enable(fuse_epilogues=True, flex_decode=True, flex_backward=True, keep_m1_mm=True,
                              trace_block_masks=True, fuse_moe_gate=True, fuse_moe_gather=True):
        assert all(installed().values())
        assert install.stock_lowering(BACKWARD_HOP) is stock["flex backward lowering"]
        assert isinstance(common.device_codegens["cuda"].scheduling, CudaSchedulingConstructor)
        assert common.device_codegens["cuda"].scheduling.replaced is stock["cuda codegen"].scheduling
        assert install.stock_lowering(HOP) is stock["flex lowering"]
        assert inductor_config.benchmark_epilogue_fusion is False
    with inductor_cute.enable(fuse_epilogues=False, flex_decode=False, trace_block_masks=False, fuse_moe_gate=False,
                              fuse_moe_gather=False):
        assert installed() == {"gemm_extern_kernel": True, "gemm_feedback_log": True, "cuda_scheduling": False,
                               "flex_attention_lowering": False, "flex_attention_backward_lowering": False,
                               "grouped_extern_kernel": True,
                               "grouped_mm_autotuning": True, "grouped_mm_lowering": True,
                               "grouped_gated_extern_kernel": True, "grouped_mm_gated_lowering": False,
                               "grouped_gate_grad_extern_kernel": True, "grouped_mm_gate_grad_lowering": False,
                               "grouped_rows_extern_kernel": True, "grouped_unfused_extern_kernel": True,
                               "grouped_mm_rows_lowering": False,
                               "choice_timing": True,
                               "fusion_timing_fused_nodes": True, "fusion_timing_codegened_module": True,
                               "runtime_tuning_timing": True, "m1_mm_kept": False, "block_mask_tracing": False}
        assert install.stock_lowering(GROUPED_MM) is stock["grouped_mm lowering"]
        assert inductor_config.benchmark_epilogue_fusion == stock["benchmark_epilogue_fusion"]
        with pytest.raises(RuntimeError, match="no lowering of ours"):
            install.stock_lowering(HOP)


def test_the_defaults_install_the_moe_pass_and_the_fused_ops_lowerings(stock):
    # the fusions default to "where autotuned": their lowerings autotune them, so they must be in
    with inductor_cute.enable():
        assert installed()["grouped_mm_gated_lowering"] and installed()["grouped_mm_rows_lowering"]
        assert installed()["grouped_mm_gate_grad_lowering"]
        assert inductor_config.post_grad_custom_pre_pass.uuid().endswith("-gatea-gathera-route1")
    with inductor_cute.enable(fuse_moe_gate=0, fuse_moe_gather=0, moe_routing=0, group_gemv=0,
                              moe_scatters=0):  # falsy: off
        assert not installed()["grouped_mm_gated_lowering"] and not installed()["grouped_mm_rows_lowering"]
        assert not installed()["grouped_mm_gate_grad_lowering"]
        assert inductor_config.post_grad_custom_pre_pass is None
        assert inductor_config.post_grad_custom_post_pass is None
        assert inductor_config.joint_custom_pre_pass is None


def test_traced_block_masks_alone_install_the_flex_lowering(stock):
    # it realizes the captured tensors of the calls the stock lowering gets (test_block_masks.py)
    with inductor_cute.enable(flex_decode=False):
        assert installed()["flex_attention_lowering"] and installed()["block_mask_tracing"]
        assert installed()["flex_attention_backward_lowering"]  # the stock backward builds them so too
        assert install.stock_lowering(HOP) is stock["flex lowering"]


def test_flex_prefill_alone_installs_the_flex_lowering(stock):
    assert install.Settings().flex_prefill is False  # opt-in
    with inductor_cute.enable(flex_decode=False, flex_prefill=True):
        assert installed()["flex_attention_lowering"]
        assert V.choices.settings == install.Settings(flex_decode=False, flex_prefill=True, **ENABLE_DEFAULTS)
        assert V.choices.uuid().endswith("flex0-prefill1-bwd0-ggemv1-pdl0-m1mm0-tbm1-gatea-gathera-route1-scat1")
    with inductor_cute.enable():
        assert V.choices.settings == install.Settings(flex_decode=True, flex_prefill=False, **ENABLE_DEFAULTS)
        # training through our kernels is opt-in: the backward lowering, installed for traced masks'
        # captures, declines (test_flex_backward_lowering.py: "opt-in: enable(flex_backward=True)")
        assert not V.choices.settings.flex_backward and installed()["flex_attention_backward_lowering"]


def test_flex_backward_installs_the_backward_lowering(stock):
    assert install.Settings().flex_backward is False  # opt-in
    with inductor_cute.enable(flex_backward=True):
        assert installed()["flex_attention_lowering"] and installed()["flex_attention_backward_lowering"]
        assert V.choices.settings == install.Settings(flex_decode=True, flex_backward=True, **ENABLE_DEFAULTS)
        assert V.choices.uuid().endswith("flex1-prefill0-bwd1-ggemv1-pdl0-m1mm0-tbm1-gatea-gathera-route1-scat1")


def test_nesting_with_other_settings_restores_each_level_exactly(stock):
    inductor_cute.enable(fuse_epilogues=True, flex_decode=True)
    outer = state()
    inductor_cute.enable(fuse_epilogues=False, flex_decode=False, trace_block_masks=False)  # takes hooks out
    assert not installed()["cuda_scheduling"] and not installed()["flex_attention_lowering"]
    assert V.choices.settings == install.Settings(fuse_epilogues=False, flex_decode=False,
                                                  trace_block_masks=False, **ENABLE_DEFAULTS)
    assert install.active_settings() == install.Settings(trace_block_masks=False, **ENABLE_DEFAULTS)
    inductor_cute.enable(fuse_epilogues=True, flex_decode=False)
    assert install.active_settings().fuse_epilogues and installed()["cuda_scheduling"]
    inductor_cute.disable()
    inductor_cute.disable()
    assert_same(outer, state())  # the same objects back, not copies
    assert V.choices.settings == install.Settings(fuse_epilogues=True, flex_decode=True, **ENABLE_DEFAULTS)
    inductor_cute.disable()
    assert_same(stock, state())
    assert not any(installed().values())


def test_enable_twice_then_disable_twice(stock):
    inductor_cute.enable()
    once = state()
    inductor_cute.enable()
    assert_same(once, state())  # a second enable with the same settings changes nothing
    assert inductor_config.max_autotune_gemm_backends.upper().split(",").count("ICUTE") == 1
    inductor_cute.disable()
    assert_same(once, state())
    inductor_cute.disable()
    assert_same(stock, state())
    inductor_cute.disable()  # not enabled: nothing to undo
    assert_same(stock, state())


def test_an_exception_inside_with_enable_still_restores(stock):
    with pytest.raises(ValueError, match="inside"):
        with inductor_cute.enable(fuse_epilogues=True, flex_backward=True, keep_m1_mm=True, trace_block_masks=True,
                                  fuse_moe_gate=True, fuse_moe_gather=True):
            assert all(installed().values())
            raise ValueError("raised inside the block")
    assert_same(stock, state())
    assert not install._saved


def test_a_hook_failing_to_install_leaves_nothing_behind(stock, monkeypatch):
    flex = install.hook("flex_attention_lowering")

    def broken():
        raise OSError("cannot install")

    monkeypatch.setattr(flex, "install", broken)
    with pytest.raises(OSError, match="cannot install"):
        inductor_cute.enable(fuse_epilogues=True)
    assert_same(stock, state())
    assert not install._saved


@pytest.mark.parametrize("name", [h.name for h in install.HOOKS])
def test_each_hook_is_idempotent_and_puts_back_what_it_replaced(stock, name):
    h = install.hook(name)
    h.install()
    once = state()
    h.install()
    assert h.installed()
    assert_same(once, state())
    h.uninstall()
    assert not h.installed()
    assert_same(stock, state())
    h.uninstall()
    assert_same(stock, state())


def test_the_extern_kernel_puts_back_an_entry_it_found_under_its_name(stock):
    kernels = select_algorithm.extern_kernels
    left_over = object()  # what an earlier copy of our module would have registered
    kernels.inductor_cute_gemm = left_over
    try:
        with inductor_cute.enable():
            from inductor_cute.inductor.gemm import runtime

            assert kernels.inductor_cute_gemm is runtime.gemm
        assert kernels.inductor_cute_gemm is left_over
    finally:
        del kernels.inductor_cute_gemm


def test_inductor_configured_directly_registers_the_extern_kernel_on_first_use(stock):
    from inductor_cute.inductor.gemm.extern import gemm_choice

    was_installed = install.GEMM_KERNEL.installed()  # by an earlier test's compile
    install.GEMM_KERNEL.uninstall()
    choice = gemm_choice()
    try:
        assert install.GEMM_KERNEL.installed() and gemm_choice() is choice
        assert select_algorithm.extern_kernels.inductor_cute_gemm is choice.to_callable()
        with inductor_cute.enable():  # already there: kept by disable()
            pass
        assert gemm_choice() is choice
    finally:
        install.GEMM_KERNEL.uninstall()
        if was_installed:
            install.GEMM_KERNEL.install()


def test_this_threads_choices_follow_the_config(stock):
    assert not isinstance(V.choices, CuteChoices)  # built from the stock config (and kept by Inductor)
    with inductor_cute.enable(flex_decode=False):
        assert isinstance(V.choices, CuteChoices)
        assert V.choices.settings == install.Settings(flex_decode=False, **ENABLE_DEFAULTS)
        assert V.choices.uuid() == inductor_config.inductor_choices_class().uuid()
    with inductor_config.patch(inductor_choices_class=install.choices_factory(flex_decode=True)):
        assert V.choices.settings == install.Settings(flex_decode=True)  # the config set directly after disable()
    assert not isinstance(V.choices, CuteChoices)  # rebuilt from the stock config


def test_another_threads_choices_follow_the_config(stock):
    """A thread that compiled once (autograd's, which compiles backward graphs) builds its V.choices
    again after each enable() and disable(): it neither keeps an earlier enable()'s settings nor
    offers our choices after disable()."""
    with concurrent.futures.ThreadPoolExecutor(1) as worker:  # one thread, kept between calls
        def settings():
            # in this thread's context: torch 2.13's config values are context variables, which a
            # thread does not inherit (torch carries them to the compile of a backward graph)
            context = contextvars.copy_context()
            return worker.submit(context.run, lambda: getattr(V.choices, "settings", None)).result()

        assert settings() is None  # stock, built before enable()
        with inductor_cute.enable(flex_backward=True):
            assert settings() == install.Settings(flex_decode=True, flex_backward=True, **ENABLE_DEFAULTS)
            with inductor_cute.enable(flex_backward=False):  # no use of V.choices in between
                assert settings() == install.Settings(flex_decode=True, flex_backward=False, **ENABLE_DEFAULTS)
            assert settings() == install.Settings(flex_decode=True, flex_backward=True, **ENABLE_DEFAULTS)
        assert settings() is None
        with inductor_cute.enable(fuse_epilogues=True):
            assert settings() == install.Settings(fuse_epilogues=True, flex_decode=True, **ENABLE_DEFAULTS)
        assert settings() is None


@pytest.mark.parametrize("handler", ["ours", "stock", "the one Inductor built"])
def test_a_handler_the_user_set_is_kept(stock, handler):
    mine = {"ours": lambda: CuteChoices(settings=install.Settings(fuse_epilogues=True)),
            "stock": InductorChoices, "the one Inductor built": lambda: V.choices}[handler]()
    with V.set_choices_handler(mine):
        with inductor_cute.enable(flex_backward=True):
            assert V.choices is mine
        assert V.choices is mine
    assert V.choices is not mine or handler == "the one Inductor built"
    with inductor_cute.enable():  # the user's context is over: what it put back follows the config again
        assert isinstance(V.choices, CuteChoices) and V.choices is not mine


def test_pins_count_per_thread_and_end_with_their_context(stock):
    mine = InductorChoices()
    with V.set_choices_handler(mine):
        with V.set_choices_handler(mine):  # the same instance twice: the outer pin outlives the inner
            pass
        with inductor_cute.enable():
            assert V.choices is mine
    with pytest.raises(ValueError):  # a pin ends with its context however the context ends
        with V.set_choices_handler(mine):
            raise ValueError
    with inductor_cute.enable():
        assert isinstance(V.choices, CuteChoices)

    # another thread's pin of the same instance is that thread's: ours does not keep it here
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        entered, release = threading.Event(), threading.Event()

        def pin_there():
            with V.set_choices_handler(mine):
                entered.set()
                release.wait(10)

        pinned = worker.submit(pin_there)
        entered.wait(10)
        with V.set_choices_handler(mine):
            pass
        with inductor_cute.enable():
            assert isinstance(V.choices, CuteChoices)
        release.set()
        pinned.result()


def test_a_permanent_pin_is_kept(stock):
    mine = InductorChoices()
    pin = V.set_choices_handler(mine)  # without a `with`: for good, as long as its context is not used
    for _ in range(2):
        with inductor_cute.enable():
            assert V.choices is mine
    with pin:  # the context used at last: its exit puts the handler before back and ends the pin
        pass
    assert V.choices is not mine
    with inductor_cute.enable():
        assert isinstance(V.choices, CuteChoices)


def test_settings_enter_the_factorys_tag():
    tags = {install.choices_factory(f, d, p, b)().uuid() for f in (False, True) for d in (False, True)
            for p in (False, True) for b in (False, True)}
    assert len(tags) == 16
    assert install.choices_factory(True, False)().uuid().endswith("fuse1-flex0-prefill0-bwd0-ggemv0-pdl0-m1mm0-tbm1-gate0-gather0-route0-scat0")
    assert install.choices_factory(True, False)().settings == install.Settings(True, False)


def test_pdl_turns_on_inductors_dependent_launch_for_the_enabled_level_only():
    assert inductor_config.triton.enable_pdl is False
    with inductor_cute.enable(pdl=True):
        assert inductor_config.triton.enable_pdl is True
        with inductor_cute.enable():  # an inner level without it has the value from before
            assert inductor_config.triton.enable_pdl is False
        assert inductor_config.triton.enable_pdl is True
    assert inductor_config.triton.enable_pdl is False
    with inductor_config.patch({"triton.enable_pdl": True}):  # the user's own setting
        with inductor_cute.enable(pdl=True), inductor_cute.enable():
            assert inductor_config.triton.enable_pdl is True
        with inductor_cute.enable():
            assert inductor_config.triton.enable_pdl is True


def test_choices_factory_gives_what_enable_sets_for_the_same_settings(stock):
    # a graph cached by an enabled process is found by one that sets the factory directly
    # (tests/gpu/test_flex_compile_gpu.py: test_fx_cached_graph_runs_in_a_fresh_process)
    with inductor_cute.enable(flex_decode=True, group_gemv=False, moe_routing=False, fuse_moe_gate=False,
                              fuse_moe_gather=False, moe_scatters=False):
        assert inductor_config.inductor_choices_class is install.choices_factory(flex_decode=True)
    with inductor_cute.enable(flex_decode=True):  # the grouped GEMV pass on: another key
        assert inductor_config.inductor_choices_class is not install.choices_factory(flex_decode=True)
