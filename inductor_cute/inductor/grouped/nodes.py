"""FX-node helpers the MoE graph rewrites share: a node's traced value, new calls with theirs, and
pattern passes registered at their first use."""

from __future__ import annotations

import torch

aten = torch.ops.aten
# ops that keep a tensor's elements in order (the rewrites look through them)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
         aten.alias.default)
SORTS = (aten.sort.stable, aten.sort.default)


def through_views(node):
    """The node `node` views (through VIEWS), or `node` itself."""
    while isinstance(node, torch.fx.Node) and node.target in VIEWS:
        node = node.args[0]
    return node


def value(node):
    """The traced (fake) value of an FX node; None for anything else or a node without one."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None, *, like) -> torch.fx.Node:
    """A new call of `target` with its traced value computed on the fake tensors of its inputs
    (in the fake mode of node `like`'s value)."""
    node = graph.call_function(target, args, kwargs or {})
    fake = [[value(i) if isinstance(i, torch.fx.Node) else i for i in a] if isinstance(a, (list, tuple))
            else value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    with value(like).fake_mode:
        node.meta["val"] = target(*fake, **(kwargs or {}))
    return node


class LazyPatterns:
    """A PatternMatcherPass whose patterns `register(patterns)` adds at the pass's first use, once
    per process, as Inductor registers its own: under a fresh fake mode (init_once_fakemode)."""

    def __init__(self, name: str, register) -> None:
        self.name, self.register, self.patterns = name, register, None

    def apply(self, graph: torch.fx.Graph) -> int:
        """The number of matches replaced in `graph`."""
        if self.patterns is None:
            from torch._inductor.pattern_matcher import PatternMatcherPass, init_once_fakemode

            @init_once_fakemode
            def made(input_device=None):  # torch 2.11 passes it by position; 2.13 only to a function naming it
                patterns = PatternMatcherPass(pass_name=self.name)
                self.register(patterns)
                self.patterns = patterns

            made()
        return self.patterns.apply(graph)
