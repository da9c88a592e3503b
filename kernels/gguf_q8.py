"""Decode (M <= 16) over GGUF Q4_K and Q6_K blocks against 8-bit activations (``gguf_gemv``'s
``codes="q8"``; llama.cpp's MMVQ idea): the activations are first rounded to int8 per 32-group
(:func:`quantize`, one small kernel for all rows), and four codes of a 32-bit word meet four of
them in one ``dp4a``. M = 1: ``_q4k_gemv_q8``, ``_q6k_gemv_q8``; 2..16 rows: ``_q4k_rows_q8``,
``_q6k_rows_q8``, which load each weight word once for all the rows and sum a group's products
in integers, so its scales apply once per (activation row, weight row, group). Not
bit-compatible with the float-code kernels: the error is that rounding's, at most
``Σ_j |w_j|·d_g(j)/2`` for a row (``d_g``: the step of the 32-group holding weight ``j``).

Block layouts: ggml-common.h (``block_q4_K``, ``block_q6_K``), value order as ``gguf.quants``
reads them. Q4_K's weight is ``d·sc·q - dmin·m``: the code term goes through ``dp4a`` and the min
term uses the exact float ``Σ x`` of the group. Q6_K's is ``d·sc·(q - 32)``: at M = 1 the
codes' ``q`` meet the int8 activations as they are and ``32·Σ q_x`` (also one ``dp4a``, against
0x20 bytes) comes off in integers; the multi-row kernels make ``q - 32`` signed bytes once for
all the rows. Either way the product is ``d·sc·d_x·Σ (q - 32)·q_x`` as llama.cpp computes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .gguf_tiles import (GEMV_ARGS, f16_at, finish, finish_at, k4_scale_min, slots,
                         small_int_float, split_buffers)
from .triton_common import interpreting

Q4_K, Q6_K = 12, 14  # GGMLQuantizationType values
TYPES = (Q4_K, Q6_K)
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}  # ggml-common.h's block_q4_K, block_q6_K
TILE_K = 256


class Q8Activations(NamedTuple):
    """``M`` activation rows rounded per 32-group, stored word-major for ``P = m_pad(M)``
    rows (rows M.. zero), so that a kernel's load of one word of every row is contiguous:
    ``xq`` int8 ``[k/4, P, 4]`` (four activations of a row a 32-bit word), ``xd`` float32
    ``[k/32, P]`` (the group's step ``max|x|/127``), ``xs`` float32 ``[k/32, P]`` (the group's
    exact ``Σ x``). For M = 1 these are the row itself: ``[k]``, ``[k/32]``, ``[k/32]``."""

    xq: torch.Tensor
    xd: torch.Tensor
    xs: torch.Tensor


# M (the rows) follows the batch: specialized, M = 1 and multiples of 16 would each compile
# their own kernel, the first time a step reaches them (an eager prefill past a cached prefix).
QUANTIZE_PER_BATCH_ARGS = ["M"]


@triton.jit(do_not_specialize=QUANTIZE_PER_BATCH_ARGS)
def _quantize_x8(x_ptr, xq_ptr, xd_ptr, xs_ptr, M, stride_xm, M_PAD: tl.constexpr):
    """Program (t, m) of ``M_PAD`` rows: the 256 activations of tile t of row m as int8 per
    32-group, ``q = round(x / d)`` with ``d = max|x| / 127`` (llama.cpp's ``block_q8_1``
    rule, half away from zero), the group's ``d`` and its exact float sum ``Σ x``, stored
    word-major (:class:`Q8Activations`); rows from ``M`` on are zeros."""
    t = tl.program_id(0)
    m = tl.program_id(1)
    offs = t * 256 + tl.arange(0, 8)[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + tl.minimum(m, M - 1).to(tl.int64) * stride_xm + offs).to(tl.float32)
    x = tl.where(m < M, x, 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)  # zero groups: 0
    v = x * inv[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(xq_ptr + ((offs // 4) * M_PAD + m) * 4 + offs % 4, q.to(tl.int8))
    groups = (t * 8 + tl.arange(0, 8)) * M_PAD + m
    tl.store(xd_ptr + groups, amax / 127.0)
    tl.store(xs_ptr + groups, tl.sum(x, axis=1))


@triton.jit
def _dp4a(a, b, ASM: tl.constexpr):
    """``Σ_k a_k·b_k`` over the four signed bytes of int32 ``a`` and ``b`` (same shape)."""
    return _dp4a_add(a, b, tl.zeros_like(a), ASM)


@triton.jit
def _dp4a_add(a, b, c, ASM: tl.constexpr):
    """``c + Σ_k a_k·b_k`` over the four signed bytes of int32 ``a`` and ``b``, broadcast to
    ``c``'s shape: PTX ``dp4a`` (ASM), else the same sum by shifts (the interpreter)."""
    a = tl.broadcast_to(a, c.shape)
    b = tl.broadcast_to(b, c.shape)
    if ASM:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                        [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c + ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
        out += ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24)
    return out


