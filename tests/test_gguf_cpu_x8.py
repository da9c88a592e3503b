"""Q4_K and Q6_K rows repacked 8 at a time (``gguf_cpu.repack``, ``Q4_K_X8`` / ``Q6_K_X8``;
kernels/csrc/gguf_x8.h) against the file's blocks and the float64 reference twin, on fresh random
blocks each run.

The repack moves bytes only, so unpacking gives the file's bytes back and ``dequantize`` gives
``gguf.quants.dequantize``'s values. Products take the tolerances of tests/test_gguf_cpu_kernels.py
(``1e-5 * sum |w_i x_i|`` against x quantized as the kernel does, plus half an activation step
against the exact float product): each quantized activation row meets 8 repacked rows in exact
int32 sums per block; float activations and the scalar path unpack each row and run the file
type's kernels, so they equal the file layout's results bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from localgen.kernels import gguf_cpu

from test_gguf_cpu_kernels import FLOAT32_TOL, act_step_bound, random_blocks, weights

pytestmark = pytest.mark.skipif(not (gguf_cpu.available() and gguf_cpu.simd()),
                                reason="needs the kernel's SIMD build")
TYPES = tuple(gguf_cpu.REPACKED)  # the file types with a repacked layout
N = 40  # 5 groups of 8: more than one chunk at one-row chunks, not a multiple of 2 threads x 4
by_type = pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)


def pair(seed: int, qtype: Q, n: int = N, k: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(qtype, n, k, np.random.default_rng(seed))
    return raw, gguf_cpu.repack(raw, qtype, k)


def check_x8(qtype: Q, m: int, k: int, seed: int, activations: str = "q8",
             scalar: bool = False) -> None:
    """The repacked matrix's product within the reference's tolerance; for float activations or
    the scalar path, the file layout's bits."""
    raw, x8 = pair(seed, qtype, k=k)
    X8 = gguf_cpu.REPACKED[qtype]
    x = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((m, k), dtype=np.float32))
    y = gguf_cpu._matmul(x, x8, X8, k, scalar=scalar, activations=activations)
    w = weights(raw, qtype)
    if activations == "f32":
        rounding = FLOAT32_TOL * (x.double().abs() @ w.abs().T)
        assert ((y.double() - gguf_cpu.reference(x, raw, qtype, k)).abs() <= rounding).all()
    else:
        xq = gguf_cpu.quantize_activations(x, 256)
        rounding = FLOAT32_TOL * (xq.abs() @ w.abs().T)
        tight = (y.double() - gguf_cpu.reference(x, x8, X8, k, quantize_x=True)).abs()
        assert (tight <= rounding).all(), f"seed {seed}: max excess {(tight - rounding).max():.3g}"
        loose = (y.double() - gguf_cpu.reference(x, raw, qtype, k)).abs()
        assert (loose <= act_step_bound(x, w, qtype) + rounding).all()
    if activations == "f32" or scalar:
        want = gguf_cpu._matmul(x, raw, qtype, k, scalar=scalar, activations=activations)
        assert torch.equal(y, want)


@by_type
def test_repack_moves_bytes_only(qtype, seed):
    raw, x8 = pair(seed, qtype)
    X8 = gguf_cpu.REPACKED[qtype]
    assert x8.shape == raw.shape and not torch.equal(x8, raw)
    assert torch.equal(gguf_cpu.repack(x8, X8, 512, unpack=True), raw)
    inplace = raw.clone()
    assert gguf_cpu.repack(inplace, qtype, 512, out=inplace) is inplace
    assert torch.equal(inplace, x8)
    assert torch.equal(gguf_cpu.dequantize(x8, X8, 512).double(), weights(raw, qtype))


@by_type
@pytest.mark.parametrize("m", [1, 3, 16])
def test_repacked_product_matches_reference(qtype, m, seed):
    check_x8(qtype, m, 512, seed)
    check_x8(qtype, min(m, 3), 512, seed, activations="f32")
    check_x8(qtype, 2, 512, seed, scalar=True)


def test_q6_k_extreme_codes_and_scales(seed):
    """Q6_K codes all 0 or all 63 under scales of -128 and 127 against activations at +-127:
    the int32 sums' and maddubs' largest magnitudes, which random bytes seldom reach."""
    raw = random_blocks(Q.Q6_K, 8, 512, np.random.default_rng(seed)).view(8, 2, 210)
    for code, scale in ((0, -128), (0xff, 127)):
        raw[:, :, :192] = code
        raw[:, :, 192:208] = scale & 0xff
        x = torch.where(torch.rand(2, 512) < 0.5, -1.0, 1.0)  # every code quantizes to +-127
        flat = raw.reshape(8, 420)
        y = gguf_cpu.matmul(x, gguf_cpu.repack(flat, Q.Q6_K, 512), gguf_cpu.Q6_K_X8, 512)
        want = gguf_cpu.reference(x, flat, Q.Q6_K, 512)
        rounding = FLOAT32_TOL * (x.abs().double() @ weights(flat, Q.Q6_K).abs().T)
        assert ((y.double() - want).abs() <= rounding).all()


