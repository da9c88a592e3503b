"""The Triton GGUF matmul (kernels/gguf_gemm.py) against gguf.quants.dequantize and a float64
matmul at small shapes: compiled on a GPU, else on the CPU under the Triton interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import gguf_gemm  # noqa: E402

Q = gguf.GGMLQuantizationType
# byte offsets of each block's fp16 fields: random bytes there could be inf/NaN
FP16_FIELDS = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, row_bytes]`` uint8 of random blocks with finite fp16 scales in [-2**-4, 2**-4]."""
    rng = np.random.default_rng(seed)
    nb, bb = k // gguf_gemm.BLOCK_WEIGHTS[qtype], gguf_gemm.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(-1, 1, size=(n, nb)) / 16).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * bb)


def reference(raw: np.ndarray, qtype, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], k).astype(np.float64)


@pytest.mark.parametrize("qtype", sorted(gguf_gemm.BLOCK_BYTES))
def test_dequantize_equals_gguf(qtype, kernel_device):
    raw = random_blocks(qtype, 5, 512, seed=qtype)
    got = gguf_gemm.dequantize(torch.from_numpy(raw).to(kernel_device), qtype, 512, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), reference(raw, qtype, 512).astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(gguf_gemm.BLOCK_BYTES))
@pytest.mark.parametrize("m,splits", [(1, None), (3, 3), (16, 2), (20, None)])
def test_matmul_matches_float64(qtype, m, splits, kernel_device):
    n, k = 37, 512  # n not a multiple of the 32-row tile
    raw = random_blocks(qtype, n, k, seed=100 + qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), device="cpu")
    y = gguf_gemm.matmul(x.to(kernel_device), torch.from_numpy(raw).to(kernel_device), qtype, k,
                         splits=splits).cpu()
    want = x.double().numpy() @ reference(raw, qtype, k).T
    # float32 products summed in another order than float64: relative to the row's scale
    tol = 1e-5 * np.abs(x.double().numpy()) @ np.abs(reference(raw, qtype, k)).T + 1e-6
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (np.abs(y.double().numpy() - want) <= tol).all()


def test_bad_shapes_are_named():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"uint8 \[N, 288\]"):
        gguf_gemm.matmul(torch.zeros(1, 512), raw, Q.Q4_K, 512)
    with pytest.raises(ValueError, match="no Triton kernel"):
        gguf_gemm.matmul(torch.zeros(1, 256), raw, Q.IQ2_XS, 256)