@triton.jit(do_not_specialize=GEMV_ARGS + ["row_16b"])
def _q4k_gemv_q8(xq_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, num_tiles,
                 tiles_per_split, splits, row_16b, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                 SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Q4_K, program (n, s) over rows ``n*BLOCK_N ..`` and K tiles ``s*tiles_per_split ..``
    (``gguf_gemv._q45k_gemv``'s word grid: byte ``b`` of word (c, i) holds weight
    ``64c + 4i + b`` in its low nibble, ``64c + 32 + 4i + b`` in its high one). A word's four
    low (high) nibbles meet the four int8 activations of the same weights, which are
    contiguous, in one ``dp4a``; per group ``acc += d·sc·d_x·Σ q·q_x`` and ``dmin·m·Σ x``
    comes off. ``row_16b``: the row stride in 16-byte units (rows are whole 144-byte blocks).
    ``xq``, ``xd``, ``xs``: :func:`quantize`'s rounding of ``x``."""
    offs_n, kt0, end, j2 = slots(tl.program_id(0), tl.program_id(1), num_tiles,
                                 tiles_per_split, BLOCK_N, KB)
    rows = (w_ptr.to(tl.pointer_type(tl.int32))
            + tl.minimum(offs_n, N - 1).to(tl.int64) * (row_16b * 4))[:, None, None]
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32))
    j3 = j2[:, :, None]
    c3 = j3 % 4
    i3 = tl.arange(0, 8)[None, None, :]
    acc = tl.zeros([BLOCK_N, 4 * KB, 8], tl.float32)
    acc_m = tl.zeros([BLOCK_N, 4 * KB, 1], tl.float32)
    for kt in range(kt0, end, KB):
        kb3 = kt + j3 // 4
        live = kb3 < end
        blk = rows + tl.minimum(kb3, end - 1) * 36
        words = tl.load(blk + 4 + 8 * c3 + i3)
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        d = f16_at(blk8)
        dmin = f16_at(blk8 + 2)
        for h in tl.static_range(2):
            g3 = 2 * c3 + h
            xw = tl.load(xq32 + kb3 * 64 + 8 * g3 + i3, mask=live, other=0)
            xd = tl.load(xd_ptr + kb3 * 8 + g3, mask=live, other=0.0)
            xsum = tl.load(xs_ptr + kb3 * 8 + g3, mask=live, other=0.0)
            p = _dp4a((words >> (4 * h)) & 0x0F0F0F0F, tl.broadcast_to(xw, words.shape), ASM)
            sc, mn = k4_scale_min(blk8, g3)
            acc += small_int_float(p) * (d * sc * xd)
            acc_m += dmin * mn * xsum
    out = tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(tl.sum(acc_m, axis=2), axis=1)
    finish(out, y_ptr, part_ptr, cnt_ptr, offs_n, N, splits, SPLIT)


@triton.jit
def _word16x2(ptr):
    """int32 of the two 16-bit words at ``ptr`` and ``ptr + 1`` (Q6_K blocks are 210 bytes, only
    2-byte aligned, so a 32-bit word is read as two halves)."""
    lo = tl.load(ptr).to(tl.int32) & 0xFFFF
    return lo | (tl.load(ptr + 1).to(tl.int32) << 16)


