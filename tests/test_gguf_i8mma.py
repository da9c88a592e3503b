"""The int8 tensor-core matmul over GGUF Q4_K and Q6_K blocks (kernels/gguf_i8mma.py), its
dispatch through gguf_gemm.matmul and its sweep configs, against gguf.quants.dequantize and a
float64 matmul at small shapes: compiled on a GPU, else on the CPU under the Triton interpreter
(whose int8 ``tl.dot`` sums in int32, as the tensor cores do: products of 4- or 6-bit codes and
int8 activations overflow int8 at once, so these tests would fail if it did not)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("kernel_device")

from localgen.kernels import gguf_gemm, gguf_gemv, gguf_i8mma, gguf_q8  # noqa: E402
from localgen.kernels.gguf_gemv import DecodeConfig  # noqa: E402
from localgen.kernels.triton_common import interpreting  # noqa: E402

from test_gguf_gemm_triton import check_q8_matmul, q8_x, random_blocks  # noqa: E402
from test_gguf_mma import _Recorder  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [2, 5, 16, 33])
@pytest.mark.parametrize("cfg", [DecodeConfig("i8mma", block_n=32, split_k=1),
                                 DecodeConfig("i8mma", block_n=64, split_k=2, num_warps=8),
                                 DecodeConfig("i8mma", block_n=16, split_k=2, chunks_per_step=1),
                                 DecodeConfig("i8mma", block_n=32, chunks_per_step=2)])
def test_i8mma_within_the_rounding_of_x(qtype, m, cfg, kernel_device):
    """The activations rounded as ``gguf_q8`` rounds them (int8 per 32-group, step
    ``d = max|x|/127``), the codes' products summed exactly in int32 and the scales applied in
    float32: the error is the rounding's, ``Σ_j |a q_j|·d_g(j)/2`` for Q4_K and Q5_K (their min
    term takes the exact ``Σ x``) and ``Σ_j |w_j|·d_g(j)/2`` for Q6_K, plus float32 summation
    (``check_q8_matmul``'s bound, hand-derived; it also checks that x was rounded at all).
    Three tiles a row over two K slices: the second slice is shorter; Q4_K and Q5_K loop over
    blocks, halves or chunks of them (Q6_K over block halves whatever the config says)."""
    assert gguf_gemv.serves(cfg, qtype, m) == (qtype != Q.Q6_K or cfg.chunks_per_step == 4)
    check_q8_matmul(cfg, kernel_device, qtype, m=m)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [65, 130])
def test_i8mma_prefill_walks_m(qtype, m, kernel_device):
    """Past ``MAX_BLOCK_M`` rows (Q4_K, Q5_K 64, Q6_K 32) the grid's first axis walks M (130:
    the last program's rows mostly past M), each row within the same rounding bound."""
    assert gguf_i8mma.block_m(m, qtype) == gguf_i8mma.MAX_BLOCK_M[qtype] < m
    check_q8_matmul(DecodeConfig("i8mma", block_n=16, split_k=1), kernel_device, qtype, m=m)


# the interpreter's float32 -> bf16 store truncates rather than rounding to nearest
HALF = [torch.float16] if interpreting() else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("qtype", TYPES)
def test_i8mma_half_activations(dtype, qtype, kernel_device):
    """bf16/fp16 activations (a served model's dtype) are rounded from their own values and y
    is rounded once to the dtype: the float32 product of the same rounding, within that last
    rounding (relative ``u``) of ``|y|``."""
    n, k, m = 37, 512, 6
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=7)).to(kernel_device)
    x = q8_x(m)[:, :k].to(dtype).to(kernel_device)
    cfg = DecodeConfig("i8mma", block_n=32, split_k=1)
    y = gguf_gemm.matmul(x, raw, qtype, k, cfg)
    y32 = gguf_gemm.matmul(x.float(), raw, qtype, k, cfg)
    u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    assert y.dtype == dtype
    assert ((y.float() - y32).abs() <= u * y32.abs() + 1e-6).all()


