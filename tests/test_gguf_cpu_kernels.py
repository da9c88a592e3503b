"""The GGUF quantized-weight matmul on the CPU (kernels/csrc/gguf_matmul.c) against its float64
reference twin, for every type it implements, on fresh random blocks each run (random bytes,
finite random fp16 scale fields), m = 1, 3, 16, 37 activation rows and n = 37 output rows (not
a multiple of any thread count or of the kernel's 4 rows per weight unpack).

Tolerances, per output element, in units of the products it sums:
- Against ``reference(..., quantize_x=True)`` (x quantized to 8 bits as the kernel does): the
  kernel's integer block sums are exact, so only float32 rounding remains — the int-to-float
  conversion, one or two scale products per block and the sum over k/32 blocks and 8 lanes,
  under 40 roundings of 2^-24 each for k = 512: ``|y - ref| <= 1e-5 * sum |w_i x_i|``.
- Against the exact float reference: rounding x * 127 / amax to the nearest code moves each
  x_i by at most half a step, amax_b / 254 for its block b, so
  ``|y - ref| <= sum_i |w_i| amax_b(i) / 254`` (plus the float32 term above).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from localgen.kernels import cpu_build
from localgen.kernels import gguf_cpu

needs_kernel = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler for the kernel")

# Byte offsets of each type's fp16 fields within a block (ggml-common.h): d, and dmin or m.
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.IQ4_NL: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
               Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
TYPES = sorted(gguf_cpu.SUPPORTED, key=int)
FLOAT32_TOL = 1e-5
N = 37


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """``[n, row_bytes]`` uint8: random bytes, each fp16 scale field a finite value of either
    sign with magnitude in [1e-3, 1)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1.0, raw.shape[:2]) * rng.choice([-1.0, 1.0], raw.shape[:2])
        raw[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(n, -1))


def weights(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).double()


def act_step_bound(x: torch.Tensor, w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """``[m, n]``: sum_i |w_i| * amax of x_i's activation block / 254."""
    block = gguf_cpu._ACT_BLOCK[qtype]
    amax = x.double().reshape(x.shape[0], -1, block).abs().amax(-1, keepdim=True)
    half_step = (amax / 254).expand(-1, -1, block).reshape(x.shape)
    return half_step @ w.abs().T


def check(qtype: Q, m: int, k: int, seed: int, scalar: bool = False) -> None:
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    y = gguf_cpu._matmul(x, raw, qtype, k, scalar=scalar)
    assert y.shape == (m, N) and y.dtype == torch.float32
    w = weights(raw, qtype)
    xq = gguf_cpu.quantize_activations(x, gguf_cpu._ACT_BLOCK[qtype])
    rounding = FLOAT32_TOL * (xq.abs() @ w.abs().T)
    tight = (y.double() - gguf_cpu.reference(x, raw, qtype, k, quantize_x=True)).abs()
    assert (tight <= rounding).all(), f"seed {seed}: max excess {(tight - rounding).max():.3g}"
    loose = (y.double() - gguf_cpu.reference(x, raw, qtype, k)).abs()
    bound = act_step_bound(x, w, qtype) + rounding
    assert (loose <= bound).all(), f"seed {seed}: max excess {(loose - bound).max():.3g}"


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 16, 37])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype, m, seed):
    check(qtype, m, 512, seed)


