"""Moving compiled kernels to other machines: in torch's cache artifacts, and as cache archives.

`torch.compiler.save_cache_artifacts()` bundles what torch.compile produced (FX graphs, autotuning
results, ...) so that `torch.compiler.load_cache_artifacts()` on another machine starts warm. Our
kernels join that bundle as artifacts of type "inductor_cute": the loader records every kernel object
it hands out (`record_artifact`), and loading the bundle publishes each one in that machine's kernel
cache, so nothing compiles there.

Recording happens whenever the loader hands out a kernel, not only while torch.compile runs: a
compiled graph loaded from Inductor's FX graph cache runs no lowering and loads our kernels on its
first call, after the compile has ended; recording only during compiles would leave exactly those
kernels out of the bundle. Kernels called eagerly are recorded too, which only makes the other
machine's start warmer. The cost is the objects' bytes held in torch's artifact list.

`python -m inductor_cute cache export FILE` / `cache import FILE` move the same entries as a tar
archive, without torch.

Everything torch-facing here uses only what torch 2.11 through 2.13 have in common
(`CacheArtifact`, `CacheArtifactFactory.register`, `CacheArtifactManager.record_artifact`) and does
nothing where a torch lacks them.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.abc
import io
import logging
import os
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import first_line
from .cache import CompiledKernelCache, encode_entry, valid_key

log = logging.getLogger("inductor_cute.cache")

ARTIFACT_TYPE = "inductor_cute"
_TORCH_CACHE_MODULE = "torch.compiler._cache"
_artifact_class: type | None = None


# -- torch's cache artifacts ------------------------------------------------------------------------


def register() -> bool:
    """Make "inductor_cute" artifacts known to torch (idempotent); False where this torch has no
    cache-artifact system. Imports torch: call it once torch is loaded (see register_when_torch_loads)."""
    global _artifact_class
    if _artifact_class is not None:
        return True
    try:
        from torch.compiler._cache import CacheArtifact, CacheArtifactFactory
    except ImportError:
        return False

    class KernelArtifact(CacheArtifact):
        """One compiled kernel: the key is our cache key, the content a whole cache entry file."""

        def populate_cache(self) -> None:
            _publish_artifact(self.key, self.content)

        @staticmethod
        def type() -> str:
            return ARTIFACT_TYPE

    try:
        CacheArtifactFactory.register(KernelArtifact)
    except AssertionError:  # registered by an earlier copy of this module (a reload): that one serves
        pass
    except Exception as e:  # a torch whose factory changed shape: go without, never break the caller
        log.debug("inductor-cute: cannot register cache artifacts with torch: %s", e)
        return False
    _artifact_class = KernelArtifact
    return True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers our artifact type right after torch's cache-artifact module executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TORCH_CACHE_MODULE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # one shot
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_register(module):
            run(module)
            try:
                register()
            except Exception as e:  # never break torch's import
                log.debug("inductor-cute: cannot register cache artifacts with torch: %s", e)

        loader.exec_module = exec_then_register
        return spec


def register_when_torch_loads() -> None:
    """Register now if torch's cache-artifact module is loaded, else the moment it loads.

    Called at package import. Importing torch there would cost seconds for every command (even
    --help), and registering only when torch is already imported would miss `import inductor_cute`
    followed by `import torch`: then torch.compiler.load_cache_artifacts() would reject the whole
    bundle, torch's own artifacts with ours.
    """
    if _TORCH_CACHE_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def record_artifact(key: str, object_bytes: bytes, header: dict | None = None) -> None:
    """Add one compiled kernel object to what torch.compiler.save_cache_artifacts() returns.

    `header` is the entry's header from the cache (kernel name, arch, versions), kept so that
    `cache list` on the other machine names the kernel. Linked libraries are not recorded: they
    name this machine's library paths and are linked again, in milliseconds, where they are needed.
    Best effort: never raises.
    """
    if header is not None and "linked_from" in header:
        return
    try:
        if not register():
            return
        from torch.compiler._cache import CacheArtifactManager

        header = {**(header or {}), "key": key, "sha256": hashlib.sha256(object_bytes).hexdigest(),
                  "size": len(object_bytes)}
        CacheArtifactManager.record_artifact(ARTIFACT_TYPE, key, encode_entry(header, object_bytes))
    except Exception as e:
        log.debug("inductor-cute: kernel %s not recorded as a cache artifact: %s", key[:16], e)


def _publish_artifact(key: str, content: bytes) -> None:
    # torch populates artifacts one after another with no error handling: a bad one must not stop
    # the rest (torch's own included) from loading.
    try:
        CompiledKernelCache().add_entry(key, content)
    except (ValueError, OSError) as e:
        log.warning("inductor-cute: skipped cache artifact %s: %s", str(key)[:16], e)


# -- cache archives ---------------------------------------------------------------------------------


def export_archive(cache: CompiledKernelCache, path: str | os.PathLike) -> int:
    """Write every compiled object of `cache` into a gzip'd tar at `path` (replaced atomically);
    returns how many. Linked libraries stay behind, as in `record_artifact`."""
    path = Path(path)
    count = 0
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
            for entry in cache.entries():
                data = cache.read_raw(entry.key) if entry.kind == "object" else None
                if data is None:
                    continue
                info = tarfile.TarInfo(f"inductor_cute/{entry.key}.obj")
                info.size, info.mode, info.mtime = len(data), 0o644, int(entry.header.get("created", 0))
                tar.addfile(info, io.BytesIO(data))
                count += 1
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return count


@dataclass
class ImportReport:
    added: int = 0
    present: int = 0
    skipped: list[str] = field(default_factory=list)  # one line per member left out, saying why


def import_archive(cache: CompiledKernelCache, path: str | os.PathLike) -> ImportReport:
    """Publish every intact entry of an archive made by `export_archive` in `cache`; damaged or
    foreign members are skipped and named in the report. Raises OSError or tarfile.TarError when
    `path` cannot be opened as an archive at all."""
    report = ImportReport()
    with tarfile.open(path, mode="r:*") as tar:
        try:
            for member in tar:
                if member.isdir():
                    continue
                name = PurePosixPath(member.name).name
                key = name[: -len(".obj")]
                if not member.isfile() or not name.endswith(".obj") or not valid_key(key):
                    report.skipped.append(f"{member.name}: not a kernel cache entry")
                    continue
                try:
                    status = cache.add_entry(key, tar.extractfile(member).read())
                except ValueError as e:
                    report.skipped.append(f"{member.name}: {e}")
                    continue
                report.added += status == "added"
                report.present += status == "present"
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:  # cut short or damaged here
            report.skipped.append(f"the rest of the archive: unreadable ({first_line(e)})")
    return report
