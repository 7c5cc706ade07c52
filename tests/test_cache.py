import hashlib
import os

import pytest

from inductor_cute.runtime.cache import MAGIC, CompiledKernelCache

KEY = hashlib.sha256(b"k").hexdigest()


@pytest.fixture
def cache(tmp_path):
    return CompiledKernelCache(tmp_path / "c")


def test_round_trip_keeps_payload_and_provenance(cache):
    payload = os.urandom(5000)
    cache.write(KEY, payload, kernel="k(N=1)", arch="sm_90a")
    header, data = cache.read(KEY)
    assert data == payload
    assert header["kernel"] == "k(N=1)" and header["arch"] == "sm_90a" and header["size"] == 5000
    assert [e.key for e in cache.entries()] == [KEY]
    assert cache.size_bytes() > 5000


def test_write_leaves_no_temporary_files(cache):
    cache.write(KEY, b"x" * 100)
    files = [p.name for p in cache.path_for(KEY).parent.iterdir()]
    assert files == [f"{KEY}.obj"]


def test_missing_entry_is_none(cache):
    assert cache.read(KEY) is None


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "garbage", "empty", "bad_header"])
def test_damaged_entry_is_discarded(cache, damage):
    cache.write(KEY, os.urandom(2000))
    path = cache.path_for(KEY)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip_payload":
        data[-1] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "empty":
        data = bytearray()
    else:
        data[len(MAGIC) + 9] = ord("}")
    path.write_bytes(bytes(data))
    assert cache.read(KEY) is None
    assert not path.exists()


def test_entry_stored_under_another_key_is_rejected(cache):
    other = hashlib.sha256(b"other").hexdigest()
    cache.write(other, b"payload")
    cache.path_for(KEY).parent.mkdir(parents=True, exist_ok=True)
    os.replace(cache.path_for(other), cache.path_for(KEY))
    assert cache.read(KEY) is None


def test_clear_removes_everything(cache):
    for i in range(3):
        cache.write(hashlib.sha256(bytes([i])).hexdigest(), b"p")
    assert cache.clear() == 3
    assert cache.entries() == []


def test_default_location_is_under_inductor_cache(monkeypatch, tmp_path):
    from inductor_cute.runtime.cache import default_cache_dir

    monkeypatch.delenv("INDUCTOR_CUTE_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind"))
    assert default_cache_dir() == tmp_path / "ind" / "inductor_cute"
    monkeypatch.setenv("INDUCTOR_CUTE_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == (tmp_path / "mine").resolve()


def test_lock_excludes_other_processes(cache):
    import subprocess
    import sys
    import time

    code = (
        "import time; from inductor_cute.runtime.cache import CompiledKernelCache as C\n"
        f"c = C({str(cache.root)!r}); print('ready', flush=True); t = time.time()\n"
        f"with c.lock({KEY!r}): print(time.time() - t)\n"
    )
    with cache.lock(KEY):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
    waited = float(proc.communicate(timeout=60)[0])
    assert waited > 0.5
