"""What a torch.compile'd graph's flex decode and prefill calls run on Inductor's buffers.

The custom op `torch.ops.inductor_cute.flex_decode` (lowering.py) calls `flex_decode` here. The
values static per call site (scale, the programs' texts, block sizes) pick one FlexDecodeLauncher;
its first call with tensors of a layout goes through every check of ops.flex_decode (program
canonicalisation, block-mask conversions, operand restriding, the split count, the kernel
lookup); later calls with that layout repeat the launch it remembered (host.flex.FlexDecodeLaunch):
a layout key, the operand views, fresh partials and outputs from the caching allocator, the
kernel call. Another layout (a dynamic size, another stride or alignment) takes the checked path
again. Launchers hold no tensor and are built from plain values: a graph loaded from Inductor's
FX cache builds them in a fresh process.

A FlexPrefillLauncher (`torch.ops.inductor_cute.flex_prefill`, prefill.py) calls the eager
host.flex_prefill each time: a prefill's device time dwarfs those checks. So does a
FlexBackwardLauncher (`torch.ops.inductor_cute.flex_backward`, backward.py) with
host.flex_backward.
"""

from __future__ import annotations

import torch

from ...host import flex as host_flex
from ...host import flex_backward as host_backward
from ...host import flex_prefill as host_prefill

MODULE = __name__
PLANS_PER_LAUNCHER = 64  # layouts one launcher remembers (dynamic sizes); then it starts over


def layout_key(sources: tuple, n_score: int) -> tuple:
    """What a remembered launch depends on: each source's shape, strides, dtype and 16-byte
    alignment, how many of them are the score_mod's, and q's device (the checked path refused
    tensors on another)."""
    return (n_score, sources[0].device,
            *[None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in sources])


class _CallSite:
    """What output code fixes for one flex call site: the op's static arguments."""

    __slots__ = ("scale", "score_mod", "mask_mod", "kv_block_size", "q_block_size")

    def __init__(self, scale: float, score_mod: str = "", mask_mod: str = "", kv_block_size: int = 0,
                 q_block_size: int = 0) -> None:
        self.scale, self.score_mod, self.mask_mod = scale, score_mod, mask_mod
        self.kv_block_size, self.q_block_size = kv_block_size, q_block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale!r}, score_mod={self.score_mod!r}, " \
               f"mask_mod={self.mask_mod!r}, kv_block_size={self.kv_block_size!r}, " \
               f"q_block_size={self.q_block_size!r})"


class FlexDecodeLauncher(_CallSite):
    """One call site's flex decode: ops.flex_decode(q, k, v, scale=, score_mod=, mask_mod=, block
    sizes=) returning (out, lse), with k/v views the kernel cannot stream copied (a graph may
    slice them) rather than refused."""

    __slots__ = ("_plans", "_static")

    def __init__(self, scale: float, score_mod: str = "", mask_mod: str = "", kv_block_size: int = 0,
                 q_block_size: int = 0) -> None:
        super().__init__(scale, score_mod, mask_mod, kv_block_size, q_block_size)
        self._plans: dict[tuple, host_flex.FlexDecodeLaunch | None] = {}  # None: checked path each call
        self._static: host_flex.FlexDecodeLaunch | None = None

    def launch(self, q, k, v, score_tensors, mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks,
               full_kv_indices) -> tuple[torch.Tensor, torch.Tensor]:
        sources = (q, k, v, None, *score_tensors, *mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices)
        key = layout_key(sources, len(score_tensors))
        launch = self._plans.get(key)
        if launch is not None:
            return launch(sources)
        return self.checked(sources, len(score_tensors), key)

    def call(self, q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks, kv_indices,
             full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size) -> tuple[torch.Tensor, torch.Tensor]:
        """The custom op's arguments (what output code passes, in the schema's order); the static
        ones are this launcher's own."""
        return self.launch(q, k, v, score_tensors, mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks,
                           full_kv_indices)

    def call_static(self, q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks,
                    kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size,
                    q_block_size) -> tuple[torch.Tensor, torch.Tensor]:
        """`call` for a call site whose tensors all have static layouts (lowering.py decides): the
        launch remembered from the first 16-byte aligned call serves every later aligned one
        without a layout key (as GemmLauncher.launch_static, whose docstring says why)."""
        sources = (q, k, v, None, *score_tensors, *mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks,
                   full_kv_indices)
        aligned = not any(t is not None and t.data_ptr() & 15 for t in sources)
        launch = self._static
        if launch is not None and aligned:
            return launch(sources)
        key = layout_key(sources, len(score_tensors))
        launch = self._plans.get(key)
        if launch is None:
            out, lse = self.checked(sources, len(score_tensors), key)
            launch = self._plans[key]
        else:
            out, lse = launch(sources)
        if aligned:
            self._static = launch  # None where the checked path copied an operand: checked each call
        return out, lse

    def checked(self, sources: tuple, n_score: int, key: tuple | None = None):
        """(out, lse) of the call on `sources` (host_flex.sources' order, kv_len None) through every
        check; remembers the launch that repeats it under `key`."""
        q, k, v, _, *rest = sources
        score_tensors, mask_tensors, block_mask = rest[:n_score], rest[n_score:-4], rest[-4:]
        out, lse, launch = host_flex.run_checked(
            q, k, v, scale=self.scale, score_mod=self.score_mod or None, score_tensors=score_tensors,
            mask_mod=self.mask_mod or None, mask_tensors=mask_tensors, block_mask=block_mask,
            kv_block_size=self.kv_block_size, q_block_size=self.q_block_size, copy_kv=True)
        if key is not None:
            if len(self._plans) >= PLANS_PER_LAUNCHER:
                self._plans.clear()
            self._plans[key] = launch
        return out, lse


