"""4-bit group-wise quantization (FlexGen §5): round trip within the stated bound, grouping axes,
packed sizes, and the bit-exact GGUF Q4_1 import."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localgen.quant import GROUP_SIZE, dequantize, max_abs_error, quantize
from localgen.quant.gguf_import import q4_1_blocks_to_int4


@pytest.mark.parametrize("shape,dim", [((128, 96), 0), ((130, 40), 0), ((3, 5, 2, 80), -1), ((4, 64), 1)])
def test_round_trip_within_bound(shape, dim):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3 + 0.5
    q = quantize(x, dim=dim)
    err = (dequantize(q) - x).abs()
    assert (err <= max_abs_error(q)).all()
    # the bound is about half a step: (max - min) / 30 per group
    assert err.max() <= (x.max() - x.min()) / 30 * 1.01


def test_weights_grouped_along_output_channels():
    w = torch.randn(128, 16, generator=torch.Generator().manual_seed(1))
    w[:64] *= 100  # the first 64 output channels form their own groups
    q = quantize(w, dim=0)
    assert q.packed.shape == (64, 16) and q.scale.shape == (2, 16) and q.packed.dtype == torch.uint8
    err = (dequantize(q) - w).abs()
    small = w[64:]
    step = (small.amax(0) - small.amin(0)) / 15  # per column: the small rows' own groups
    assert (err[64:] <= step / 2 + 1e-3).all()  # not polluted by the large rows: groups run along dim 0
    assert q.nbytes == 64 * 16 + 2 * 2 * 16 * 2  # 0.5 B/value + fp16 scale, min per 64


def test_kv_grouped_along_hidden_dim():
    kv = torch.randn(2, 4, 2, 128)
    q = quantize(kv, dim=-1)
    assert q.packed.shape == (2, 4, 2, 64) and q.scale.shape == (2, 4, 2, 128 // GROUP_SIZE)


def test_constant_group_is_exact():
    x = torch.full((64, 3), 1.25)
    assert torch.equal(dequantize(quantize(x, dim=0)), x)


def _q4_1_reference(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """llama.cpp's dequantize_row_q4_1, written out."""
    b = raw.reshape(rows, cols // 32, 20)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (q * d + m).reshape(rows, cols)


def test_q4_1_import_is_bit_exact():
    rng = np.random.default_rng(0)
    rows, cols = 6, 96
    raw = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    raw[..., 0:2] = np.float16(rng.uniform(0.01, 0.1, (rows, cols // 32))).view(np.uint8).reshape(rows, cols // 32, 2)
    raw[..., 2:4] = np.float16(rng.uniform(-1, 0, (rows, cols // 32))).view(np.uint8).reshape(rows, cols // 32, 2)
    raw[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    raw = raw.reshape(rows, -1)
    t = q4_1_blocks_to_int4(raw, rows, cols)
    assert t.group_size == 32 and t.dim == 1 and t.packed.shape == (rows, cols // 2)
    got = dequantize(t).numpy()
    assert np.array_equal(got, _q4_1_reference(raw, rows, cols))


def test_q4_1_import_of_embedded_model_matches_gguf_dequant():
    pytest.importorskip("gguf")
    from localgen.models.gguf_source import GGUFStore
    from localgen.models.sources import embedded_gguf_path
    from localgen.quant.gguf_import import gguf_int4

    try:
        store = GGUFStore(embedded_gguf_path())
    except FileNotFoundError:
        pytest.skip("embedded model not installed")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        q = gguf_int4(store, name)
        assert q is not None and torch.equal(dequantize(q), store.get(name))  # permutation undone too


@pytest.mark.parametrize("dim,group", [(0, 64), (1, 32)])
def test_cat_rows_dequantizes_to_the_concatenation(dim, group):
    """Fusing q/k/v (or gate/up) of a 4-bit layer keeps every code: the stacked matrix
    dequantizes to the stacked dequantized matrices, bit for bit."""
    from localgen.quant.int4 import cat_rows

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    mats = [quantize(torch.randn(n, 96, generator=g), group, dim=dim) for n in (128, 64, 64)]
    fused = cat_rows(mats)
    assert fused.shape == (256, 96)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(m) for m in mats]))


def test_cat_rows_refuses_groups_across_the_seam():
    from localgen.quant.int4 import cat_rows

    a, b = quantize(torch.randn(96, 64), 64, dim=0), quantize(torch.randn(64, 64), 64, dim=0)
    assert cat_rows([a, b]) is None  # 96 rows: the second group would hold rows of both
    assert cat_rows([quantize(torch.randn(64, 64), 64, dim=0), quantize(torch.randn(64, 64), 32, dim=1)]) is None


@pytest.mark.parametrize("rows", [128, 100])  # 100: the last group padded
def test_quantize_columns_in_blocks_equals_quantizing_whole(monkeypatch, rows):
    """The offloaded runtime quantizes a matrix a block of columns at a time (groups run down
    the columns, so blocks are independent): codes, scales and mins equal ``quantize``'s of the
    whole matrix, bit for bit, from fp16 as stored."""
    from localgen.runtime.offload import weights

    g = torch.Generator().manual_seed(3)
    w = torch.randn(rows, 75, generator=g).half()
    monkeypatch.setattr(weights, "QUANT_CHUNK", rows * 16)  # 16 columns a block: 5 blocks
    got = weights.quantize_columns(w, 64, torch.device("cpu"))
    want = quantize(w.float(), 64, dim=0)
    for f in ("packed", "scale", "min"):
        assert torch.equal(getattr(got, f), getattr(want, f))
    assert (got.group_size, got.dim, got.shape) == (want.group_size, want.dim, want.shape)
