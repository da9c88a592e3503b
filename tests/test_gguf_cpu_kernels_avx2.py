"""The GGUF CPU kernel built for AVX2 alone (``-mno-avx512f``, which also turns off every
AVX-512 subset and with it the VNNI dot products and the masked byte moves), on a machine whose
``-march=native`` build takes the AVX-512 paths: the same checks as tests/test_gguf_cpu_kernels.py
(tolerances stated there) run against this second library, so the AVX2 paths that most desktops
take stay correct where the tests run on an AVX-512 CPU.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest
from gguf import GGML_QUANT_SIZES

from localgen.kernels import cpu_build
from localgen.kernels import gguf_cpu

from test_gguf_cpu_kernels import TYPES, check, check_f32, check_one_row_bits


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not (gguf_cpu.available() and gguf_cpu.simd() and _avx512()),
    reason="needs the kernel's AVX2 build on a CPU with AVX-512 (else the other module covers it)")


@pytest.fixture(scope="module")
def avx2_lib(tmp_path_factory):
    """gguf_matmul.c compiled with cpu_build's flags plus ``-mno-avx512f``, loaded."""
    cc = cpu_build._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("avx2") / "gguf_matmul_avx2.so"
    src = cpu_build.CSRC / "gguf_matmul.c"
    proc = subprocess.run([cc, *cpu_build.FLAGS, "-mno-avx512f", str(src), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(out))
    for name, args in gguf_cpu._SIGNATURES.items():
        getattr(lib, name).argtypes = args
    return lib


@pytest.fixture
def on_avx2(avx2_lib, monkeypatch):
    """gguf_cpu calls the AVX2 build for the test's duration."""
    monkeypatch.setattr(gguf_cpu, "_lib", lambda: avx2_lib)
    gguf_cpu._layout.cache_clear()
    assert gguf_cpu.simd()
    yield
    gguf_cpu._layout.cache_clear()


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_build_matches_reference(on_avx2, qtype, m, seed):
    k = 576 if GGML_QUANT_SIZES[qtype][0] == 32 and m == 1 else 512
    check(qtype, m, k, seed)
    check_f32(qtype, min(m, 3), 512, seed)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_build_one_row_bits_whatever_the_chunks(on_avx2, qtype, seed, monkeypatch):
    """The four-weight-row kernel and the one-row kernel give a decode row the same bits in the
    AVX2 build too."""
    check_one_row_bits(qtype, seed, monkeypatch)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("qtype", tuple(gguf_cpu.REPACKED), ids=lambda t: t.name)
def test_avx2_build_repacked(on_avx2, qtype, m, seed):
    """The 8-row repacked Q4_K and Q6_K kernels without VNNI (maddubs + madd in place of
    dpbusd)."""
    from test_gguf_cpu_x8 import check_x8

    check_x8(qtype, m, 512, seed)
    check_x8(qtype, m, 512, seed, activations="f32")
