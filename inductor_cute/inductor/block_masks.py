"""BlockMasks built inside a compiled model stay in its graph (enable()'s trace_block_masks, on by default).

transformers builds each step's BlockMask with `create_block_mask(..., _compile=True)`. Since
torch 2.10 that path first calls `warnings.warn` (the flag is deprecated), and Dynamo cannot trace
`warnings.warn`: every compiled forward breaks its graph there. A 4-layer Llama decode step became
4-6 graphs with Python between them, and on the H200 the device waited 100-380 us per step for the
host between them (models suite, device notes), 8-25% of the step, in stock and enabled runs alike.
Under torch.compile the flag has no purpose: the outer compile traces create_block_mask's body into
its own graph, as `torch.compile(create_block_mask)` does. So while this is installed, Dynamo traces
every decode-sized call of create_block_mask (Q_LEN <= MAX_TRACED_Q_LEN) as if `_compile=False`
were passed (a Dynamo polyfill; eager calls are untouched), and the mask is built by kernels of the
model's graph, its tensors viewed at packed strides (`with_packed_strides`: stock Inductor's Triton
flex templates assume them, and a traced mask's layout is Inductor's choice). Longer queries keep
the stock path for now: in the seventeenth session's models run a prefill step (8 x 2048 tokens) of
stock flex_attention with its BlockMask traced into the graph gave logits 1.2 relative error from
eager, which the strides explain (found on the CPU in the eighteenth session); the limit goes once
benchmarks/traced_mask_check.py shows traced prefill masks right on the GPU (a prefill step is
long: its graph break costs little). transformers' check of a 2-D attention mask for zeros
(`fast_all`) is traced as False, for the same reason (below).

The polyfill is registered with Dynamo once and stays (Dynamo offers no way to remove one); while
not installed it calls create_block_mask as written. Whether it is installed is read at trace time
without a guard (`assume_constant_result`): a graph traced while it was keeps its single graph
after disable(), as graphs lowered with our kernels keep them; and a graph traced before it was
installed keeps its breaks until Dynamo traces it again (`torch._dynamo.reset()`), so enable it
before the model's first compiled call.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import logging
import sys
import types

import torch

from ..kernels.attention.flex_decode_config import MAX_Q_LEN as MAX_TRACED_Q_LEN  # the decode kernel's

log = logging.getLogger(__name__)
_active = [False]


@functools.cache
def _polyfill_registered() -> bool:
    """Register the polyfill (once per process); False where this torch's create_block_mask has no
    `_compile` flag (nothing to undo) or Dynamo refuses the registration."""
    from torch.nn.attention import flex_attention

    original = flex_attention.create_block_mask
    params = list(inspect.signature(original).parameters)
    if "_compile" not in params:
        return False
    flag_at, q_len_at = params.index("_compile"), params.index("Q_LEN")
    # the same code as a second function object: Dynamo inlines it like the original, and a call
    # of it is not a call of the original (which would lead back here)
    as_written = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                                    original.__defaults__, original.__closure__)
    as_written.__kwdefaults__ = original.__kwdefaults__
    is_active = torch._dynamo.assume_constant_result(installed)

    def create_block_mask_traced(*args, **kwargs):
        q_len = kwargs["Q_LEN"] if "Q_LEN" in kwargs else args[q_len_at]
        if not (is_active() and q_len <= MAX_TRACED_Q_LEN):
            return as_written(*args, **kwargs)
        if len(args) > flag_at:  # passed positionally (later parameters may follow it: torch 2.13)
            args = (*args[:flag_at], False, *args[flag_at + 1:])
        else:
            kwargs = {**kwargs, "_compile": False}
        return with_packed_strides(as_written(*args, **kwargs))

    try:
        torch._dynamo.substitute_in_graph(original)(create_block_mask_traced)
    except (TypeError, ValueError) as e:  # another polyfill for it, or a torch that refuses Python functions
        log.warning("inductor-cute: BlockMasks built in compiled code stay outside its graph: %s", e)
        return False
    return True


# The BlockMask's tensors, (Z, H, rows[, cols]) each: the lists of both directions, and torch 2.13's
# backward orderings
_MASK_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices", "dq_write_order", "dq_write_order_full",
                 "dq_kv_order", "dq_kv_order_spt")


def packed_strides(shape) -> tuple:
    """Row-major strides of `shape` in which a size-1 dimension's stride is still the product of
    the sizes after it (what a fresh eager tensor has)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return tuple(reversed(strides))


