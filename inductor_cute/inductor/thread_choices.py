"""V.choices in every thread follows `config.inductor_choices_class`, as enable() and disable() set it.

Inductor builds V.choices lazily, once per thread, from the config, and keeps it in a thread-local
(`virtualized._choices_default`). A thread that compiled once keeps what it built then: a training
graph's backward is compiled in autograd's device thread, so after enable(flex_backward=True) and a
later enable(flex_backward=False), that thread kept the first settings and ran our backward behind a
stock forward (seen on the H100, twenty-second session). torch 2.11 and 2.13 have no public way to
drop another thread's entry, so `follow_config()` wraps the lookup: an instance the lazy default
built from a config value other than today's is rebuilt on its next use, in whichever thread. An
instance a user set with `V.set_choices_handler` is theirs and kept."""

from __future__ import annotations

import functools

_BUILT_FROM = "_inductor_cute_built_from"  # the config value the lazy default built an instance from
_NOT_BUILT_BY_DEFAULT = object()


def follow_config() -> None:
    """Install the wrapped lookup (once; it stays: stale instances may outlive any enable())."""
    from torch._inductor import virtualized

    choices = getattr(virtualized, "_choices", None)
    if choices is None or not hasattr(choices, "_key"):  # a torch without that entry: pin one for this thread
        virtualized.V.set_choices_handler(_built())
        return
    if getattr(choices._get_handler, "_inductor_cute", False):
        return
    lookup, key = choices._get_handler, choices._key

    @functools.wraps(lookup)
    def current(check_poisoned: bool = True):
        value = lookup(check_poisoned)
        if _stale(value):
            delattr(virtualized.threadlocal, key)
            value = lookup(check_poisoned)
        return value

    current._inductor_cute = True
    choices._get_handler = current  # an instance attribute: V.choices calls _choices._get_handler()
    default = choices._default

    @functools.wraps(default)
    def tagged_default():
        from torch._inductor import config

        factory = config.inductor_choices_class
        value = default()
        setattr(value, _BUILT_FROM, factory)
        return value

    choices._default = tagged_default


def _stale(value) -> bool:
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices

    built_from = getattr(value, _BUILT_FROM, _NOT_BUILT_BY_DEFAULT)
    if built_from is _NOT_BUILT_BY_DEFAULT:
        # built before we wrapped the default: the stock class is what it builds from no config
        return type(value) is InductorChoices and config.inductor_choices_class is not None
    return built_from is not config.inductor_choices_class


def _built():
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices

    factory = config.inductor_choices_class
    return factory() if factory is not None else InductorChoices()
