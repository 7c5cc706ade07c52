"""torch.compile integration: `enable()` makes Inductor's GEMM autotuning consider our kernels.

    import inductor_cute
    inductor_cute.enable()              # or: with inductor_cute.enable(): ...
    torch.compile(model, mode="max-autotune")

For people who configure Inductor directly, our mm/addmm/bmm choices are two settings (enable()
also installs the flex_attention and grouped_mm lowerings and graph passes, and its settings enter
the factory's cache-key tag, so its graphs are cached apart from these):

    torch._inductor.config.inductor_choices_class = inductor_cute.inductor.choices_factory()
    torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON,ICUTE"

What enable() changes in torch, and how disable() puts it back: inductor/install.py.
Logs: TORCH_LOGS="+inductor_cute" (which choice won, timings, why ours were dropped).
"""

from __future__ import annotations

from .gemm.choices import BACKEND_TOKEN, CuteChoices
from .install import Settings, choices_factory, disable, enable, is_enabled

__all__ = ["BACKEND_TOKEN", "CuteChoices", "Settings", "choices_factory", "disable", "enable", "is_enabled"]
