"""The kinds of replacement inductor-cute makes in torch's state (install.py lists the instances).

A hook's `install()` is idempotent and `uninstall()` puts back exactly what `install()` replaced (a
no-op when not installed). References to our own families are resolved at install, so importing
this module imports none of them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable

from .settings import Settings

log = logging.getLogger(__name__)
_LOWERING_WRAPPERS: list = []  # every LoweringWrapper made: where stock_lowering looks


class Hook:
    """One replacement in torch's state, installed when `when(settings)` holds."""

    def __init__(self, name: str, when: Callable[[Settings], bool] = lambda settings: True) -> None:
        self.name = name
        self.when = when

    def installed(self) -> bool:
        raise NotImplementedError

    def install(self) -> None:
        raise NotImplementedError

    def uninstall(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} installed={self.installed()}>"


class LoweringWrapper(Hook):
    """`lowering` in place of `torch._inductor.lowering.lowerings[op]`; the lowering it replaced is
    `stock_lowering(op)` while installed."""

    def __init__(self, name: str, op: Callable[[], Any], lowering: Callable[[], Callable], **kw) -> None:
        super().__init__(name, **kw)
        self.op, self._lowering = op, lowering  # resolved at install: importing us imports no family
        self.stock = None
        _LOWERING_WRAPPERS.append(self)

    def installed(self) -> bool:
        from torch._inductor import lowering

        return self.stock is not None and lowering.lowerings.get(self.op()) is self._lowering()

    def install(self) -> None:
        from torch._inductor import lowering  # registers the stock lowerings

        if not self.installed():
            self.stock = lowering.lowerings[self.op()]
            lowering.lowerings[self.op()] = self._lowering()

    def uninstall(self) -> None:
        from torch._inductor import lowering

        if self.stock is None:
            return
        if lowering.lowerings.get(self.op()) is self._lowering():
            lowering.lowerings[self.op()] = self.stock
        else:
            log.warning("inductor-cute: the lowering of %s was replaced after ours; left as it is", self.op())
        self.stock = None


class SchedulingWrapper(Hook):
    """`make(replaced)` as a device's scheduling constructor in Inductor's codegen registry
    (`codegen.common.device_codegens`), the rest of the device's entry kept."""

    def __init__(self, name: str, device: str, make: Callable[[], Callable], **kw) -> None:
        super().__init__(name, **kw)
        self.device, self._make = device, make
        self._replaced = self._ours = None  # registry entries; kept after uninstall to reuse `_ours`

    def installed(self) -> bool:
        from torch._inductor.codegen import common

        return self._ours is not None and common.device_codegens.get(self.device) is self._ours

    def install(self) -> None:
        from torch._inductor.codegen import common

        if self.installed():
            return
        if not common.device_codegens:
            common.init_backend_registration()
        current = common.device_codegens[self.device]
        if current is not self._replaced or self._ours is None:
            self._replaced = current
            self._ours = dataclasses.replace(current, scheduling=self._make()(current.scheduling))
        common.device_codegens[self.device] = self._ours

    def uninstall(self) -> None:
        from torch._inductor.codegen import common

        if self.installed():
            common.device_codegens[self.device] = self._replaced


class AttributeWrapper(Hook):
    """`make(replaced)` in place of the attribute `attr` of `owner`: a module's name (a function a
    stock lowering looks up in its module's globals at every call) or "module:Class" (a method, as
    the class holds it: a classmethod object for a classmethod). A torch without that attribute
    leaves the hook uninstalled, with a warning."""

    def __init__(self, name: str, owner: str, attr: str, make: Callable[[], Callable], **kw) -> None:
        super().__init__(name, **kw)
        self.owner, self.attr, self._make = owner, attr, make
        self._replaced = self._ours = None  # kept after uninstall to reuse `_ours`

    def _owner(self) -> Any:
        module, _, cls = self.owner.partition(":")
        found = importlib.import_module(module)
        return getattr(found, cls) if cls else found

    def _current(self) -> Any:
        owner = self._owner()
        return vars(owner).get(self.attr) if ":" in self.owner else getattr(owner, self.attr, None)

    def installed(self) -> bool:
        return self._ours is not None and self._current() is self._ours

    def install(self) -> None:
        if self.installed():
            return
        current = self._current()
        if current is None:
            log.warning("inductor-cute: %s.%s not found in this torch; %s not installed", self.owner, self.attr,
                        self.name)
            return
        if current is not self._replaced or self._ours is None:
            self._replaced, self._ours = current, self._make()(current)
        setattr(self._owner(), self.attr, self._ours)

    def uninstall(self) -> None:
        if self.installed():
            setattr(self._owner(), self.attr, self._replaced)


