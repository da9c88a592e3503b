"""The tensor-core decode kernel for 2 <= M <= 64 (kernels/gguf_mma.py) and its dispatch through
gguf_gemm.matmul, against gguf.quants.dequantize and a float64 matmul at small shapes: compiled on
a GPU, else on the CPU under the Triton interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import gguf_gemm, gguf_gemv, gguf_mma  # noqa: E402
from localgen.kernels.gguf_gemv import DecodeConfig  # noqa: E402
from localgen.kernels.triton_common import interpreting  # noqa: E402

from conftest import KERNEL_DEVICE  # noqa: E402
from test_gguf_gemm_triton import random_blocks, reference  # noqa: E402

Q = gguf.GGMLQuantizationType
# unit roundoff of each activation dtype: the tile's weights round once to it, and so does y
ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def product(qtype, m: int, cfg, dtype=torch.float32, n: int = 37, k: int = 512):
    """(y from gguf_gemm.matmul under ``cfg``, the float64 product, ``|x|·|W|ᵀ``) for random
    blocks (n not a multiple of any row tile) and random activations in ``dtype``, on the
    device the kernels run on."""
    raw = random_blocks(qtype, n, k, seed=200 + qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), device="cpu").to(dtype)
    dev = KERNEL_DEVICE
    y = gguf_gemm.matmul(x.to(dev), torch.from_numpy(raw).to(dev), qtype, k, cfg).cpu()
    w = reference(raw, qtype, k)
    xd = x.double().numpy()
    assert y.shape == (m, n) and y.dtype == dtype
    return y.double().numpy(), xd @ w.T, np.abs(xd) @ np.abs(w).T


@pytest.mark.parametrize("qtype", gguf_mma.TYPES)
@pytest.mark.parametrize("m", [2, 5, 16, 33, 64])
@pytest.mark.parametrize("cfg", [DecodeConfig("mma", block_n=16, split_k=1),
                                 DecodeConfig("mma", block_n=32, split_k=2, num_warps=8)])
def test_mma_matches_float64(qtype, m, cfg):
    """float32 activations multiply in IEEE float32: each weight ``(a·2**B)·f - (a·2**B + b)``
    is within a few float32 roundings of ``a·q - b``, and the sums are float32 sums in another
    order, so the error stays below 1e-5 of the row's ``|x|·|W|`` (and 1e-6 absolute)."""
    y, want, scale = product(qtype, m, cfg)
    assert (np.abs(y - want) <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("qtype", gguf_mma.TYPES)
@pytest.mark.parametrize("block_n,num_warps,kc", [(64, 2, 128), (128, 2, 64)])
def test_mma_tile_in_parts(qtype, block_n, num_warps, kc):
    """A tile dequantized 128 or 64 columns at a time (large row tiles on few warps), each part
    with its own share of the activations, gives the same product."""
    if qtype == Q.Q6_K:
        num_warps *= 2  # the same parts: Q6_K takes half of Q4_K's values a thread
    assert gguf_mma.k_chunk(qtype, block_n, num_warps, 16) == kc
    cfg = DecodeConfig("mma", block_n=block_n, split_k=2, num_warps=num_warps)
    y, want, scale = product(qtype, 9, cfg, n=block_n + 3)
    assert (np.abs(y - want) <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("qtype", gguf_mma.TYPES)
def test_mma_split_k_uneven(qtype):
    """Three tiles a row over two K slices: the second slice is shorter."""
    y, want, scale = product(qtype, 7, DecodeConfig("mma", block_n=16, split_k=2), k=768)
    assert (np.abs(y - want) <= 1e-5 * scale + 1e-6).all()


HALF = [torch.float16] if interpreting() else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF)  # the interpreter's bf16 tl.dot is not bf16's
@pytest.mark.parametrize("qtype", gguf_mma.TYPES)
@pytest.mark.parametrize("m", [2, 33])
def test_mma_half_activations(dtype, qtype, m):
    """bf16/fp16 tiles (a served model's dtype): each weight rounds once to the dtype (relative
    ``u``), the products accumulate in float32, and y rounds once more, so
    ``|y - x·Wᵀ| <= 2u·|x|·|W|`` (float32 accumulation error is far below ``u``)."""
    y, want, scale = product(qtype, m, DecodeConfig("mma", block_n=32, split_k=1), dtype)
    assert (np.abs(y - want) <= 2 * ROUNDOFF[dtype] * scale + 1e-6).all()


def test_mma_refuses_what_it_does_not_serve():
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 4, 256, seed=1))
    cfg = DecodeConfig("mma", block_n=16)
    for m, qtype in [(1, Q.Q4_K), (65, Q.Q4_K), (4, Q.Q5_K)]:
        with pytest.raises(ValueError, match="gguf_mma serves"):
            gguf_mma.matmul(torch.zeros(m, 256), raw, qtype, 256, cfg)
    with pytest.raises(ValueError, match="activations"):
        gguf_mma.matmul(torch.zeros(4, 256, dtype=torch.float64), raw, Q.Q4_K, 256, cfg)
    assert not gguf_mma.serves(raw, Q.Q4_K, 1) and not gguf_mma.serves(raw, Q.Q5_K, 4)
    assert gguf_mma.serves(raw, Q.Q4_K, 64) and not gguf_mma.serves(raw[:, 1:], Q.Q4_K, 4)