@triton.jit(do_not_specialize=GEMV_ARGS + ["stride_wn"])
def _q6k_gemv_q8(xq_ptr, xd_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, num_tiles,
                 tiles_per_split, splits, stride_wn, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                 SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Q6_K as :func:`_q4k_gemv_q8` (``stride_wn`` in 16-bit words). Weight
    ``128hf + 32t + l`` of a block (half ``hf``, quarter ``t``, ``l`` 0..31) takes its low 4 bits
    from ql byte ``64hf + l`` (t = 0, 2) or ``64hf + 32 + l`` (t = 1, 3), nibble ``t // 2``, its
    high 2 bits from qh byte ``128 + 32hf + l`` at bit ``2t``, and scale ``8hf + 2t + l // 16``.
    Slot ``j`` is part ``p = j % 4`` of its block: ``hf = p // 2`` and ``l = 16(p % 2) + 4i + e``
    (word ``i`` 0..3, byte ``e``), so a slot's 16 weights of a quarter share one scale, and
    three words (ql, ql + 32, qh) give the codes of all four quarters."""
    offs_n, kt0, end, j2 = slots(tl.program_id(0), tl.program_id(1), num_tiles,
                                 tiles_per_split, BLOCK_N, KB)
    rows = (w_ptr.to(tl.pointer_type(tl.int16))
            + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn)[:, None, None]
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32))
    j3 = j2[:, :, None]
    p3 = j3 % 4
    hf3 = p3 // 2
    l3 = 16 * (p3 % 2) + 4 * tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BLOCK_N, 4 * KB, 4], tl.float32)
    for kt in range(kt0, end, KB):
        kb3 = kt + j3 // 4
        live = kb3 < end
        blk = rows + tl.minimum(kb3, end - 1) * 105
        ql = blk + 32 * hf3 + l3 // 2  # 16-bit word of ql byte 64hf + l
        ql_a = _word16x2(ql)
        ql_b = _word16x2(ql + 16)
        qh = _word16x2(ql + 64 - 16 * hf3)
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        d = f16_at(blk8 + 208)
        for t in tl.static_range(4):
            src = ql_a if t % 2 == 0 else ql_b
            q = ((src >> (4 * (t // 2))) & 0x0F0F0F0F) | (((qh >> (2 * t)) & 0x03030303) << 4)
            xw = tl.load(xq32 + kb3 * 64 + 32 * hf3 + 8 * t + l3 // 4, mask=live, other=0)
            xd = tl.load(xd_ptr + kb3 * 8 + 4 * hf3 + t, mask=live, other=0.0)
            off = _dp4a(tl.full(xw.shape, 0x20202020, tl.int32), xw, ASM)
            p = _dp4a(q, tl.broadcast_to(xw, q.shape), ASM) - off
            scale = tl.load(blk8 + 192 + 8 * hf3 + 2 * t + p3 % 2).to(tl.int8, bitcast=True)
            acc += small_int_float(p) * (d * scale.to(tl.float32) * xd)
    finish(tl.sum(tl.sum(acc, axis=2), axis=1), y_ptr, part_ptr, cnt_ptr, offs_n, N, splits,
           SPLIT)


# ---- 2 <= M <= 16: every weight word loaded once meets each activation row ----

@triton.jit
def _row_grid(w_ptr, unit: tl.constexpr, N, row_units, num_tiles, tiles_per_split,
              BLOCK_N: tl.constexpr, KB: tl.constexpr, M_PAD: tl.constexpr):
    """The ``[M_PAD, BLOCK_N, 4·KB, groups]`` grid of the multi-row kernels (activation row,
    weight row, :func:`gguf_tiles.slots`'s slot, the group within a slot): the output rows,
    the K loop's bounds, each row's first block as ``unit``-typed pointers
    ``[1, BLOCK_N, 1, 1]`` (``row_units`` of them a row; rows past N read row N - 1), the
    activation row index ``[M_PAD, 1, 1, 1]`` and the slot index ``[1, 1, 4·KB, 1]``."""
    offs_n, kt0, end, j2 = slots(tl.program_id(0), tl.program_id(1), num_tiles,
                                 tiles_per_split, BLOCK_N, KB)
    rows = (w_ptr.to(tl.pointer_type(unit))
            + tl.minimum(offs_n, N - 1).to(tl.int64) * row_units)[None, :, None, None]
    m4 = tl.arange(0, M_PAD)[:, None, None, None]
    return offs_n, kt0, end, rows, m4, j2[None, :, :, None]


@triton.jit
def _less_32(q):
    """Each byte of int32 ``q`` (6-bit codes 0..63) less 32, as a signed byte, with no borrow
    between bytes: ``q ^ 0x20`` is ``q - 32`` where q's bit 5 is set; where it is clear,
    ``q ^ 0x20 = q + 32`` and bits 6 and 7 set make it ``q + 32 - 64``."""
    v = q ^ 0x20202020
    neg = v & 0x20202020
    return v | (neg << 1) | (neg << 2)


@triton.jit
def _finish_rows(acc, y_ptr, part_ptr, cnt_ptr, M, offs_n, N, stride_ym, splits,
                 SPLIT: tl.constexpr):
    """``acc`` ``[M_PAD, BLOCK_N]`` into ``y`` ``[M, N]`` (row stride ``stride_ym``) by
    :func:`gguf_tiles.finish_at` (partials ``[splits, M·N]``)."""
    m2 = tl.arange(0, acc.shape[0])[:, None].to(tl.int64)
    n2 = offs_n[None, :]
    finish_at(acc, y_ptr, m2 * stride_ym + n2, part_ptr, m2 * N + n2, M * N,
              (m2 < M) & (n2 < N), cnt_ptr, splits, SPLIT)


@triton.jit(do_not_specialize=GEMV_ARGS + ["row_16b", "M"])
def _q4k_rows_q8(xq_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, num_tiles,
                 tiles_per_split, splits, row_16b, stride_ym, BLOCK_N: tl.constexpr,
                 KB: tl.constexpr, M_PAD: tl.constexpr, SPLIT: tl.constexpr,
                 ASM: tl.constexpr):
    """Q4_K at ``M <= M_PAD`` activation rows, program (n, s) as :func:`_q4k_gemv_q8`'s (its
    word grid), with the activation row as a leading axis: a weight word is loaded and masked
    once, meets the int8 activations of every row in ``dp4a``, and the group's eight words are
    summed in integers (the ``dp4a`` accumulator), so ``d·sc·d_x`` and ``dmin·m·Σ x`` apply
    once per (activation row, weight row, group); a step's groups are then summed into the
    ``[M_PAD, BLOCK_N]`` accumulator, which keeps the loop in one register layout where the
    ``[BLOCK_N, 4·KB, 2]`` scale tile is smaller than the program's threads. ``x``: word-major
    for ``M_PAD`` rows (:class:`Q8Activations`), so one word of every row is one contiguous
    load."""
    offs_n, kt0, end, rows, m4, j4 = _row_grid(w_ptr, tl.int32, N, row_16b * 4, num_tiles,
                                               tiles_per_split, BLOCK_N, KB, M_PAD)
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32)) + m4
    c4 = j4 % 4
    h4 = tl.arange(0, 2)[None, None, None, :]  # the nibble: group 2c + h
    g4 = 2 * c4 + h4
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for kt in range(kt0, end, KB):
        kb4 = kt + j4 // 4
        live = kb4 < end
        blk = rows + tl.minimum(kb4, end - 1) * 36
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        x_g = xq32 + (kb4 * 64 + 8 * g4) * M_PAD  # word 0 of each group's activations
        p = tl.zeros([M_PAD, BLOCK_N, 4 * KB, 2], tl.int32)
        for i in tl.static_range(8):
            nib = (tl.load(blk + 4 + 8 * c4 + i) >> (4 * h4)) & 0x0F0F0F0F
            p = _dp4a_add(nib, tl.load(x_g + i * M_PAD, mask=live, other=0), p, ASM)
        xd = tl.load(xd_ptr + m4 + (kb4 * 8 + g4) * M_PAD, mask=live, other=0.0)
        xsum = tl.load(xs_ptr + m4 + (kb4 * 8 + g4) * M_PAD, mask=live, other=0.0)
        sc, mn = k4_scale_min(blk8, g4)
        part = small_int_float(p) * ((f16_at(blk8) * sc) * xd) - (f16_at(blk8 + 2) * mn) * xsum
        acc += tl.sum(tl.sum(part, axis=3), axis=2)
    _finish_rows(acc, y_ptr, part_ptr, cnt_ptr, M, offs_n, N, stride_ym, splits, SPLIT)


@triton.jit(do_not_specialize=GEMV_ARGS + ["stride_wn", "M"])
def _q6k_rows_q8(xq_ptr, xd_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, num_tiles,
                 tiles_per_split, splits, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                 KB: tl.constexpr, M_PAD: tl.constexpr, SPLIT: tl.constexpr,
                 ASM: tl.constexpr):
    """Q6_K as :func:`_q4k_rows_q8`, over :func:`_q6k_gemv_q8`'s word grid (``stride_wn`` in
    16-bit words), a slot's four quarters as the group axis: per 16-weight group,
    ``Σ (q - 32)·q_x`` of its four words in integers (the codes made signed bytes once,
    :func:`_less_32`, for every activation row), times ``d·sc·d_x``."""
    offs_n, kt0, end, rows, m4, j4 = _row_grid(w_ptr, tl.int16, N, stride_wn, num_tiles,
                                               tiles_per_split, BLOCK_N, KB, M_PAD)
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32)) + m4
    p4 = j4 % 4
    hf4 = p4 // 2
    t4 = tl.arange(0, 4)[None, None, None, :]  # the quarter: group 8hf + 2t + p % 2
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for kt in range(kt0, end, KB):
        kb4 = kt + j4 // 4
        live = kb4 < end
        blk = rows + tl.minimum(kb4, end - 1) * 105
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        x_t = xq32 + (kb4 * 64 + 32 * hf4 + 8 * t4 + 4 * (p4 % 2)) * M_PAD  # a group's word 0
        p = tl.zeros([M_PAD, BLOCK_N, 4 * KB, 4], tl.int32)
        for i in tl.static_range(4):
            ql = blk + 32 * hf4 + 8 * (p4 % 2) + 2 * i  # 16-bit word of ql byte 64hf + l
            src = tl.where(t4 % 2 == 0, _word16x2(ql), _word16x2(ql + 16))
            q = (((src >> (4 * (t4 // 2))) & 0x0F0F0F0F)
                 | (((_word16x2(ql + 64 - 16 * hf4) >> (2 * t4)) & 0x03030303) << 4))
            p = _dp4a_add(_less_32(q), tl.load(x_t + i * M_PAD, mask=live, other=0), p, ASM)
        xd = tl.load(xd_ptr + m4 + (kb4 * 8 + 4 * hf4 + t4) * M_PAD, mask=live, other=0.0)
        scale = tl.load(blk8 + 192 + 8 * hf4 + 2 * t4 + p4 % 2).to(tl.int8, bitcast=True)
        part = small_int_float(p) * ((f16_at(blk8 + 208) * scale.to(tl.float32)) * xd)
        acc += tl.sum(tl.sum(part, axis=3), axis=2)
    _finish_rows(acc, y_ptr, part_ptr, cnt_ptr, M, offs_n, N, stride_ym, splits, SPLIT)


def quantize(x: torch.Tensor) -> Q8Activations:
    """:func:`_quantize_x8` of ``x`` ``[M, k]`` (k a multiple of 256, unit stride along k): one
    launch for every row, whose result can serve every matrix that reads ``x``."""
    (m, k), dev = x.shape, x.device
    rows = m_pad(m)
    xq = torch.empty(k // 4, rows, 4, dtype=torch.int8, device=dev)
    xd, xs = torch.empty(2, k // 32, rows, dtype=torch.float32, device=dev)
    _quantize_x8[(k // TILE_K, rows)](x, xq, xd, xs, m, x.stride(0), M_PAD=rows)
    if m == 1:
        return Q8Activations(xq.view(k), xd.view(k // 32), xs.view(k // 32))
    return Q8Activations(xq, xd, xs)


def m_pad(m: int) -> int:
    """The multi-row kernels' activation rows for ``m``: the power of two at or above it."""
    return triton.next_power_of_2(m)