_LAUNCHERS: dict[tuple, FlexDecodeLauncher] = {}


def launcher(scale: float, score_mod: str, mask_mod: str, kv_block_size: int, q_block_size: int
             ) -> FlexDecodeLauncher:
    """The shared launcher for these static values (one per distinct call site's values)."""
    key = (scale, score_mod, mask_mod, kv_block_size, q_block_size)
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _LAUNCHERS.setdefault(key, FlexDecodeLauncher(*key))
    return found


def flex_decode(q, k, v, scale: float, score_mod: str, score_tensors, mask_mod: str, mask_tensors, kv_num_blocks,
                kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size: int, q_block_size: int):
    """The custom op's arguments (its schema's order) -> (out, lse)."""
    key = (scale, score_mod, mask_mod, kv_block_size, q_block_size)
    found = _LAUNCHERS.get(key)
    if found is None:
        found = launcher(*key)
    return found.launch(q, k, v, score_tensors, mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks,
                        full_kv_indices)


class FlexPrefillLauncher(_CallSite):
    """One call site's flex prefill: host.flex_prefill(q, k, v, scale=, score_mod=, mask_mod=, block
    sizes=, return_lse=True) returning (out, lse), lse in natural-log units. `call` and
    `call_static` take the custom op's arguments (its schema's order), as FlexDecodeLauncher's."""

    __slots__ = ()

    def call(self, q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks, kv_indices,
             full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size) -> tuple[torch.Tensor, torch.Tensor]:
        return host_prefill.flex_prefill(
            q, k, v, scale=self.scale, score_mod=self.score_mod or None, score_tensors=score_tensors,
            mask_mod=self.mask_mod or None, mask_tensors=mask_tensors, kv_num_blocks=kv_num_blocks,
            kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
            kv_block_size=self.kv_block_size, q_block_size=self.q_block_size, return_lse=True)

    call_static = call  # nothing is remembered per layout


def flex_prefill(q, k, v, scale: float, score_mod: str, score_tensors, mask_mod: str, mask_tensors, kv_num_blocks,
                 kv_indices, full_kv_num_blocks, full_kv_indices, kv_block_size: int, q_block_size: int):
    """The prefill custom op's arguments (its schema's order) -> (out, lse)."""
    return FlexPrefillLauncher(scale, score_mod, mask_mod, kv_block_size, q_block_size).call(
        q, k, v, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks, kv_indices,
        full_kv_num_blocks, full_kv_indices, kv_block_size, q_block_size)


class FlexBackwardLauncher:
    """One call site's flex backward: host.flex_backward(q, k, v, out, lse, grad_out, scale=,
    score_mod=, mask_mod=, both BlockMask list sets, block sizes=) returning (dq, dk, dv); lse in
    natural-log units. `call` and `call_static` take the backward op's arguments (its schema's order)."""

    __slots__ = ("scale", "score_mod", "mask_mod", "kv_block_size", "q_block_size")

    def __init__(self, scale: float, score_mod: str = "", mask_mod: str = "", kv_block_size: int = 0,
                 q_block_size: int = 0) -> None:
        self.scale, self.score_mod, self.mask_mod = scale, score_mod, mask_mod
        self.kv_block_size, self.q_block_size = kv_block_size, q_block_size

    def __repr__(self) -> str:
        return f"FlexBackwardLauncher(scale={self.scale!r}, score_mod={self.score_mod!r}, " \
               f"mask_mod={self.mask_mod!r}, kv_block_size={self.kv_block_size!r}, q_block_size={self.q_block_size!r})"

    def call(self, q, k, v, out, lse, grad_out, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks,
             kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks,
             full_q_indices, kv_block_size, q_block_size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sparse = {} if kv_num_blocks is None else dict(kv_block_size=self.kv_block_size,
                                                       q_block_size=self.q_block_size)
        return host_backward.flex_attention_backward(
            q, k, v, out, lse, grad_out, scale=self.scale, score_mod=self.score_mod or None,
            score_tensors=score_tensors, mask_mod=self.mask_mod or None, mask_tensors=mask_tensors,
            kv_num_blocks=kv_num_blocks, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num_blocks,
            full_kv_indices=full_kv_indices, q_num_blocks=q_num_blocks, q_indices=q_indices,
            full_q_num_blocks=full_q_num_blocks, full_q_indices=full_q_indices, **sparse)

    call_static = call  # nothing is remembered per layout


def flex_backward(q, k, v, out, lse, grad_out, scale: float, score_mod: str, score_tensors, mask_mod: str,
                  mask_tensors, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
                  full_q_num_blocks, full_q_indices, kv_block_size: int, q_block_size: int):
    """The backward custom op's arguments (its schema's order) -> (dq, dk, dv)."""
    return FlexBackwardLauncher(scale, score_mod, mask_mod, kv_block_size, q_block_size).call(
        q, k, v, out, lse, grad_out, scale, score_mod, score_tensors, mask_mod, mask_tensors, kv_num_blocks,
        kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        kv_block_size, q_block_size)