def with_packed_strides(block_mask):
    """`block_mask` with each tensor viewed at packed strides (as_strided, no copy). Stock
    Inductor's Triton flex_attention forward and backward templates find a batch's rows at
    (z * H + h) * stride(1), which assumes stride(0) == H * stride(1); traced into a graph, the
    mask's tensors are laid out by Inductor, which gave a size-1 head dim of a (4, 1, 8, 8)
    kv_indices the stride 256 (strides (64, 256, 8, 1): contiguous to torch, which ignores size-1
    dims), so the template read every batch past the first from the wrong place (the seventeenth
    session's 1.2 relative error on a traced prefill mask). The decode template reads all strides."""
    for name in _MASK_TENSORS:
        t = getattr(block_mask, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            # as_strided reads the storage: only a contiguous tensor (size-1 dims aside, as eager
            # sees it here) keeps its values at packed strides; any other is copied first
            t = t if t.is_contiguous() else t.contiguous()
            setattr(block_mask, name, t.as_strided(t.shape, packed_strides(t.shape)))
    return block_mask


# transformers (5.x) adds a padding term to a flex mask only where its 2-D attention mask has a zero,
# `if attention_mask is not None and not fast_all(attention_mask)` (masking_utils): under
# torch.compile that branch on a tensor's value breaks the graph at every mask a step builds, and
# generate() passes an attention mask at every step. Every caller of fast_all uses a True only to
# skip work that is correct either way (the padding term of an all-ones mask keeps every key), so
# traced calls answer False: the step keeps the padding term, read from the mask at run time, and
# one graph serves any padding. Eager calls are untouched. Registered at enable() when
# masking_utils is already imported, else as soon as it is (an import hook while enabled).
_TRANSFORMERS_MASKS = "transformers.masking_utils"


def _fast_all_polyfill(masking_utils) -> None:
    """Register the fast_all polyfill (once per process), unless this transformers has no
    fast_all of that shape; a failure only leaves the graph breaks (logged), never a user's compile."""
    original = getattr(masking_utils, "fast_all", None)
    if not isinstance(original, types.FunctionType) or list(inspect.signature(original).parameters) != ["tensor"]:
        return
    as_written = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                                    original.__defaults__, original.__closure__)
    is_active = torch._dynamo.assume_constant_result(installed)

    def fast_all_traced(tensor):
        return False if is_active() else as_written(tensor)

    try:
        torch._dynamo.substitute_in_graph(original)(fast_all_traced)
    except Exception as e:  # noqa: BLE001 (it may run inside an import of the user's)
        log.warning("inductor-cute: transformers' padding-mask check still breaks compiled graphs: %s", e)


_fast_all_registered: list = []  # the masking_utils module whose fast_all is polyfilled


def _register_fast_all() -> None:
    masking_utils = sys.modules.get(_TRANSFORMERS_MASKS)
    if masking_utils is not None and not _fast_all_registered:
        _fast_all_registered.append(masking_utils)
        _fast_all_polyfill(masking_utils)


class _OnMaskingUtilsImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the fast_all polyfill right after transformers.masking_utils is imported (importing
    it at enable() would cost every enable() about a second): a finder that hands out the real
    spec with itself as the loader, delegating to the real one."""

    def find_spec(self, name, path, target=None):
        if name != _TRANSFORMERS_MASKS or _fast_all_registered:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _register_fast_all()  # the module is in sys.modules while it executes


_IMPORT_HOOK = _OnMaskingUtilsImport()


def install() -> None:
    if _polyfill_registered():
        _active[0] = True
        _register_fast_all()
        if not _fast_all_registered and _IMPORT_HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _IMPORT_HOOK)


def uninstall() -> None:
    _active[0] = False
    if _IMPORT_HOOK in sys.meta_path:
        sys.meta_path.remove(_IMPORT_HOOK)


def installed() -> bool:
    return _active[0]
