"""GGUF Q4_1 tensors -> ``Int4Tensor`` without a float round trip.

llama.cpp's Q4_1 block: 32 consecutive elements of a row (the input-channel axis, GGUF ``ne0``),
stored as fp16 ``d`` (scale), fp16 ``m`` (min) and 16 bytes of codes, byte ``j`` holding element
``j`` in its low nibble and element ``j + 16`` in its high nibble; value = ``d * q + m``. That is
exactly the group-wise asymmetric format of ``localgen.quant.int4`` with ``group_size = 32`` grouped
along the input channels (dim 1 of an ``[N, K]`` matrix): the codes, scales and mins are copied bit
for bit (only the nibbles are re-paired, integer ops), so the import adds no error.

Regrouping into FlexGen's g=64 along the *output* channels is not possible without a float round
trip: 64 rows of one column carry 64 different (d, m) pairs, which one 4-bit affine map cannot
express, so that would be a second quantization (dequantize, then ``int4.quantize``) with its own
error. The runtime therefore keeps imported Q4_1 weights in their native grouping.

The Q/K row permutation of llama.cpp's converter (see ``gguf_blocks.unpermute_qk``) is a row
permutation; rows are whole groups here, so it is applied to the packed rows and their scale/min.
"""

from __future__ import annotations

import numpy as np
import torch

from localgen.quant.int4 import Int4Tensor

Q4_1_BLOCK = 32
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes


def q4_1_blocks_to_int4(raw: np.ndarray | torch.Tensor, rows: int, cols: int) -> Int4Tensor:
    """Raw Q4_1 bytes ``[rows, cols // 32 * 20]`` (uint8) -> ``Int4Tensor`` of shape
    ``[rows, cols]`` grouped along dim 1 with g=32. Raises ValueError on a shape mismatch."""
    if cols % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows hold whole 32-element blocks; got {cols} columns")
    nb = cols // Q4_1_BLOCK
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).reshape(rows, nb, Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, nb)
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(rows, nb)
    qs = b[..., 4:].to(torch.int32)  # [rows, nb, 16]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # element j (low) then j + 16 (high): [rows, nb, 32]
    codes = codes.reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return Int4Tensor(packed.contiguous(), d.contiguous(), m.contiguous(), Q4_1_BLOCK, 1, (rows, cols))


def permute_rows(t: Int4Tensor, perm: torch.Tensor) -> Int4Tensor:
    """Reorder rows of an ``Int4Tensor`` grouped along dim 1 (rows are independent there)."""
    if t.dim != 1:
        raise ValueError("only tensors grouped along dim 1 have independent rows")
    return Int4Tensor(t.packed[perm].contiguous(), t.scale[perm].contiguous(), t.min[perm].contiguous(),
                      t.group_size, 1, t.shape)


def gguf_int4(store, name: str) -> Int4Tensor | None:
    """The HF-named tensor ``name`` of a ``GGUFStore`` as an ``Int4Tensor`` when it is stored as
    Q4_1 (2-D), with llama.cpp's Q/K permutation undone; None for any other storage type."""
    from gguf import GGMLQuantizationType as Q

    from localgen.quant.gguf_blocks import unpermute_qk

    t = store.tensor(name)
    if t.tensor_type != Q.Q4_1 or len(store.shape(name)) != 2:
        return None
    rows, cols = store.shape(name)
    q = q4_1_blocks_to_int4(t.data, rows, cols)
    heads = store.qk_heads(name)
    if heads is not None:
        q = permute_rows(q, unpermute_qk(torch.arange(rows)[:, None], heads)[:, 0])
    return q