def gemv(x8: Q8Activations, raw: torch.Tensor, qtype: int, y: torch.Tensor, grid,
         per_split: int, block_n: int, blocks_per_step: int, num_warps: int) -> None:
    """``y`` ``[M, N]`` (contiguous) of the Q4_K or Q6_K rows ``raw`` (uint8
    ``[N, row_bytes]``, 16-byte aligned for Q4_K) against ``x8`` (:func:`quantize` of ``M``
    rows); ``grid`` (row programs, K slices) of ``per_split`` tiles each (slices
    combined in the launch: ``gguf_tiles.finish_at``). M = 1 runs the gemv kernels, M > 1
    :func:`_q4k_rows_q8` / :func:`_q6k_rows_q8`. Raises ValueError for another type."""
    m = y.shape[0]
    if qtype not in TYPES:
        raise ValueError(f"codes='q8' serves GGUF types {TYPES} (Q4_K, Q6_K), not {qtype}")
    n, tiles, splits = raw.shape[0], raw.shape[1] // BLOCK_BYTES[qtype], grid[1]
    part, cnt = split_buffers(y, splits, grid[0])
    knobs = dict(BLOCK_N=block_n, KB=blocks_per_step, SPLIT=splits > 1, ASM=not interpreting(),
                 num_warps=num_warps)
    row_units = raw.stride(0) // (16 if qtype == Q4_K else 2)
    if m > 1:
        if tuple(x8.xd.shape) != (tiles * 8, m_pad(m)):
            raise ValueError(f"x8 must be gguf_q8.quantize of {m} rows of k={tiles * 256}, got "
                             f"steps {tuple(x8.xd.shape)}")
        xs = (x8.xs,) if qtype == Q4_K else ()
        kernel = _q4k_rows_q8 if qtype == Q4_K else _q6k_rows_q8
        kernel[grid](x8.xq, x8.xd, *xs, raw, y, part, cnt, m, n, tiles, per_split, splits,
                     row_units, y.stride(0), M_PAD=m_pad(m), **knobs)
    elif qtype == Q4_K:
        _q4k_gemv_q8[grid](x8.xq, x8.xd, x8.xs, raw, y, part, cnt, n, tiles, per_split, splits,
                           row_units, **knobs)
    else:
        _q6k_gemv_q8[grid](x8.xq, x8.xd, raw, y, part, cnt, n, tiles, per_split, splits,
                           row_units, **knobs)