def check_f32(qtype: Q, m: int, k: int, seed: int, scalar: bool = False) -> None:
    """Float32 activations: the dequantized product up to float32 rounding only."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    y = gguf_cpu._matmul(x, raw, qtype, k, scalar=scalar, activations="f32")
    w = weights(raw, qtype)
    err = (y.double() - gguf_cpu.reference(x, raw, qtype, k)).abs()
    rounding = FLOAT32_TOL * (x.double().abs() @ w.abs().T)
    assert (err <= rounding).all(), f"seed {seed}: max excess {(err - rounding).max():.3g}"


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float_activations_give_the_dequantized_product(qtype, m, seed):
    check_f32(qtype, m, 512, seed)
    check_f32(qtype, 2, 512, seed, scalar=True)


def test_activation_modes_are_checked():
    raw = torch.zeros((1, 34), dtype=torch.uint8)
    with pytest.raises(ValueError, match="activations"):
        gguf_cpu.matmul(torch.zeros(1, 32), raw, Q.Q8_0, 32, activations="int4")


@needs_kernel
@pytest.mark.parametrize("qtype", [t for t in TYPES if GGML_QUANT_SIZES[t][0] == 32],
                         ids=lambda t: t.name)
def test_32_value_blocks_take_k_off_256(qtype, seed):
    check(qtype, 5, 32 * 13, seed)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_scalar_path_matches_reference(qtype, seed):
    check(qtype, 5, 512, seed, scalar=True)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype, seed):
    raw = random_blocks(qtype, 7, 512, np.random.default_rng(seed))
    assert torch.equal(gguf_cpu.dequantize(raw, qtype, 512).double(), weights(raw, qtype))


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_tiles_chunks_and_threads_give_the_same_bits(qtype, seed, monkeypatch):
    """Each output is one kernel call's sum whatever the plan: tiles of 4 activation rows,
    one-row chunks and one thread give the default plan's bits."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, 53, 768, rng)
    x = torch.from_numpy(rng.standard_normal((37, 768), dtype=np.float32))
    want = gguf_cpu.matmul(x, raw, qtype, 768)
    monkeypatch.setattr(gguf_cpu, "X_TILE_BYTES", 1)
    monkeypatch.setattr(gguf_cpu, "W_CHUNK_BYTES", 1)
    assert gguf_cpu._plan(37, 53, 768, qtype, raw.shape[1], 1024)[1:] == (4, 1)
    assert torch.equal(gguf_cpu.matmul(x, raw, qtype, 768), want)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(gguf_cpu.matmul(x, raw, qtype, 768), want)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_one_activation_row_gives_the_same_bits_whatever_the_chunks(qtype, seed, monkeypatch):
    """A decode step's single activation row: the kernel that takes four weight rows a visit
    and the one-row kernel (a chunk's last rows; one-row chunks send every row there) give each
    output the same bits, so a row's value does not depend on the thread split."""
    check_one_row_bits(qtype, seed, monkeypatch)


def check_one_row_bits(qtype, seed, monkeypatch) -> None:
    """One activation row through the default chunks and through one-row chunks: equal bits,
    and within the reference's tolerance."""
    k = 576 if GGML_QUANT_SIZES[qtype][0] == 32 else 768
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, N, k, rng)
    x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    want = gguf_cpu.matmul(x, raw, qtype, k)
    monkeypatch.setattr(gguf_cpu, "W_CHUNK_BYTES", 1)
    assert gguf_cpu._plan(1, N, k, qtype, raw.shape[1], 1024)[2] == 1
    assert torch.equal(gguf_cpu.matmul(x, raw, qtype, k), want)
    check(qtype, 1, k, seed)


@needs_kernel
def test_row_stride_bf16_input_and_zero_rows(seed):
    """Rows of a wider buffer (stride > row bytes), bf16 x (converted), and an all-zero
    activation block (no scale to divide by)."""
    rng = np.random.default_rng(seed)
    wide = random_blocks(Q.Q4_K, N, 1024, rng)
    raw = wide[:, :gguf_cpu.row_bytes(Q.Q4_K, 512)]
    x = torch.randn(3, 512).to(torch.bfloat16)
    x[1] = 0
    x[2, :256] = 0
    y = gguf_cpu.matmul(x, raw, Q.Q4_K, 512)
    assert torch.equal(y, gguf_cpu.matmul(x.float(), raw.contiguous(), Q.Q4_K, 512))
    assert torch.equal(y[1], torch.zeros(N))
    want = gguf_cpu.reference(x.float(), raw, Q.Q4_K, 512, quantize_x=True)
    assert torch.allclose(y.double(), want, rtol=1e-4, atol=1e-3)


