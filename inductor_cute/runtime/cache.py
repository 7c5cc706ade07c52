"""The on-disk cache of compiled kernel objects, shared by every process of a user.

One file per entry: a magic line, a JSON header (key, payload checksum, provenance) and the
exported object. Writers hold a per-key file lock and publish with an atomic rename, so readers
never see a half-written entry; a reader that finds a damaged or foreign entry deletes it and the
caller compiles again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("inductor_cute.cache")

CACHE_ENV = "INDUCTOR_CUTE_CACHE_DIR"
MAGIC = b"INDUCTOR-CUTE-OBJ\x01\n"
_HEADER_LEN = struct.Struct("<Q")
_KEY = re.compile(r"[0-9a-f]{64}")


def valid_key(key: object) -> bool:
    """Whether `key` has the form of a cache key (a SHA-256 hex digest): safe to use in a path."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def encode_entry(header: dict, payload: bytes) -> bytes:
    """The bytes of one entry file: magic line, header length, JSON header, payload."""
    header_bytes = json.dumps(header, sort_keys=True, default=str).encode()
    return MAGIC + _HEADER_LEN.pack(len(header_bytes)) + header_bytes + payload


def default_cache_dir() -> Path:
    """$INDUCTOR_CUTE_CACHE_DIR, else `inductor_cute/` under Inductor's cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "inductor_cute"


@dataclass
class EntryInfo:
    key: str
    path: Path
    size: int
    header: dict | None  # None when the entry is unreadable

    @property
    def kind(self) -> str:
        """"object" (what the compiler exported), "library" (linked from an object) or "damaged"."""
        if self.header is None:
            return "damaged"
        return "library" if "linked_from" in self.header else "object"


class CompiledKernelCache:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    @property
    def objects_dir(self) -> Path:
        return self.root / "objects"

    def path_for(self, key: str) -> Path:
        return self.objects_dir / key[:2] / f"{key}.obj"

    @contextlib.contextmanager
    def lock(self, key: str):
        """Exclusive lock on one key across processes; released if the holder dies."""
        lock_dir = self.root / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{key}.lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def write(self, key: str, payload: bytes, **provenance) -> dict:
        """Publish an entry atomically; returns its header."""
        header = {"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
                  "created": time.time(), **provenance}
        self._publish(key, encode_entry(header, payload))
        return header

    def add_entry(self, key: str, data: bytes) -> str:
        """Publish a whole entry file made elsewhere (an archive, a torch cache artifact) under `key`,
        keeping its provenance: "added", or "present" if a valid entry is already there. Raises
        ValueError, writing nothing, unless `data` is an intact entry whose header names `key`."""
        if not valid_key(key):
            raise ValueError(f"not a cache key: {str(key)[:80]!r}")
        parsed = _parse(data)
        if parsed is None:
            raise ValueError("damaged entry (bad format or checksum)")
        if parsed[0].get("key") != key:
            raise ValueError("entry belongs to another key")
        if self.read(key) is not None:
            return "present"
        self._publish(key, data)
        return "added"

    def _publish(self, key: str, data: bytes) -> None:
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, key: str) -> tuple[dict, bytes] | None:
        """(header, payload) of a valid entry; None if absent. A damaged entry is deleted."""
        path = self.path_for(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        parsed = _parse(data)
        if parsed is None or parsed[0].get("key") != key:
            self.discard(key, "damaged or foreign entry")
            return None
        return parsed

    def read_raw(self, key: str) -> bytes | None:
        """The whole file of a valid entry (header and payload), as `add_entry` takes it; None if
        absent or damaged (left for `read` to discard)."""
        try:
            data = self.path_for(key).read_bytes()
        except FileNotFoundError:
            return None
        parsed = _parse(data)
        return data if parsed is not None and parsed[0].get("key") == key else None

    def discard(self, key: str, reason: str) -> None:
        log.warning("inductor-cute: discarding cache entry %s (%s)", key[:16], reason)
        with contextlib.suppress(FileNotFoundError):
            self.path_for(key).unlink()

    def entries(self) -> list[EntryInfo]:
        out = []
        if not self.objects_dir.is_dir():
            return out
        for path in sorted(self.objects_dir.glob("*/*.obj")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            parsed = _parse(data)
            out.append(EntryInfo(path.stem, path, len(data), parsed[0] if parsed else None))
        return out

    def size_bytes(self) -> int:
        return sum(e.size for e in self.entries())

    def clear(self) -> int:
        """Delete every entry; returns how many there were."""
        n = len(self.entries())
        for sub in ("objects", "locks", "tmp"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        return n


def _parse(data: bytes) -> tuple[dict, bytes] | None:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LEN.size:
        return None
    start = len(MAGIC) + _HEADER_LEN.size
    (n,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    try:
        header = json.loads(data[start : start + n])
    except ValueError:
        return None
    payload = data[start + n :]
    if not isinstance(header, dict) or header.get("size") != len(payload):
        return None
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        return None
    return header, payload
