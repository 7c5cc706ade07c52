"""The package's shape, checked on the source: data flows inductor/ -> host/ -> kernels/ -> runtime/,
no import cycles between our modules (imports inside functions count too), no module over 600
lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "inductor_cute"
MAX_LINES = 600
# layer -> the layers of ours it must never import
FORBIDDEN = {
    "runtime": ("kernels", "host", "inductor", "ops", "bench"),
    "kernels": ("host", "inductor", "ops", "bench"),
    "host": ("inductor", "bench"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of ours that `path` imports anywhere in its body (absolute names)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {(a.name, ()) for a in node.names if a.name.startswith("inductor_cute")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("inductor_cute"):
                target = node.module
            else:
                continue
            out.add((target, tuple(a.name for a in node.names)))
    return out


def _graph() -> dict[str, set[str]]:
    """module -> modules of ours it imports: `from pkg import sub` depends on the submodule `sub`
    (not on pkg's __init__), `from pkg import name` on pkg."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for m, p in files.items():
        deps = set()
        for target, names in _imports(p):
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in files}
            deps |= subs if subs and len(subs) == len(names) else subs | {target}
        graph[m] = {d for d in deps if d in files and d != m}
    return graph


def _torch_inductor_imports(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n.startswith("torch._inductor") for n in names):
            return True
    return False


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long


def test_layers_import_only_downwards():
    graph = _graph()
    bad = []
    for module, deps in graph.items():
        layer = module.split(".")[1] if "." in module else ""
        for dep in deps:
            dep_layer = dep.split(".")[1] if "." in dep else ""
            if dep_layer in FORBIDDEN.get(layer, ()):
                bad.append(f"{module} imports {dep}")
    assert not bad
    assert not [p for p in (PACKAGE / "kernels").rglob("*.py") if _torch_inductor_imports(p)]


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ importing its own submodules is not a cycle of concern when the
    # submodule imports the package only for a sibling; count cycles between distinct modules
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, cycles[:5]