@by_type
@pytest.mark.parametrize("m", [1, 11])
def test_bits_whatever_the_split(qtype, m, seed, monkeypatch):
    """Outputs do not depend on the thread split (chunks round up to whole 8-row groups), the
    activation tiles or how many activation rows a kernel takes a visit (m = 11 goes 4, 4, 2, 1
    where AVX-512 is; each row alone takes the one-row kernel)."""
    raw, x8 = pair(seed, qtype, k=768)
    X8 = gguf_cpu.REPACKED[qtype]
    x = torch.randn(m, 768)
    want = gguf_cpu.matmul(x, x8, X8, 768)
    monkeypatch.setattr(gguf_cpu, "W_CHUNK_BYTES", 1)
    monkeypatch.setattr(gguf_cpu, "X_TILE_BYTES", 1)
    assert torch.equal(gguf_cpu.matmul(x, x8, X8, 768), want)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(gguf_cpu.matmul(x, x8, X8, 768), want)
    for i in range(m):
        assert torch.equal(gguf_cpu.matmul(x[i:i + 1], x8, X8, 768), want[i:i + 1])


@pytest.mark.parametrize("m", [1, 5])
def test_segments_take_repacked_segments(m, seed):
    """q/k/v as segments (Q4_K_X8 beside Q6_K_X8 and a file-layout Q6_K): each segment's columns
    are its own product."""
    raws = [pair(seed, Q.Q4_K, n=16)[1], pair(seed + 3, Q.Q6_K, n=8)[1],
            random_blocks(Q.Q6_K, 11, 512, np.random.default_rng(seed + 2))]
    types = [gguf_cpu.Q4_K_X8, gguf_cpu.Q6_K_X8, Q.Q6_K]
    x = torch.randn(m, 512)
    segs = gguf_cpu.RowSegments(raws, types, 512)
    want = torch.cat([gguf_cpu.matmul(x, r, t, 512) for r, t in zip(raws, types)], 1)
    assert torch.equal(segs.matmul(x), want)


def test_bad_input_is_named():
    raw = random_blocks(Q.Q4_K, 12, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of 8"):
        gguf_cpu.repack(raw, Q.Q4_K, 512)
    with pytest.raises(ValueError, match="expected one of"):
        gguf_cpu.repack(raw[:8], Q.Q5_K, 512)
    with pytest.raises(ValueError, match="Q6_K"):  # Q4_K rows are not Q6_K's 420 bytes
        gguf_cpu.repack(raw[:8], Q.Q6_K, 512)
    with pytest.raises(ValueError, match="Q4_K_X8"):  # 12 rows are not whole groups
        gguf_cpu.matmul(torch.zeros(1, 512), raw, gguf_cpu.Q4_K_X8, 512)
    assert gguf_cpu.repackable(raw[:8], Q.Q4_K, 512) and not gguf_cpu.repackable(raw, Q.Q4_K, 512)
    assert not gguf_cpu.repackable(raw[:8], Q.Q5_K, 512)


@by_type
def test_packed_weight_repacks_at_its_first_cpu_product(qtype, seed, monkeypatch):
    """``PackedGGUFWeight`` (quant/gguf_blocks.py) takes the repacked layout at its first CPU
    product, in place, and still dequantizes, moves and stacks as the file's blocks."""
    from localgen.quant import gguf_blocks as gb

    raw, x8 = pair(seed, qtype, n=16)
    X8 = gguf_cpu.REPACKED[qtype]
    w = gb.PackedGGUFWeight(raw.clone(), qtype, (16, 512))
    monkeypatch.setenv(gb.CPU_REPACK_ENV, "0")
    x = torch.randn(3, 512)
    want = gguf_cpu.matmul(x, raw, qtype, 512)
    assert torch.equal(w(x), want) and w.kernel_qtype == int(qtype)
    monkeypatch.delenv(gb.CPU_REPACK_ENV)
    monkeypatch.setenv(gb.CPU_ACTIVATIONS_ENV, "f32")  # float activations keep the file's layout
    w(x)
    assert w.kernel_qtype == int(qtype)
    monkeypatch.delenv(gb.CPU_ACTIVATIONS_ENV)
    y = w(x)
    assert w.kernel_qtype == X8 and torch.equal(w.raw, x8)  # in place: the same tensor
    assert torch.equal(y, gguf_cpu.matmul(x, x8, X8, 512))
    assert torch.equal(w.file_raw(), raw) and torch.equal(w.dequantize(), gb.dequantize(raw, qtype))
    ids = torch.tensor([[11, 3], [3, 15]])  # two groups, a repeat, out of order
    want_rows = gb.dequantize(raw[ids.reshape(-1)], qtype).reshape(2, 2, 512)
    assert torch.equal(w.embedding(ids), want_rows)
    same = w.to("cpu")
    assert same.raw is w.raw and same.kernel_qtype == X8
    assert torch.equal(gb.PackedGGUFWeight.cat_rows([w, w]).raw, torch.cat([raw, raw]))


def test_a_view_into_a_larger_buffer_keeps_the_file_layout(seed):
    """A weight over part of a buffer (the offload runtime's layer buffers, wrapped anew each
    step) is not rearranged: another wrapper of the same bytes must still read Q4_K blocks."""
    from localgen.quant import gguf_blocks as gb

    raw, _ = pair(seed, Q.Q4_K, n=16)
    buffer = torch.cat([raw, raw[:8]])
    w = gb.PackedGGUFWeight(buffer[:16], Q.Q4_K, (16, 512))
    x = torch.randn(1, 512)
    assert torch.equal(w(x), gguf_cpu.matmul(x, raw, Q.Q4_K, 512))
    assert w.kernel_qtype == int(Q.Q4_K) and torch.equal(buffer[:16], raw)
