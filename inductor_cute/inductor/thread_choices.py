"""V.choices in every thread follows `config.inductor_choices_class`, as enable() and disable() set it.

Inductor builds V.choices lazily, once per thread, from the config, and keeps it in a thread-local
(`virtualized._choices_default`). A thread that compiled once keeps what it built then: a training
graph's backward is compiled in autograd's device thread, so after enable(flex_backward=True) and a
later enable(flex_backward=False), that thread kept the first settings and ran our backward behind a
stock forward (seen on the H100, twenty-second session). torch 2.11 and 2.13 have no public way to
drop another thread's entry, so `track_thread_choices()` replaces the lazy default with one that
records, per thread, which config value built the thread's instance, and wraps the lookup: an
instance built from a config value other than today's is built again on its next use. An instance
given to `V.set_choices_handler` is the setter's while its context lasts (for good without a
`with`), in that thread, whoever built it.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from torch._inductor import config, virtualized
from torch._inductor.choices import InductorChoices

from .gemm.choices import CuteChoices

_thread = threading.local()  # built: (the instance the default built here, its config value); pins: below


def track_thread_choices() -> None:
    """Install the recording default, the checking lookup and the pinning setter, once (they stay
    after disable(): a thread may hold an instance of ours long after)."""
    choices = getattr(virtualized, "_choices", None)
    if choices is None or not hasattr(choices, "_key"):
        return  # a torch without that entry: threads keep what they built, as stock Inductor does
    if getattr(choices._get_handler, "_inductor_cute", False):
        return
    lookup, key = choices._get_handler, choices._key

    def built_by_default():
        factory = config.inductor_choices_class  # read once: the record must name what built it
        value = factory() if factory is not None else InductorChoices()
        setattr(virtualized.threadlocal, key, value)
        _thread.built = (value, factory)
        return value

    @functools.wraps(lookup)
    def current(check_poisoned: bool = True):
        value = lookup(check_poisoned)
        return built_by_default() if _stale(value) else value

    setter = type(virtualized.V).set_choices_handler

    def set_choices_handler(value):
        restore = setter(value)
        _pin(value, +1)

        @contextlib.contextmanager
        def scoped():
            try:
                with restore:
                    yield
            finally:
                _pin(value, -1)

        return scoped()

    current._inductor_cute = True
    choices._default = built_by_default
    choices._get_handler = current  # an instance attribute: V.choices calls _choices._get_handler()
    type(virtualized.V).set_choices_handler = staticmethod(set_choices_handler)


def _pins() -> dict:
    """This thread's pinned instances: id -> (the instance, how many live pins); the reference
    keeps the id from being reused while pinned."""
    if not hasattr(_thread, "pins"):
        _thread.pins = {}
    return _thread.pins


def _pin(value, change: int) -> None:
    pins = _pins()
    count = pins.get(id(value), (value, 0))[1] + change
    if count > 0:
        pins[id(value)] = (value, count)
    else:
        pins.pop(id(value), None)


def _stale(value) -> bool:
    if id(value) in _pins():
        return False
    built, factory = getattr(_thread, "built", (None, None))
    if built is value:
        return factory is not config.inductor_choices_class
    # an instance built before tracking began (or put back by a context it outlived): stale where
    # it is what the stock default builds without a config, or a CuteChoices of other settings
    factory = config.inductor_choices_class
    if type(value) is InductorChoices:
        return factory is not None
    return isinstance(value, CuteChoices) and value.uuid() != getattr(factory, "keywords", {}).get("tag")