class FeedbackSaver(Hook):
    """A function `select_algorithm` calls with every autotuning's timings."""

    def __init__(self, name: str, fn: Callable[[], Callable], **kw) -> None:
        super().__init__(name, **kw)
        self._fn = fn

    def installed(self) -> bool:
        from .compat import feedback_savers

        return self._fn() in feedback_savers()

    def install(self) -> None:
        from torch._inductor import select_algorithm

        if not self.installed():
            select_algorithm.add_feedback_saver(self._fn())

    def uninstall(self) -> None:
        from .compat import feedback_savers

        savers = feedback_savers()
        while self._fn() in savers:
            savers.remove(self._fn())


class ExternKernel(Hook):
    """An ExternKernelChoice. Constructing one registers its kernel as `extern_kernels.<name>` and
    asserts the name is free, so an entry left there (by an earlier copy of our module) is taken out
    first and put back at uninstall. `choice()` installs on first use: Inductor configured directly,
    without enable(), still gets our choice."""

    def __init__(self, name: str, kernel_name: str, make: Callable[[], Callable[[str], Any]], **kw) -> None:
        super().__init__(name, **kw)
        self.kernel_name, self._make = kernel_name, make
        self._choice = None
        self._replaced: list = []  # the entry found under our name, if any

    def installed(self) -> bool:
        from torch._inductor.select_algorithm import extern_kernels

        return self._choice is not None and hasattr(extern_kernels, self.kernel_name)

    def install(self) -> None:
        from torch._inductor.select_algorithm import extern_kernels

        if self.installed():
            return
        self._replaced = []
        if hasattr(extern_kernels, self.kernel_name):
            self._replaced.append(getattr(extern_kernels, self.kernel_name))
            delattr(extern_kernels, self.kernel_name)
        self._choice = self._make()(self.kernel_name)

    def uninstall(self) -> None:
        from torch._inductor.select_algorithm import extern_kernels

        if self._choice is None:
            return
        if hasattr(extern_kernels, self.kernel_name):
            delattr(extern_kernels, self.kernel_name)
        for entry in self._replaced:
            setattr(extern_kernels, self.kernel_name, entry)
        self._choice, self._replaced = None, []

    def choice(self):
        self.install()
        return self._choice


class ModuleHook(Hook):
    """A replacement kept by a module of ours that has `install()`, `uninstall()` and `installed()`
    (imported at the first call)."""

    def __init__(self, name: str, module: str, **kw) -> None:
        super().__init__(name, **kw)
        self.module = module

    def _impl(self):
        return importlib.import_module(self.module, "inductor_cute.inductor")

    def installed(self) -> bool:
        return self._impl().installed()

    def install(self) -> None:
        self._impl().install()

    def uninstall(self) -> None:
        self._impl().uninstall()


def _attr(module: str, name: str) -> Callable[[], Any]:
    """A reference resolved when a hook installs, so that importing this module imports no family."""
    return lambda: getattr(importlib.import_module(module, "inductor_cute.inductor"), name)


def stock_lowering(op) -> Callable:
    """The lowering our wrapper of `op` replaced: where the calls it declines go."""
    for h in _LOWERING_WRAPPERS:
        if h.stock is not None and h.op() is op:
            return h.stock
    raise RuntimeError(f"inductor-cute: no lowering of ours is installed for {op}")


class DecompositionWrapper(Hook):
    """`make(replaced)` in place of Inductor's decomposition of `op()`, in both tables
    `select_decomp_table()` may return: `torch._inductor.decomposition.decompositions` and the
    cached copy `fast_random_decomps()` (made once, at the first compile)."""

    def __init__(self, name: str, op: Callable[[], Any], make: Callable[[], Callable], **kw) -> None:
        super().__init__(name, **kw)
        self.op, self._make = op, make
        self._replaced = self._ours = None  # kept after uninstall to reuse `_ours`

    @staticmethod
    def _tables() -> list[dict]:
        from torch._inductor import decomposition

        return [decomposition.decompositions, decomposition.fast_random_decomps()]

    def installed(self) -> bool:
        return self._ours is not None and all(t.get(self.op()) is self._ours for t in self._tables())

    def install(self) -> None:
        if self.installed():
            return
        current = self._tables()[0].get(self.op())
        if current is None:
            log.warning("inductor-cute: Inductor has no decomposition of %s; %s not installed", self.op(), self.name)
            return
        if current is not self._replaced or self._ours is None:
            self._replaced, self._ours = current, self._make()(current)
        for table in self._tables():
            table[self.op()] = self._ours

    def uninstall(self) -> None:
        if self._ours is None:
            return
        for table in self._tables():
            if table.get(self.op()) is self._ours:
                table[self.op()] = self._replaced