def test_i8mma_refuses_what_it_does_not_serve():
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 4, 256, seed=1))
    cfg = DecodeConfig("i8mma", block_n=16)
    for m, qtype in [(1, Q.Q4_K), (4, Q.Q8_0)]:
        with pytest.raises(ValueError, match="gguf_i8mma serves"):
            gguf_i8mma.matmul(torch.zeros(m, 256), raw, qtype, 256, cfg)
    with pytest.raises(ValueError, match="chunks_per_step must be 1, 2 or 4"):
        gguf_i8mma.matmul(torch.zeros(3, 256), raw, Q.Q4_K, 256,
                          DecodeConfig("i8mma", chunks_per_step=3))
    with pytest.raises(ValueError, match="quantize of 3 rows"):
        gguf_i8mma.matmul(torch.zeros(3, 256), raw, Q.Q4_K, 256, cfg,
                          x8=gguf_q8.quantize(torch.zeros(2, 256)))
    assert gguf_i8mma.serves(raw, Q.Q4_K, 2) and gguf_i8mma.serves(raw, Q.Q6_K, 4096)
    assert not gguf_i8mma.serves(raw, Q.Q4_K, 1) and not gguf_i8mma.serves(raw, Q.Q8_0, 4)
    assert not gguf_i8mma.serves(raw[:, 2:], Q.Q4_K, 4)  # Q4_K's loads need 16-byte rows
    for qtype, m, ok in [(Q.Q4_K, 2, True), (Q.Q6_K, 512, True), (Q.Q5_K, 16, True),
                         (Q.Q4_K, 1, False), (Q.Q8_0, 16, False)]:
        assert gguf_gemv.serves(cfg, qtype, m) == ok


@pytest.mark.parametrize("qtype,m,ran", [(Q.Q4_K, 1, "_gemm_decode"),
                                         (Q.Q8_0, 40, "_dequant_matmul")])
def test_i8mma_config_where_it_does_not_serve(qtype, m, ran, monkeypatch, kernel_device):
    """An i8mma config for an M or type it does not take runs the file kernel (up to 16 rows)
    or the prefill path (past them)."""
    calls = []
    for name in ("_dequant_matmul", "_gemm_decode"):
        monkeypatch.setattr(gguf_gemm, name, _Recorder(getattr(gguf_gemm, name), calls, name))
    raw = torch.from_numpy(random_blocks(qtype, 20, 256, seed=2)).to(kernel_device)
    gguf_gemm.matmul(torch.randn(m, 256), raw, qtype, 256, DecodeConfig("i8mma", block_n=16))
    assert calls == [ran]


def _winners(tmp_path, monkeypatch, entries) -> None:
    """``LOCALGEN_GGUF_DECODE_CONFIGS`` naming ``entries`` ``[(qtype, m, cfg)]``."""
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"winners": [dict(qtype=int(q), m=m, cfg=c.__dict__)
                                            for q, m, c in entries]}))
    monkeypatch.setenv(gguf_gemv.ENV_CONFIGS, str(path))


def test_prefill_takes_the_table_then_a_sweeps_prefill_winner(tmp_path, monkeypatch,
                                                              kernel_device):
    """Past ``MMA_MAX_M`` rows the default is ``PREFILL_CONFIGS`` (dequantize + cuBLAS for
    every type until a sweep says otherwise); a sweep's winner at M = 512 serves every prompt
    past 64 rows (at or below 512: the nearest measured M at or above, past it the largest),
    and the default path then runs the int8 kernel, within the rounding bound."""
    for qtype in gguf_gemv.TYPES:
        assert gguf_gemv.default_config(qtype, 65) == gguf_gemv.DEQUANT_CONFIG
        assert gguf_gemv.decode_class(65) == gguf_gemv.PREFILL_CLASS != gguf_gemv.decode_class(64)
    at16 = DecodeConfig("i8mma", block_n=32, num_warps=4)
    at512 = DecodeConfig("i8mma", block_n=128, num_warps=8, split_k=1)
    gguf_gemv.measured_winners.cache_clear()
    _winners(tmp_path, monkeypatch, [(Q.Q4_K, 16, at16), (Q.Q4_K, 512, at512)])
    try:
        assert gguf_gemv.default_config(Q.Q4_K, 3) == at16
        assert gguf_gemv.default_config(Q.Q4_K, 40) == at512  # nearest measured at or above
        assert gguf_gemv.default_config(Q.Q4_K, 2048) == at512  # past every measured M
        assert gguf_gemv.default_config(Q.Q6_K, 2048) == gguf_gemv.DEQUANT_CONFIG
        assert gguf_gemv.rounds_x(Q.Q4_K, 70) and not gguf_gemv.rounds_x(Q.Q6_K, 70)
        calls = []
        monkeypatch.setattr(gguf_i8mma, "_q45k_i8mma",
                            _Recorder(gguf_i8mma._q45k_i8mma, calls, "i8mma"))
        check_q8_matmul(None, kernel_device, Q.Q4_K, m=70)
        assert calls == ["i8mma"]
    finally:
        gguf_gemv.measured_winners.cache_clear()


