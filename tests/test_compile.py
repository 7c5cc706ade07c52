"""The whole CPU path for a real kernel: compile for sm_90a without a GPU, export, cache, load."""

import re

import pytest

from inductor_cute.kernels.norm import rmsnorm_config
from inductor_cute.runtime import CompiledKernelCache, KernelSpec, get_kernel, stats
from inductor_cute.runtime.compiler import compile_spec
from inductor_cute.runtime.loader import forget_loaded, kernel_key


def rmsnorm_spec(n=4096, dtype="bfloat16"):
    return rmsnorm_config.rmsnorm_spec(n, dtype)


@pytest.fixture(scope="module")
def ptx():
    return compile_spec(rmsnorm_spec(4104), "sm_90a", keep_ptx=True).ptx


def test_ptx_targets_hopper(ptx):
    assert re.search(r"^\.target sm_90a\b", ptx, re.M)


def test_ptx_uses_16_byte_global_accesses(ptx):
    assert re.search(r"ld\.global(\.nc)?(\.L\d::\w+)*\.v4\.(b32|u32|f32)", ptx)
    assert re.search(r"st\.global\.v4\.(b32|u32|f32)", ptx)


def test_ptx_reduces_with_warp_shuffles_and_no_local_memory(ptx):
    assert "shfl.sync.bfly" in ptx
    assert ".local" not in ptx


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [8, 40, 4104, 32768])
def test_every_dtype_and_size_class_compiles(n, dtype):
    if rmsnorm_config.unsupported_reason(n, dtype):
        pytest.skip("not a supported size")
    obj = compile_spec(rmsnorm_spec(n, dtype), "sm_90a")
    assert obj.object_bytes[:4] == b"\x7fELF"


def test_unsupported_sizes_are_named():
    assert "multiple of 8" in rmsnorm_config.unsupported_reason(4100, "bfloat16")
    assert rmsnorm_config.unsupported_reason(4100, "float32") is None


def test_get_kernel_compiles_once_then_hits_memory_then_disk():
    cache = CompiledKernelCache()
    spec = rmsnorm_spec(2048, "float16")
    cache.discard(kernel_key(spec, "sm_90a"), "test setup")
    forget_loaded()
    stats.clear()
    fn = get_kernel(spec, "sm_90a")
    assert stats["compiles"] == 1 and callable(fn)
    assert get_kernel(spec, "sm_90a") is fn and stats["memory_hits"] == 1
    forget_loaded()
    get_kernel(spec, "sm_90a")
    assert stats["compiles"] == 1 and stats["disk_hits"] == 1


def test_damaged_entry_is_recompiled_not_run():
    cache = CompiledKernelCache()
    spec = rmsnorm_spec(2048, "float16")
    get_kernel(spec, "sm_90a")
    path = cache.path_for(kernel_key(spec, "sm_90a"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    forget_loaded()
    stats.clear()
    get_kernel(spec, "sm_90a")
    assert stats["compiles"] == 1
    assert cache.read(kernel_key(spec, "sm_90a")) is not None


def test_linked_library_that_fails_to_load_falls_back_to_the_dsl(monkeypatch):
    from inductor_cute.runtime import native

    spec = rmsnorm_spec(2048, "float16")
    get_kernel(spec, "sm_90a")
    forget_loaded()
    stats.clear()
    monkeypatch.setattr(native, "load_shared", lambda path, entry: (_ for _ in ()).throw(OSError("bad ELF")))
    assert callable(get_kernel(spec, "sm_90a"))
    assert stats["dsl_loads"] == 1 and stats["compiles"] == 0


def test_object_that_fails_to_load_is_recompiled(monkeypatch):
    from inductor_cute.runtime import loader

    spec = rmsnorm_spec(2048, "float16")
    get_kernel(spec, "sm_90a")
    forget_loaded()
    stats.clear()
    monkeypatch.setattr(loader, "_load_linked", lambda *a: None)
    real, calls = loader.load_object, []

    def flaky(path):
        calls.append(path)
        if len(calls) == 1:
            raise RuntimeError("incompatible object")
        return real(path)

    monkeypatch.setattr(loader, "load_object", flaky)
    assert callable(get_kernel(spec, "sm_90a"))
    assert len(calls) == 2 and stats["compiles"] == 1


WARM_PROCESS = """
import json, sys
from inductor_cute.kernels.norm.rmsnorm_config import rmsnorm_spec
from inductor_cute.runtime import get_kernel, stats
get_kernel(rmsnorm_spec(2048, "float16"), "sm_90a")
print(json.dumps({"stats": dict(stats), "dsl_imported": "cutlass" in sys.modules}))
"""


def _run_warm_process(**env):
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WARM_PROCESS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_process_loads_a_linked_library_without_importing_the_dsl():
    get_kernel(rmsnorm_spec(2048, "float16"), "sm_90a")
    result = _run_warm_process()
    assert result["stats"] == {"disk_hits": 1, "linked_loads": 1}
    assert result["dsl_imported"] is False


def test_without_a_c_compiler_the_dsl_loads_the_object(tmp_path):
    result = _run_warm_process(CC=str(tmp_path / "no-such-cc"), INDUCTOR_CUTE_CACHE_DIR=str(tmp_path / "c"))
    assert result["stats"] == {"compiles": 1, "dsl_loads": 1}


def test_key_changes_with_every_input():
    from inductor_cute.runtime.dsl import versions

    base = rmsnorm_spec(4096)
    v = versions()
    keys = {
        base.key("sm_90a", v),
        rmsnorm_spec(4096, "float16").key("sm_90a", v),
        rmsnorm_spec(8192).key("sm_90a", v),
        base.key("sm_100a", v),
        base.key("sm_90a", {**v, "cutlass_dsl": "4.8.2"}),
        base.key("sm_90a", {**v, "tvm_ffi": "0.1.99"}),
    }
    assert len(keys) == 6
    assert base.key("sm_90a", v) == rmsnorm_spec(4096).key("sm_90a", dict(reversed(list(v.items()))))


def test_key_changes_with_kernel_source(monkeypatch):
    from inductor_cute.runtime import spec as spec_mod
    from inductor_cute.runtime.dsl import versions

    s = rmsnorm_spec(4096)
    before = s.key("sm_90a", versions())
    monkeypatch.setattr(spec_mod, "source_hash", lambda module: "edited")
    assert s.key("sm_90a", versions()) != before


def test_compile_failure_is_a_one_line_compile_error():
    from inductor_cute import CompileError

    good = rmsnorm_spec(4096)
    bad = KernelSpec(good.module, tuple((k, "int7" if k == "dtype_name" else v) for k, v in good.params))
    with pytest.raises(CompileError, match=r"^compiling rmsnorm_sm90\(.*\) for sm_90a failed: ") as e:
        compile_spec(bad, "sm_90a")
    assert "\n" not in str(e.value)