@pytest.mark.parametrize("qtype,m,kernel", [(Q.Q4_K, 1, "file"), (Q.Q5_K, 5, "file"),
                                            (Q.Q5_K, 40, "dequant")])
def test_mma_config_where_it_does_not_serve(qtype, m, kernel, monkeypatch):
    """An mma config for a type or M it does not take runs the file kernel (up to 16 rows) or
    the prefill path (past them), and gives the right product."""
    ran = []
    for name, fn in [("_dequant_matmul", gguf_gemm._dequant_matmul),
                     ("_gemm_decode", gguf_gemm._gemm_decode)]:
        monkeypatch.setattr(gguf_gemm, name, _Recorder(fn, ran, name))
    y, want, scale = product(qtype, m, DecodeConfig("mma", block_n=16))
    assert ran == [{"file": "_gemm_decode", "dequant": "_dequant_matmul"}[kernel]]
    assert (np.abs(y - want) <= 1e-5 * scale + 1e-6).all()


class _Recorder:
    """A stand-in for a function or a Triton kernel (``fn[grid](...)``) that records its name."""

    def __init__(self, fn, ran: list, name: str):
        self.fn, self.ran, self.name = fn, ran, name

    def __call__(self, *args, **kwargs):
        self.ran.append(self.name)
        return self.fn(*args, **kwargs)

    def __getitem__(self, grid):
        self.ran.append(self.name)
        return self.fn[grid]


def test_table_entries_cover_their_m_class_and_serve_it():
    """2..16 rows take the table's M = 16 entry and 17..64 rows its M = 64 entry, each one a
    config that serves its type and M; a type the table does not name takes the file kernel up
    to 16 rows and the prefill path past them."""
    for qtype in gguf_gemv.TYPES:
        for m in (2, 16):
            assert gguf_gemv.default_config(qtype, m) == gguf_gemv.DECODE_CONFIGS[(qtype, 16)]
        for m in (17, 40, 64):
            assert gguf_gemv.default_config(qtype, m) == gguf_gemv.DECODE_CONFIGS[(qtype, 64)]
        for m in (1, 2, 16, 17, 64):
            assert gguf_gemv.serves(gguf_gemv.default_config(qtype, m), qtype, m)
    assert gguf_gemv.default_config(Q.Q8_0, 16) == gguf_gemv.FILE_CONFIG
    assert gguf_gemv.default_config(Q.Q8_0, 33) == gguf_gemv.DEQUANT_CONFIG


def test_sweep_winners_select_the_mma_kernel(tmp_path, monkeypatch):
    """A sweep's winners (``LOCALGEN_GGUF_DECODE_CONFIGS``) that name mma configs are plain
    DecodeConfig values: M = 16's serves 2..16, M = 64's 17..64, and the M = 1 call, which mma
    does not serve, keeps the table's; the default path then runs the mma kernel."""
    mma16 = DecodeConfig("mma", block_n=64, num_warps=4, num_stages=3)
    mma64 = DecodeConfig("mma", block_n=128, num_warps=8)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"winners": [
        {"qtype": int(Q.Q4_K), "m": 16, "cfg": mma16.__dict__},
        {"qtype": int(Q.Q4_K), "m": 64, "cfg": mma64.__dict__}]}))
    monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, str(path))
    gguf_gemv.measured_winners.cache_clear()
    try:
        assert gguf_gemv.default_config(Q.Q4_K, 2) == mma16
        assert gguf_gemv.default_config(Q.Q4_K, 17) == mma64
        assert gguf_gemv.default_config(Q.Q4_K, 1) == gguf_gemv.DECODE_CONFIGS[(Q.Q4_K, 1)]
        calls = []
        monkeypatch.setattr(gguf_mma, "_gguf_mma", _Recorder(gguf_mma._gguf_mma, calls, "mma"))
        y, want, scale = product(Q.Q4_K, 20, None)
        assert calls == ["mma"] and (np.abs(y - want) <= 1e-5 * scale + 1e-6).all()
    finally:
        gguf_gemv.measured_winners.cache_clear()


@pytest.mark.parametrize("qtype,block_n,num_warps,m_pad", [
    (Q.Q4_K, 64, 4, 16), (Q.Q6_K, 64, 4, 16), (Q.Q4_K, 128, 8, 64), (Q.Q6_K, 128, 8, 64)])
def test_sm90_build_keeps_its_registers(qtype, block_n, num_warps, m_pad, tmp_path):
    """The sweep's tiles build for sm_90 with the parts that ``k_chunk`` picks, and spill no
    register to the stack (a spill turns each part's weights into local-memory traffic)."""
    from tests.sm90_build import stack_bytes

    names = ["x_ptr", "w_ptr", "y_ptr", "M", "N", "num_tiles", "tiles_per_split", "stride_xm",
             "row_units", "stride_ym"]
    sig = dict(zip(names, ["*bf16", "*u8", "*fp32"] + ["i32"] * 7))
    consts = dict(QTYPE=int(qtype), BLOCK_N=block_n, M_PAD=m_pad,
                  KC=gguf_mma.k_chunk(qtype, block_n, num_warps, m_pad), ATOMIC=True,
                  DOT_DTYPE="tl.bfloat16", IEEE=False)
    assert stack_bytes("localgen.kernels.gguf_mma", "_gguf_mma", sig, consts, [0, 1, 2, 7, 8, 9],
                       num_warps, tmp_path) == 0
