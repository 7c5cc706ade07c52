"""What identifies one compiled kernel: the builder module, its compile-time parameters and the target."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

# Bump when the layout of cache entries or the way objects are built changes.
CACHE_FORMAT = 1

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class KernelSpec:
    """A kernel to compile: `module.build(**params)` returns (jit function, fake arguments).

    `params` holds only JSON-able compile-time values (ints, strings, bools, floats, tuples of them),
    so a spec can be hashed into a cache key and sent to a worker process.
    """

    module: str
    params: tuple[tuple[str, object], ...]

    @classmethod
    def make(cls, module: str, **params) -> "KernelSpec":
        return cls(module, tuple(sorted(params.items())))

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    @property
    def name(self) -> str:
        short = self.module.rsplit(".", 1)[-1]
        return short + "(" + ", ".join(f"{k}={v}" for k, v in self.params) + ")"

    def key(self, arch: str, versions: dict) -> str:
        blob = json.dumps(
            {
                "format": CACHE_FORMAT,
                "module": self.module,
                "params": [[k, v] for k, v in self.params],
                "source": source_hash(self.module),
                "arch": arch,
                "versions": versions,
            },
            sort_keys=True,
            default=repr,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _tree_hash() -> str:
    """Hash of the code every kernel's compiled object depends on: kernels/ and runtime/compiler.py."""
    h = hashlib.sha256()
    files = sorted((_PACKAGE_ROOT / "kernels").rglob("*.py")) + [_PACKAGE_ROOT / "runtime" / "compiler.py"]
    for f in files:
        h.update(str(f.relative_to(_PACKAGE_ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def source_hash(module: str) -> str:
    """Hash of a builder module's source together with the shared kernel code it may use."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"kernel builder module {module!r} not found")
    h = hashlib.sha256(_tree_hash().encode())
    h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()
