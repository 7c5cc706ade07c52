"""`cache export FILE` / `cache import FILE`: compiled kernels moved between machines as an archive."""

import hashlib
import io
import os
import subprocess
import sys
import tarfile

import pytest

from inductor_cute.__main__ import main
from inductor_cute.runtime.cache import CompiledKernelCache, encode_entry


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _entry(key: str, payload: bytes) -> bytes:
    return encode_entry({"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
                         "kernel": f"k({key[:4]})"}, payload)


@pytest.fixture
def machines(tmp_path, monkeypatch):
    """Two caches: `a` holds three kernels, a library linked from one, and a damaged entry."""
    a, b = CompiledKernelCache(tmp_path / "a"), CompiledKernelCache(tmp_path / "b")
    for name in ("x", "y", "z"):
        a.write(_key(name), os.urandom(3000), kernel=f"k({name})", arch="sm_90a")
    a.write(_key("lib"), b"\x7fELF shared library", kernel="k(x)", linked_from=_key("x"))
    a.path_for(_key("broken")).parent.mkdir(parents=True, exist_ok=True)
    a.path_for(_key("broken")).write_bytes(b"not an entry")

    def use(cache):
        monkeypatch.setenv("INDUCTOR_CUTE_CACHE_DIR", str(cache.root))
    return a, b, use


def test_export_then_import_moves_every_compiled_kernel(machines, tmp_path, capsys):
    a, b, use = machines
    archive = tmp_path / "kernels.tar.gz"
    use(a)
    assert main(["cache", "export", str(archive)]) == 0
    assert f"exported 3 compiled kernels from {a.root} to {archive}" in capsys.readouterr().out
    use(b)
    assert main(["cache", "import", str(archive)]) == 0
    assert f"imported 3 compiled kernels into {b.root}\n" == capsys.readouterr().out
    assert sorted(e.key for e in b.entries()) == sorted(_key(n) for n in "xyz")
    for name in "xyz":  # byte for byte, provenance included
        assert b.read(_key(name)) == a.read(_key(name))
    assert main(["cache", "import", str(archive)]) == 0
    assert "imported 0 compiled kernels" in (out := capsys.readouterr().out) and "3 were already there" in out


def _archive(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_import_skips_damaged_and_foreign_members_with_a_message(machines, tmp_path, capsys):
    _, b, use = machines
    flipped = bytearray(_entry(_key("flip"), b"payload"))
    flipped[-1] ^= 0xFF
    archive = tmp_path / "mixed.tar.gz"
    _archive(archive, [(f"inductor_cute/{_key('good')}.obj", _entry(_key("good"), b"payload")),
                       (f"inductor_cute/{_key('flip')}.obj", bytes(flipped)),
                       (f"inductor_cute/{_key('renamed')}.obj", _entry(_key("other"), b"payload")),
                       ("inductor_cute/README", b"hello"),
                       (f"inductor_cute/{_key('link')}.obj", None),
                       (f"../../{_key('escape')}.obj", _entry(_key("escape"), b"payload"))])
    use(b)
    assert main(["cache", "import", str(archive)]) == 1
    out = capsys.readouterr()
    assert "imported 2 compiled kernels" in out.out and "4 skipped" in out.out
    skipped = out.err.splitlines()
    assert len(skipped) == 4 and all(line.startswith("skipped ") for line in skipped)
    assert f"{_key('flip')}.obj: damaged entry (bad format or checksum)" in out.err
    assert f"{_key('renamed')}.obj: entry belongs to another key" in out.err
    assert "README: not a kernel cache entry" in out.err
    # Only the name's last part is used: a member cannot write outside the cache.
    assert sorted(e.key for e in b.entries()) == sorted([_key("good"), _key("escape")])
    assert not (tmp_path.parent / f"{_key('escape')}.obj").exists()


def test_import_of_a_truncated_archive_keeps_what_it_could_read(machines, tmp_path, capsys):
    a, b, use = machines
    archive = tmp_path / "kernels.tar.gz"
    use(a)
    main(["cache", "export", str(archive)])
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    use(b)
    assert main(["cache", "import", str(archive)]) == 1
    out = capsys.readouterr()
    assert "unreadable" in out.err and "Traceback" not in out.err
    for e in b.entries():  # whatever was added is whole
        assert b.read(e.key) == a.read(e.key)


@pytest.mark.parametrize("case", ["missing", "not_an_archive", "export_to_missing_dir"])
def test_archive_errors_are_one_line(machines, tmp_path, case):
    a, _, _ = machines
    if case == "missing":
        args, expected = ["import", str(tmp_path / "nope.tar.gz")], "nope.tar.gz: no such file"
    elif case == "not_an_archive":
        (tmp_path / "junk.tar.gz").write_bytes(os.urandom(1000))
        args, expected = ["import", str(tmp_path / "junk.tar.gz")], "is not a kernel cache archive"
    else:
        args, expected = ["export", str(tmp_path / "no" / "dir.tar.gz")], "cannot write"
    env = {**os.environ, "INDUCTOR_CUTE_CACHE_DIR": str(a.root)}
    out = subprocess.run([sys.executable, "-m", "inductor_cute", "cache", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and expected in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_export_leaves_nothing_behind_when_it_fails(machines, tmp_path, monkeypatch):
    a, _, _ = machines
    from inductor_cute.runtime import artifacts

    monkeypatch.setattr(CompiledKernelCache, "read_raw", lambda self, key: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        artifacts.export_archive(a, tmp_path / "out.tar.gz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no archive, no temporary file
