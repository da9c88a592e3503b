"""The CPU kernels' build cache (kernels/cpu_build.py) opens only what it can vouch for: a
library planted at the predictable name, a damaged one, one others can write, or any library
in a folder others can write is never loaded (a planted constructor would run at dlopen and
leave a marker file); the real kernel is rebuilt and works."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from localgen.kernels import cpu_build
from localgen.kernels import layer_ops_cpu as ops

KERNEL = "layer_ops_cpu"
PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {{
    FILE *f = fopen("{marker}", "w");
    if (f) fclose(f);
}}
int lg_rms_norm(void) {{ return 0; }}
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache folder of this test (mode 0700), ``load`` forgetting earlier ones."""
    if cpu_build._compiler() is None:
        pytest.skip("no C compiler")
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(d))
    cpu_build.load.cache_clear()
    yield d
    cpu_build.load.cache_clear()


def cached_path(folder):
    return folder / cpu_build.library_name(cpu_build.CSRC / f"{KERNEL}.c", cpu_build._compiler())


def plant(path, marker, tmp_path):
    """Compile a library whose constructor creates ``marker`` to ``path``."""
    src = tmp_path / "planted.c"
    src.write_text(PLANTED.format(marker=marker))
    subprocess.run([cpu_build._compiler(), "-shared", "-fPIC", str(src), "-o", str(path)],
                   check=True, capture_output=True)


def hash_file(lib):
    return lib.with_name(lib.name + cpu_build.HASH_SUFFIX)


def forge_hash(lib):
    """The sidecar a planter able to write the folder would add."""
    hash_file(lib).write_text(f"{cpu_build._sha256(lib)}  {lib.name}\n")


def assert_kernel_works():
    lib = cpu_build.load(KERNEL)
    assert lib is not None
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    want = w * torch.nn.functional.rms_norm(x, (64,), eps=1e-6)
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), want, rtol=2e-5, atol=1e-6)


def test_a_planted_library_is_never_loaded_and_the_kernel_is_rebuilt(cache, tmp_path, caplog):
    marker, lib = tmp_path / "ran", cached_path(cache)
    plant(lib, marker, tmp_path)
    assert_kernel_works()
    assert not marker.exists()
    assert f"refusing {lib}" in caplog.text and "has no hash file" in caplog.text
    cpu_build.verify_library(lib)  # the rebuilt one, with its hash


def test_a_folder_others_can_write_is_refused(cache, tmp_path, caplog):
    marker, lib = tmp_path / "ran", cached_path(cache)
    plant(lib, marker, tmp_path)
    forge_hash(lib)
    cache.chmod(0o777)
    assert_kernel_works()
    assert not marker.exists()
    assert "writable by group or others" in caplog.text and str(cache) in caplog.text
    assert cpu_build.load(KERNEL)._name.startswith(str(cpu_build._private_dir()))


@pytest.mark.parametrize("damage", ["hash file", "library"])
def test_a_hash_mismatch_is_rebuilt(cache, caplog, damage):
    # built, not loaded: a loaded library's file must not change under its mapping
    lib = cpu_build._build(cpu_build.CSRC / f"{KERNEL}.c", cpu_build._compiler())
    assert lib == cached_path(cache)
    good = lib.read_bytes()
    if damage == "hash file":
        hash_file(lib).write_text("0" * 64 + "\n")
    else:
        lib.write_bytes(good[: len(good) // 2])  # a copy cut short
    assert_kernel_works()
    assert "does not match the SHA-256" in caplog.text and str(lib) in caplog.text
    assert lib.read_bytes() == good


def test_a_library_others_can_write_is_rebuilt(cache, tmp_path, caplog):
    marker, lib = tmp_path / "ran", cached_path(cache)
    plant(lib, marker, tmp_path)
    forge_hash(lib)
    lib.chmod(0o666)
    assert_kernel_works()
    assert not marker.exists() and "writable by group or others" in caplog.text
    assert lib.stat().st_mode & 0o777 == 0o755


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="only root can give a file to another user")
def test_a_library_of_another_user_is_rebuilt(cache, tmp_path, caplog):
    marker, lib = tmp_path / "ran", cached_path(cache)
    plant(lib, marker, tmp_path)
    forge_hash(lib)
    os.chown(lib, 65534, -1)
    assert_kernel_works()
    assert not marker.exists() and "owned by uid 65534" in caplog.text


def test_a_missing_cache_folder_is_created_private(tmp_path, monkeypatch):
    if cpu_build._compiler() is None:
        pytest.skip("no C compiler")
    d = tmp_path / "new" / "kernels"
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(d))
    cpu_build.load.cache_clear()
    try:
        assert_kernel_works()
    finally:
        cpu_build.load.cache_clear()
    assert d.stat().st_mode & 0o777 == 0o700
    assert cached_path(d).is_file() and hash_file(cached_path(d)).is_file()
