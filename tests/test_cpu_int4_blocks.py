"""The CPU int4 path read straight from a GGUF's blocks: Q4_1 and Q8_0 raw rows become the same
Int4Linear (packed codes, scales and zeros, dense matrix) as the Int4Tensor route and the
dequantized file give, bit for bit."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from localgen.quant import cpu_int4
from localgen.quant.gguf_blocks import dequantize
from localgen.quant.gguf_import import q4_1_blocks_to_int4

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch has no CPU int4 kernel")


def random_blocks(rows: int, cols: int, qtype: Q, seed: int = 0) -> torch.Tensor:
    """Raw GGUF rows ``[rows, cols // 32 * block bytes]`` with finite fp16 scales (and mins)."""
    gen = torch.Generator().manual_seed(seed)
    nb = cols // 32
    d = (torch.rand(rows, nb, 1, generator=gen) * 0.05 + 0.001).half().view(torch.uint8)
    if qtype == Q.Q4_1:
        m = (torch.randn(rows, nb, 1, generator=gen) * 0.1).half().view(torch.uint8)
        qs = torch.randint(0, 256, (rows, nb, 16), generator=gen, dtype=torch.uint8)
        blocks = torch.cat([d, m, qs], dim=-1)
    else:
        qs = torch.randint(0, 256, (rows, nb, 32), generator=gen, dtype=torch.uint8)
        blocks = torch.cat([d, qs], dim=-1)
    return blocks.reshape(rows, -1).contiguous()


def same(a: cpu_int4.Int4Linear, b: cpu_int4.Int4Linear) -> bool:
    return (a.shape == b.shape and torch.equal(a.packed, b.packed)
            and torch.equal(a.scales_and_zeros, b.scales_and_zeros) and torch.equal(a.dense, b.dense))


def test_q4_1_blocks_give_the_int4tensor_route_bit_for_bit():
    raw = random_blocks(96, 128, Q.Q4_1)
    fast = cpu_int4.q4_1_as_int4(raw, 96, 128)
    slow = cpu_int4.Int4Linear.from_int4([q4_1_blocks_to_int4(raw.numpy(), 96, 128)])
    assert same(fast, slow)
    assert torch.equal(fast.dense, dequantize(raw, Q.Q4_1, torch.bfloat16))


def test_q8_0_planes_keep_the_file_values():
    raw = random_blocks(64, 96, Q.Q8_0, seed=3)
    lin = cpu_int4.q8_0_as_int4(raw, 64, 96)
    want = dequantize(raw, Q.Q8_0)
    assert torch.equal(lin.dense, want.to(torch.bfloat16))
    x = torch.randn(2, 96).bfloat16()
    y, ref = lin(x).double(), x.double() @ want.double().T
    assert float((y - ref).norm() / ref.norm()) < 1e-2  # bf16 activations and scales


def test_packing_in_row_chunks_equals_packing_whole(monkeypatch):
    codes = torch.randint(0, 16, (176, 64), dtype=torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    monkeypatch.setattr(cpu_int4, "PACK_ROWS", 64)  # 176 rows: two whole 64-row tiles and a part
    assert torch.equal(cpu_int4._convert_rows(codes.to(torch.uint8)), whole)


def test_short_raw_rows_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match="need 2560 bytes, got 2540"):
        cpu_int4.q4_1_as_int4(torch.zeros(2540, dtype=torch.uint8), 32, 128)


def test_codes_are_packed_at_the_first_small_m_call_only():
    raw = random_blocks(64, 64, Q.Q4_1, seed=5)
    eager = cpu_int4.q4_1_as_int4(raw, 64, 64)
    q = q4_1_blocks_to_int4(raw.numpy(), 64, 64)
    calls = []

    def codes():
        calls.append(1)
        return cpu_int4.unpack_codes(q)

    lazy = cpu_int4.Int4Linear(codes, q.scale, q.min, 32, dense=eager.dense)
    x = torch.randn(16, 64).bfloat16()
    assert torch.equal(lazy(x), eager(x)) and calls == []  # large M: the dense matrix
    assert torch.equal(lazy(x[:1]), eager(x[:1])) and calls == [1]  # small M packs once
    assert torch.equal(lazy(x[:2]), eager(x[:2])) and calls == [1]
    assert lazy.decode_nbytes == eager.packed.numel() + eager.scales_and_zeros.numel() * 2


def test_a_dense_function_is_called_at_the_first_large_m_call_only():
    raw = random_blocks(64, 96, Q.Q8_0, seed=6)
    calls = []

    def dense():
        calls.append(1)
        return dequantize(raw, Q.Q8_0, torch.bfloat16)

    lin = cpu_int4.q8_0_as_int4(raw, 64, 96, dense=dense, max_m=4)
    x = torch.randn(8, 96).bfloat16()
    lin(x[:4])
    assert calls == []
    assert torch.equal(lin(x), torch.nn.functional.linear(x, dense())) and calls == [1, 1]
    lin(x)
    assert calls == [1, 1]


def test_neither_codes_nor_dense_as_a_tensor_is_refused():
    with pytest.raises(ValueError, match="codes or its dense matrix"):
        cpu_int4.Int4Linear(lambda: None, torch.ones(1, 1), torch.ones(1, 1), 32, dense=lambda: None)
