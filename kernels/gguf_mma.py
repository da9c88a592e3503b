"""Decode matmul for 2 <= M <= 64 over GGUF Q4_K and Q6_K blocks in the file's layout, on tensor
cores: each weight of a program's rows is dequantized once, in registers, and meets every
activation row in ``tl.dot``.

``y[m, n] = x[m, k] · W[n, k]ᵀ``, W the raw bytes ``[N, row_bytes]`` of ``block_q4_K`` /
``block_q6_K`` rows (ggml-common.h; value order as ``gguf.quants`` reads it). Weight
``w = a·q - b`` with the code ``q`` and, per group, ``a`` and ``b`` (Q4_K: 32-weight groups,
``a = d·scale``, ``b = dmin·min``; Q6_K: 16-weight groups, ``a = d·scale``, ``b = 32·a``).

A program owns ``BLOCK_N`` output rows and a slice of K tiles (256 weights, one block a row).
It takes a tile in parts of ``KC`` columns (64, 128 or 256, :func:`k_chunk`: as much as the
registers hold). Per part it loads each row's codes as 32-bit (Q4_K) or 16-bit (Q6_K, whose
210-byte blocks are only 2-byte aligned) words, the words the last axis as they lie in memory,
and splits every word into its codes by a broadcast shift, so the codes come out in a fixed
order of K that is not the weights' order (``_q4k_order``, ``_q6k_order``); the ``[KC, M_PAD]``
activations are gathered in that same order, which costs nothing since they are read through an
index anyway. The group's ``a`` and ``b`` are computed once per group and row and broadcast over
its weights. A code becomes a float without an int-to-float conversion: its bits go under the
mantissa of 1.0 (``f = 1 + q/2**B``) and ``w = (a·2**B)·f - (a·2**B + b)`` is one multiply-add.
The ``[BLOCK_N, KC]`` weights, in the activations' dtype, are the left operand of ``tl.dot`` and
the activations the right one, so that the tensor core's wide dimension is the weight rows, not
the few activation rows (``M_PAD`` 16, 32 or 64: the smallest that holds M).

K is split across programs when the rows alone do not fill the GPU (``gguf_gemv.split_output``);
split programs add their float32 partial sums atomically. ``DecodeConfig(kernel="mma")`` selects
this kernel in ``gguf_gemm.matmul`` (``block_n``, ``num_warps``, ``split_k`` /
``programs_per_sm``, ``num_stages``: the software pipeline's depth over the K loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gguf_gemv
from .gguf_tiles import f16_at, k4_scale_min

TYPES = gguf_gemv.MMA_TYPES
MIN_M, MAX_M = 2, gguf_gemv.MMA_MAX_M
TILE_K = 256

# activation dtype -> the dot's operand dtype
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mantissa_weights(bits, a, b, S, ONE_APART: tl.constexpr):
    """float32 ``a·q - b`` where ``bits`` is 1.0's exponent with the code ``q`` at bit ``S`` of
    the mantissa and nothing else (``S`` + the code's width <= 23): ``f = 1 + q·2**(S-23)``
    exactly, so ``a·q = A·(f - 1)`` with ``A = a·2**(23-S)``. ONE_APART: ``(f - 1)·A - b``, an
    exact subtraction and one rounding; else ``f·A - (A + b)``, one multiply-add whose rounding
    of ``A + b`` is near ``2**-24·A``: for ``S >= 17`` (``A <= 64a``) far below a bf16
    weight's."""
    f = bits.to(tl.float32, bitcast=True)
    scaled = a * ((150 - S) << 23).to(tl.float32, bitcast=True)  # 2**(23 - S)
    if ONE_APART:
        w = (f - 1.0) * scaled - b
    else:
        w = f * scaled - (scaled + b)
    return w


@triton.jit
def _q4k_order(J: tl.constexpr, KC: tl.constexpr):
    """Weight index within a tile of each of :func:`_q4k_part`'s ``KC`` columns for step ``J``:
    column ``64c' + 32h + 8b + i`` is weight ``64c + 32h + 4i + b`` of chunk
    ``c = J·KC/64 + c'``."""
    kk = tl.arange(0, KC)
    return 64 * (J * (KC // 64) + kk // 64) + 32 * ((kk // 32) % 2) + 4 * (kk % 8) + (kk // 8) % 4


@triton.jit
def _q4k_part(rows32, kt, J: tl.constexpr, KC: tl.constexpr):
    """float32 ``[BLOCK_N, KC]`` weights, step ``J`` of tile ``kt`` (``rows32``: ``[BLOCK_N]``
    int32 pointers to each row's first block), columns in :func:`_q4k_order`. A block is 36
    words: d and dmin, 12 scale bytes, then 32 words of nibbles; byte ``b`` of nibble word
    ``8c + i`` holds weight ``64c + 4i + b`` (low nibble, group ``2c``) and ``64c + 32 + 4i + b``
    (high, ``2c + 1``)."""
    blk = rows32 + kt * 36
    # [BN, chunk c, nibble h, byte b, word i]: the words last, as they lie in memory
    c = J * (KC // 64) + tl.arange(0, KC // 64)[None, :, None, None, None]
    h = tl.arange(0, 2)[None, None, :, None, None]
    b = tl.arange(0, 4)[None, None, None, :, None]
    i = tl.arange(0, 8)[None, None, None, None, :]
    blk5 = blk[:, None, None, None, None]
    words = tl.load(blk5 + 4 + 8 * c + i)  # [BN, KC/64, 1, 1, 8]
    # the nibble at bit P = 4h + 8b, masked where it lies; those at bits 20..31 from the word
    # shifted right by 12, so that every code sits below bit 23. 1.0's exponent is ORed into
    # the word once and kept by each code's mask: one operation a code, one constant
    pos = 4 * h + 8 * b
    high = pos >= 20
    at = tl.where(high, pos - 12, pos)
    one = 0x3F800000
    bits = tl.where(high, (words >> 12) | one, words | one) & ((15 << at) | one)
    blk8 = blk5.to(tl.pointer_type(tl.uint8))
    sc, mn = k4_scale_min(blk8, 2 * c + h)  # per group 2c + h, [BN, KC/64, 2, 1, 1]
    w = _mantissa_weights(bits, f16_at(blk8) * sc, f16_at(blk8 + 2) * mn, at, True)
    return tl.reshape(w, (w.shape[0], KC))


@triton.jit
def _q6k_order(J: tl.constexpr, KC: tl.constexpr):
    """Weight index within a tile of each of :func:`_q6k_part`'s ``KC`` columns for step ``J``:
    column ``64p' + 16t + 8e + vl`` is weight ``128hf + 32t + 16vh + 2vl + e`` of part
    ``p = J·KC/64 + p' = 2hf + vh``."""
    kk = tl.arange(0, KC)
    p = J * (KC // 64) + kk // 64
    return 128 * (p // 2) + 32 * ((kk // 16) % 4) + 16 * (p % 2) + 2 * (kk % 8) + (kk // 8) % 2


@triton.jit
def _q6k_part(rows16, kt, J: tl.constexpr, KC: tl.constexpr):
    """float32 ``[BLOCK_N, KC]`` weights, step ``J`` of tile ``kt`` (``rows16``: ``[BLOCK_N]``
    int16 pointers), columns in :func:`_q6k_order`. A block is 105 16-bit words: ql (64 words),
    qh (32), 16 int8 scales, d. With ``l = 2v + e`` (``v = 8vh + vl``) and quarter ``t``, weight
    ``128hf + 32t + l`` takes its low 4 bits from ql byte ``64hf + 32(t % 2) + l``, nibble
    ``t // 2``, its high 2 bits from qh byte ``128 + 32hf + l`` at bit ``2t``, and scale
    ``8hf + 2t + vh``."""
    blk = rows16 + kt * 105
    # [BN, part p, nibble u, ql word tt, byte e, word vl]: quarter t = 2u + tt, so the columns
    # 64p' + 16t + 8e + vl; the words last, as they lie in memory, each ql word loaded once
    p = J * (KC // 64) + tl.arange(0, KC // 64)[None, :, None, None, None, None]
    u = tl.arange(0, 2)[None, None, :, None, None, None]
    tt = tl.arange(0, 2)[None, None, None, :, None, None]
    e = tl.arange(0, 2)[None, None, None, None, :, None]
    vl = tl.arange(0, 8)[None, None, None, None, None, :]
    hf = p // 2
    t = 2 * u + tt
    v = 8 * (p % 2) + vl
    blk6 = blk[:, None, None, None, None, None]
    ql = tl.load(blk6 + 32 * hf + 16 * tt + v).to(tl.int32)  # [BN, KC/64, 1, 2, 1, 8]
    qh = tl.load(blk6 + 64 + 16 * hf + v).to(tl.int32)  # [BN, KC/64, 1, 1, 1, 8]
    # the 6-bit code assembled where its low 4 bits lie in ql, at bit L = 4u + 8e: its high 2
    # bits, at bit 2t + 8e of qh, move by 4 - 2tt to bit L + 4 (one shift per qh word and tt).
    # 1.0's exponent is ORed into ql once and kept by each code's mask; the masks drop the
    # words' other bits and their sign extension
    low = 4 * u + 8 * e
    bits = (((ql | 0x3F800000) & ((15 << low) | 0x3F800000))
            | ((qh << (4 - 2 * tt)) & (3 << (low + 4))))
    blk8 = blk6.to(tl.pointer_type(tl.uint8))
    scale = tl.load(blk8 + 192 + 8 * hf + 2 * t + p % 2).to(tl.int8, bitcast=True)
    a = f16_at(blk8 + 208) * scale.to(tl.float32)  # [BN, KC/64, 2, 2, 1, 1]
    w = _mantissa_weights(bits, a, 32 * a, low, True)
    return tl.reshape(w, (w.shape[0], KC))


@triton.jit(do_not_specialize=["M", "N", "num_tiles", "tiles_per_split"])
def _gguf_mma(x_ptr, w_ptr, y_ptr, M, N, num_tiles, tiles_per_split, stride_xm, row_units,
              stride_ym, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr,
              KC: tl.constexpr, ATOMIC: tl.constexpr, DOT_DTYPE: tl.constexpr,
              IEEE: tl.constexpr):
    """Program (n, s): ``y[:, n*BLOCK_N ..]`` over K tiles ``s*tiles_per_split ..``, as
    ``acc [BLOCK_N, M_PAD] += W_part · x_partᵀ`` for each ``KC`` columns of a tile (64, 128 or
    256: how much of the tile is dequantized, in registers, at once). ``row_units``: the row
    stride in 16 bytes (Q4_K, whose rows are whole 144-byte blocks: so the compiler knows each
    block's words 16-byte aligned and loads them four at a time) or 2 bytes (Q6_K). IEEE
    (float32 activations): the dot in IEEE float32, no TF32 rounding."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    row = tl.minimum(offs_n, N - 1).to(tl.int64) * row_units  # rows past N read row N - 1
    if QTYPE == 12:
        rows = w_ptr.to(tl.pointer_type(tl.int32)) + row * 4
    else:
        rows = w_ptr.to(tl.pointer_type(tl.int16)) + row
    x_rows = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    m_live = (offs_m < M)[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    kt0 = pid_k * tiles_per_split
    for kt in range(kt0, tl.minimum(kt0 + tiles_per_split, num_tiles)):
        for j in tl.static_range(256 // KC):
            if QTYPE == 12:
                w = _q4k_part(rows, kt, j, KC)
                order = _q4k_order(j, KC)
            else:
                w = _q6k_part(rows, kt, j, KC)
                order = _q6k_order(j, KC)
            xt = tl.load(x_rows + kt * 256 + order[:, None], mask=m_live, other=0.0)
            if IEEE:
                acc = tl.dot(w, xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc)
    y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    mask = m_live & (offs_n < N)[:, None]
    if not ATOMIC:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y, acc, mask=mask)


def k_chunk(qtype: int, block_n: int, num_warps: int, m_pad: int) -> int:
    """Columns of a tile dequantized at once (256, 128 or 64): the most whose weights take at
    most ``base`` values a thread (Q4_K 128; Q6_K 64, whose 16-bit words and two-part codes
    take more registers) and, with the ``[block_n, m_pad]`` accumulator, at most
    ``1.25·base``: past these, sm_90 builds of the kernel spill registers."""
    base, lanes = (128 if int(qtype) == gguf_gemv.Q4_K else 64), 32 * num_warps
    for kc in (256, 128):
        tile, acc = block_n * kc // lanes, block_n * m_pad // lanes
        if tile <= base and tile + acc <= base + base // 4:
            return kc
    return 64


def m_pad(m: int) -> int:
    """The dot's activation rows for ``m``: 16, 32 or 64 (the tensor core's smallest is 16)."""
    return max(16, triton.next_power_of_2(m))


def serves(raw: torch.Tensor, qtype: int, m: int) -> bool:
    """Whether this kernel takes the call: Q4_K or Q6_K, ``MIN_M <= m <= MAX_M``, raw data
    aligned to the kernel's words (4 bytes for Q4_K, 2 for Q6_K) and rows a whole number of
    its row units apart (16 bytes for Q4_K, 2 for Q6_K)."""
    q4k = int(qtype) == gguf_gemv.Q4_K
    return (int(qtype) in TYPES and MIN_M <= m <= MAX_M and raw.data_ptr() % (4 if q4k else 2) == 0
            and raw.stride(0) % (16 if q4k else 2) == 0)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
           cfg: gguf_gemv.DecodeConfig) -> torch.Tensor:
    """``x [M, k] · Wᵀ`` -> ``[M, N]`` in x's dtype (float32/bf16/fp16), W the Q4_K or Q6_K
    blocks ``raw`` (uint8 ``[N, row_bytes]``, contiguous rows; the caller, ``gguf_gemm.matmul``,
    checks the shapes and :func:`serves`). ``cfg``: ``block_n`` (16, 32, 64, 128), ``num_warps``,
    ``num_stages`` (0: Triton's default), ``split_k`` / ``programs_per_sm``. The weights are
    ``gguf.quants.dequantize``'s within float32 rounding, then rounded to the activations' dtype.
    Raises ValueError for another type, M or activation dtype."""
    qtype, (m, n) = int(qtype), (x.shape[0], raw.shape[0])
    if qtype not in TYPES or not MIN_M <= m <= MAX_M:
        raise ValueError(f"gguf_mma serves Q4_K/Q6_K (12, 14) at {MIN_M} <= M <= {MAX_M}, "
                         f"got type {qtype}, M={m}")
    if x.dtype not in _DOT_DTYPES:
        raise ValueError(f"gguf_mma takes float32/bf16/fp16 activations, got {x.dtype}")
    x = x.contiguous()
    tiles, n_programs = k // TILE_K, triton.cdiv(n, cfg.block_n)
    splits, per_split, y = gguf_gemv.split_output(cfg, x, n, n_programs, tiles)
    unit = 16 if qtype == gguf_gemv.Q4_K else 2
    launch = dict(num_warps=cfg.num_warps)
    if cfg.num_stages:
        launch["num_stages"] = cfg.num_stages
    _gguf_mma[(n_programs, splits)](
        x, raw, y, m, n, tiles, per_split, x.stride(0), raw.stride(0) // unit, y.stride(0),
        QTYPE=qtype, BLOCK_N=cfg.block_n, M_PAD=m_pad(m),
        KC=k_chunk(qtype, cfg.block_n, cfg.num_warps, m_pad(m)), ATOMIC=splits > 1,
        DOT_DTYPE=_DOT_DTYPES[x.dtype], IEEE=x.dtype == torch.float32, **launch)
    return y.to(x.dtype)