@needs_kernel
def test_shape_errors_name_the_shapes():
    raw = torch.zeros(4, gguf_cpu.row_bytes(Q.Q4_K, 512), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x has shape \(2, 256\), expected \[m, 512\]"):
        gguf_cpu.matmul(torch.zeros(2, 256), raw, Q.Q4_K, 512)
    with pytest.raises(ValueError, match=r"raw has shape \(4, 288\).*\[n, 352\].*Q5_K"):
        gguf_cpu.matmul(torch.zeros(2, 512), raw, Q.Q5_K, 512)
    with pytest.raises(ValueError, match="not a positive multiple of Q4_K's block of 256"):
        gguf_cpu.matmul(torch.zeros(2, 96), raw, Q.Q4_K, 96)
    with pytest.raises(ValueError, match="uint8"):
        gguf_cpu.matmul(torch.zeros(2, 512), raw.to(torch.int8), Q.Q4_K, 512)


def test_types_not_implemented_return_none():
    raw = torch.zeros(4, 64, dtype=torch.uint8)
    assert gguf_cpu.matmul(torch.zeros(1, 256), raw, Q.IQ2_XXS, 256) is None
    assert gguf_cpu.matmul(torch.zeros(1, 32), raw, Q.F16, 32) is None


def test_no_compiler_returns_none(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALGEN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    cpu_build.load.cache_clear()
    try:
        raw = torch.zeros(4, gguf_cpu.row_bytes(Q.Q8_0, 64), dtype=torch.uint8)
        assert gguf_cpu.matmul(torch.zeros(1, 64), raw, Q.Q8_0, 64) is None
        assert gguf_cpu.dequantize(raw, Q.Q8_0, 64) is None
    finally:
        cpu_build.load.cache_clear()


@needs_kernel
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q5_0, Q.Q8_0),
                                   (Q.Q5_0, Q.Q6_K, Q.IQ4_NL)], ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("activations", gguf_cpu.ACTIVATIONS)
def test_row_segments_equal_each_segments_own_product(types, m, activations, seed):
    """q/k/v of different types as one call (Q4_K_M's; the third case mixes 32- and 256-value
    activation blocks): each segment's columns are its own ``matmul``'s bits."""
    rng = np.random.default_rng(seed)
    raws = [random_blocks(t, n, 512, rng) for t, n in zip(types, (37, 9, 13))]
    x = torch.from_numpy(rng.standard_normal((m, 512), dtype=np.float32))
    segs = gguf_cpu.RowSegments(raws, types, 512)
    want = torch.cat([gguf_cpu.matmul(x, r, t, 512, activations) for r, t in zip(raws, types)], 1)
    assert segs.n == 59 and torch.equal(segs.matmul(x, activations), want)


@needs_kernel
def test_row_segments_are_checked(seed):
    raw = random_blocks(Q.Q4_K, 4, 512, np.random.default_rng(seed))
    with pytest.raises(ValueError, match="1 to 4 segments"):
        gguf_cpu.RowSegments([raw] * 5, [Q.Q4_K] * 5, 512)
    with pytest.raises(ValueError, match="IQ2_XXS is not in SUPPORTED"):
        gguf_cpu.RowSegments([raw], [Q.IQ2_XXS], 512)
    with pytest.raises(ValueError, match=r"raw has shape \(4, 288\).*Q6_K"):
        gguf_cpu.RowSegments([raw], [Q.Q6_K], 512)
    segs = gguf_cpu.RowSegments([raw], [Q.Q4_K], 512)
    with pytest.raises(ValueError, match=r"x has shape \(1, 256\)"):
        segs.matmul(torch.zeros(1, 256))
    y = torch.empty(1, 5)
    # a table whose rows do not add up to n: the C's -4
    assert gguf_cpu._lib().lg_gguf_matmul(torch.zeros(1, 512).data_ptr(), 1, 512, segs.address, 5,
                                          0, gguf_cpu.SEGMENTS, y.data_ptr(), 1, 4, 4, 0) == -4