def test_matmuls_same_x_shares_the_rounding_with_i8mma(tmp_path, monkeypatch, kernel_device):
    """q, k and v of one x where a sweep's winners name i8mma for both types: one
    ``gguf_q8.quantize`` launch serves the three, each output equal to its own matmul."""
    from test_gguf_gemm_triton import _roundings_of_qkv

    cfg = DecodeConfig("i8mma", block_n=16, split_k=1)
    gguf_gemv.measured_winners.cache_clear()
    _winners(tmp_path, monkeypatch, [(q, 16, cfg) for q in TYPES])
    try:
        assert _roundings_of_qkv(5, monkeypatch, kernel_device) == 1
    finally:
        gguf_gemv.measured_winners.cache_clear()


def test_sweep_times_i8mma_at_decode_and_prefill_rows():
    """``gguf_gemm_bench --sweep`` times a handful of i8mma tiles at 16 and 64 rows (mma.sync
    and wgmma tiles, K split or not) and, at the prefill rows ``--sweep-ms`` may add, only the
    i8mma tiles beside the prefill path."""
    from localgen.bench import gguf_gemm_bench as bench

    assert {16, 64} <= set(bench.SWEEP_MS)
    for qtype in bench.SWEEP_QTYPES:
        for m in (16, 64, 128, 512):
            timed = [c for c in bench.sweep_configs() if bench.sweep_serves(c, qtype, m)]
            i8 = [c for c in timed if c.kernel == "i8mma"]
            assert len(i8) >= 4 and {c.block_n for c in i8} >= {16, 32, 64}
            assert {c.split_k for c in i8} == {0, 1} and gguf_gemv.DEQUANT_CONFIG in timed
            if m > gguf_gemv.MMA_MAX_M:
                assert {c.kernel for c in timed} == {"i8mma", "dequant"}


@pytest.mark.parametrize("qtype,block_n,num_warps,m,chunks", [
    (Q.Q4_K, 64, 4, 5, 4), (Q.Q4_K, 64, 4, 16, 4), (Q.Q6_K, 64, 4, 16, 4),
    (Q.Q4_K, 64, 4, 64, 4), (Q.Q6_K, 64, 4, 64, 4), (Q.Q6_K, 32, 4, 5, 4),
    (Q.Q4_K, 16, 1, 64, 4), (Q.Q6_K, 16, 1, 64, 4), (Q.Q4_K, 32, 4, 512, 4),
    (Q.Q5_K, 64, 4, 16, 4), (Q.Q5_K, 32, 4, 64, 4), (Q.Q4_K, 32, 4, 64, 1),
    (Q.Q4_K, 64, 4, 64, 1), (Q.Q5_K, 64, 4, 16, 1)])
def test_sm90_build_keeps_its_registers(qtype, block_n, num_warps, m, chunks, tmp_path):
    """Sweep tiles build for sm_90 with the inline-assembly unpacking (what the interpreter
    cannot run), 8 activation rows a program (M = 5: an int8 dot's N, padded by Triton) to 64,
    and spill no register to the stack."""
    from tests.sm90_build import stack_bytes

    q6k = qtype == Q.Q6_K
    ptrs = ["xq_ptr", "xd_ptr"] + ([] if q6k else ["xs_ptr"]) + ["w_ptr", "y_ptr", "part_ptr",
                                                                  "cnt_ptr"]
    ints = ["M", "N", "num_tiles", "tiles_per_split", "m_tiles", "splits",
            "stride_wn" if q6k else "row_16b", "stride_ym"]
    types = ["*i8"] + ["*fp32"] * (len(ptrs) - 5) + ["*u8", "*bf16", "*fp32", "*i32"]
    sig = dict(zip(ptrs + ints, types + ["i32"] * len(ints)))
    x_rows, bm = gguf_q8.m_pad(m), gguf_i8mma.block_m(m, qtype)
    consts = dict(X_ROWS=x_rows, BLOCK_N=block_n, BLOCK_M=bm, MASK_M=x_rows < bm, SPLIT=True,
                  ASM=True)
    if not q6k:
        consts = dict(QTYPE=int(qtype), CHUNKS=chunks, **consts)
    kernel = "_q6k_i8mma" if q6k else "_q45k_i8mma"
    aligned = list(range(len(ptrs))) + [len(sig) - 1]
    stages = gguf_i8mma.Q6K_STAGES if q6k else None  # as matmul launches it
    assert stack_bytes("localgen.kernels.gguf_i8mma", kernel, sig, consts, aligned, num_warps,
                       tmp_path, stages) == 0
