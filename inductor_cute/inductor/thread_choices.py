"""V.choices in every thread follows `config.inductor_choices_class`, as enable() and disable() set it.

Inductor builds V.choices lazily, once per thread, from the config, and keeps it in a thread-local
(`virtualized._choices_default`). A thread that compiled once keeps what it built then: a training
graph's backward is compiled in autograd's device thread, so after enable(flex_backward=True) and a
later enable(flex_backward=False), that thread kept the first settings and ran our backward behind a
stock forward (seen on the H100, twenty-second session). torch 2.11 and 2.13 have no public way to
drop another thread's entry, so `follow_config()` replaces the lazy default with one that records
which config value built each instance, and wraps the lookup: an instance built from a config value
other than today's is built again on its next use, in whichever thread. An instance set with
`V.set_choices_handler` is the setter's and is kept, even one Inductor built."""

from __future__ import annotations

import contextlib
import functools
import weakref

from torch._inductor import config, virtualized
from torch._inductor.choices import InductorChoices

_built_from: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # instance -> the config value it came from
_set_on_purpose: weakref.WeakSet = weakref.WeakSet()  # instances given to V.set_choices_handler
_NOT_BUILT_HERE = object()


def follow_config() -> None:
    """Install the recording default, the checking lookup and the remembering setter (once; they stay
    installed after disable(): a thread may hold an instance of ours long after)."""
    choices = getattr(virtualized, "_choices", None)
    if choices is None or not hasattr(choices, "_key"):
        # a torch without that entry: only this thread's instance can be replaced, by pinning one
        virtualized.V.set_choices_handler(_build()[1])
        return
    if getattr(choices._get_handler, "_inductor_cute", False):
        return
    lookup, key = choices._get_handler, choices._key

    def built_by_default():
        factory, value = _build()  # the config read once: the record must name what built it
        setattr(virtualized.threadlocal, key, value)
        if _weak(value):  # else it is kept as it is: _stale cannot tell who built it
            _built_from[value] = factory
        return value

    @functools.wraps(lookup)
    def current(check_poisoned: bool = True):
        value = lookup(check_poisoned)
        return built_by_default() if _stale(value) else value

    setter = type(virtualized.V).set_choices_handler

    def set_choices_handler(value):
        """Set `value` as torch does; it is the setter's until the returned context exits (for
        good, without a `with`). Then the instance put back, which may be `value` itself (one
        Inductor built), is judged like any other."""
        restore = setter(value)
        added = value not in _set_on_purpose if _weak(value) else False
        if added:
            _set_on_purpose.add(value)

        @contextlib.contextmanager
        def scoped():
            try:
                with restore:
                    yield
            finally:
                if added:
                    _set_on_purpose.discard(value)

        return scoped()

    current._inductor_cute = True
    choices._default = built_by_default
    choices._get_handler = current  # an instance attribute: V.choices calls _choices._get_handler()
    type(virtualized.V).set_choices_handler = staticmethod(set_choices_handler)


def _stale(value) -> bool:
    try:
        if value in _set_on_purpose:
            return False
        built_from = _built_from.get(value, _NOT_BUILT_HERE)
    except TypeError:  # an instance without weak references: not one we built
        return False
    if built_from is _NOT_BUILT_HERE:
        # built before follow_config(): the stock class is what the default builds from no config
        return type(value) is InductorChoices and config.inductor_choices_class is not None
    return built_from is not config.inductor_choices_class


def _weak(value) -> bool:
    """Whether `value` can be held by weak reference (and hashed): the records above need both."""
    try:
        weakref.ref(value)
        hash(value)
    except TypeError:
        return False
    return True


def _build() -> tuple:
    """(the config value, an instance built from it), as Inductor's lazy default builds one."""
    factory = config.inductor_choices_class
    return factory, factory() if factory is not None else InductorChoices()
