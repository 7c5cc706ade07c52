"""Compiled kernels travel in torch's cache artifacts (torch.compiler.save/load_cache_artifacts)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.compiler._cache import CacheArtifactManager

from inductor_cute.runtime import artifacts
from inductor_cute.runtime.cache import CompiledKernelCache, encode_entry

# Machine 1 compiles a kernel through the loader, which records every kernel it hands out, and
# saves torch's cache artifacts (torch imported first here, inductor_cute first on machine 2).
SAVE = """
import sys, torch, inductor_cute
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import get_kernel, stats
from inductor_cute.runtime.loader import kernel_key

spec = rmsnorm_spec(2048, "float16")
assert callable(get_kernel(spec, "sm_90a"))
assert stats["compiles"] == 1, dict(stats)
data, info = torch.compiler.save_cache_artifacts()
open(sys.argv[1], "wb").write(data)
print(kernel_key(spec, "sm_90a"), info.inductor_cute_artifacts)
"""

LOAD = """
import json, sys
import inductor_cute
import torch
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import CompiledKernelCache, get_kernel, stats

info = torch.compiler.load_cache_artifacts(open(sys.argv[1], "rb").read())
entries = [e.key for e in CompiledKernelCache().entries()]
fn = get_kernel(rmsnorm_spec(2048, "float16"), "sm_90a")
print(json.dumps({"loaded": info.inductor_cute_artifacts, "entries": entries, "stats": dict(stats),
                  "callable": callable(fn)}))
"""


def _python(code, *args, cache_dir):
    env = {**os.environ, "INDUCTOR_CUTE_CACHE_DIR": str(cache_dir), "CUDA_VISIBLE_DEVICES": "",
           "CUTE_DSL_ARCH": "sm_90a"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_cache_artifacts_give_another_machine_a_warm_start_with_no_compile(tmp_path):
    bundle = tmp_path / "artifacts.bin"
    saved = _python(SAVE, str(bundle), cache_dir=tmp_path / "machine1")
    key = saved.split()[0]
    assert key in saved.split(" ", 1)[1]  # save_cache_artifacts() lists our artifact

    result = json.loads(_python(LOAD, str(bundle), cache_dir=tmp_path / "machine2"))
    assert result["loaded"] == [key]
    assert key in result["entries"]  # published in machine 2's cache by load_cache_artifacts()
    assert result["stats"].get("compiles", 0) == 0 and result["stats"]["disk_hits"] == 1
    assert result["callable"]
    original = CompiledKernelCache(tmp_path / "machine1").read(key)
    copied = CompiledKernelCache(tmp_path / "machine2").read(key)
    assert copied == original  # the same object and provenance


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture
def fresh_artifacts(monkeypatch, tmp_path):
    """torch's artifact lists, empty for this test; the loading side's cache in tmp_path/loaded."""
    monkeypatch.setenv("INDUCTOR_CUTE_CACHE_DIR", str(tmp_path / "loaded"))
    assert artifacts.register()
    with CacheArtifactManager.with_fresh_cache():
        yield CompiledKernelCache(tmp_path / "loaded")


def _round_trip():
    data, _ = torch.compiler.save_cache_artifacts()
    return torch.compiler.load_cache_artifacts(data)


def test_cache_artifacts_keep_provenance_and_record_each_kernel_once(fresh_artifacts):
    header = {"kernel": "k(N=1)", "arch": "sm_90a", "created": 1.0}
    for _ in range(3):
        artifacts.record_artifact(_key("a"), b"object", header)
    info = _round_trip()
    assert info.inductor_cute_artifacts == [_key("a")]
    got_header, payload = fresh_artifacts.read(_key("a"))
    assert payload == b"object" and got_header["kernel"] == "k(N=1)" and got_header["arch"] == "sm_90a"


def test_cache_artifacts_leave_linked_libraries_out(fresh_artifacts):
    artifacts.record_artifact(_key("lib"), b"elf", {"kernel": "k", "linked_from": _key("obj")})
    assert torch.compiler.save_cache_artifacts() is None  # nothing was recorded


def test_damaged_cache_artifacts_are_skipped_and_the_rest_load(fresh_artifacts, caplog):
    good = encode_entry({"key": _key("good"), "sha256": hashlib.sha256(b"ok").hexdigest(), "size": 2}, b"ok")
    tampered = bytearray(encode_entry({"key": _key("bad"), "sha256": hashlib.sha256(b"ok").hexdigest(),
                                       "size": 2}, b"ok"))
    tampered[-1] ^= 0xFF
    CacheArtifactManager.record_artifact(artifacts.ARTIFACT_TYPE, _key("bad"), bytes(tampered))
    CacheArtifactManager.record_artifact(artifacts.ARTIFACT_TYPE, _key("stolen"), good)  # another key's
    CacheArtifactManager.record_artifact(artifacts.ARTIFACT_TYPE, "../../escape", good)
    CacheArtifactManager.record_artifact(artifacts.ARTIFACT_TYPE, _key("good"), good)
    _round_trip()
    assert [e.key for e in fresh_artifacts.entries()] == [_key("good")]
    assert caplog.text.count("skipped cache artifact") == 3


def test_cache_artifacts_do_not_overwrite_a_valid_entry(fresh_artifacts):
    fresh_artifacts.write(_key("a"), b"local", kernel="mine")
    artifacts.record_artifact(_key("a"), b"remote", {"kernel": "theirs"})
    _round_trip()
    assert fresh_artifacts.read(_key("a"))[1] == b"local"


def test_cache_artifacts_type_is_known_whichever_is_imported_first():
    code = ("import sys; import inductor_cute; assert 'torch' not in sys.modules\n"
            "import torch; from torch.compiler._cache import CacheArtifactFactory as F\n"
            "print(F._get_artifact_type('inductor_cute').type())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "inductor_cute"
