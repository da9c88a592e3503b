"""Matmul over GGUF Q4_K, Q5_K and Q6_K blocks on int8 tensor cores, for 2..64 decode rows and
for prefill: the weights' integer codes meet 8-bit activations in ``tl.dot`` (int8 x int8 ->
int32) and the scales apply once per group to the exact integer sums. The idea is llama.cpp's
MMQ (``mmq.cuh``: int8 tiles on the tensor cores, per-group scales on the int32 partial sums);
the code here is this project's own.

``y[m, n] = x[m, k] · W[n, k]ᵀ``, W the raw bytes ``[N, row_bytes]`` of ``block_q4_K`` /
``block_q5_K`` / ``block_q6_K`` rows (ggml-common.h; value order as ``gguf.quants`` reads it),
x first rounded by ``gguf_q8.quantize`` (one launch for every row; int8 ``q_x`` per 32-group
with the step ``d_x = max|x| / 127`` and the group's exact ``Σ x``).

* Q4_K (144-byte blocks: fp16 ``d``, ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of
  nibbles; in 64-weight chunk ``c`` the 32 bytes' low nibbles are weights ``64c .. 64c + 31``,
  group ``2c``, the high ones ``64c + 32 ..``, group ``2c + 1``). Weight ``d·sc_g·q - dmin·m_g``,
  so per 32-group ``g`` and block::

      acc[n, m] += P[n, m] · (d·sc_g)[n] · d_x[m, g]  -  (dmin·m_g)[n] · (Σ x)[m, g]
      P = codes[n, 0..31] · q_x[0..31, m]   (one int8 tl.dot, exact in int32)

  Q5_K (176 bytes: Q4_K's fields with 32 bytes ``qh`` before the nibbles, bit ``g`` of byte
  ``l`` the fifth bit of weight ``32g + l``) the same with 5-bit codes.

* Q6_K (210-byte blocks: ql[128], qh[64], 16 int8 scales, fp16 ``d``; 16-weight groups).
  Weight ``d·sc_j·(q - 32)``, the codes made signed bytes ``q - 32`` before the dot. A 32-group
  of activations spans two 16-groups of weights, so the activation tile (the small operand)
  is loaded twice side by side, ``[32, 2·BLOCK_M]``, each copy with the other half's rows
  masked to zero: one dot gives ``P_e`` of both halves ``e``, and
  ``acc_e[n, m] += P_e[n, m] · (d·sc_e)[n] · d_x[m, g]``; the two copies add at the end.

Shapes: a program owns ``BLOCK_N`` weight rows (the tensor core's wide side: the left operand,
``[BLOCK_N, 32]`` codes), ``BLOCK_M`` activation rows (the right operand ``[32, BLOCK_M]``,
``BLOCK_M`` the power of two at or above M, at least 8, at most ``MAX_BLOCK_M``: past it more
programs walk M) and a slice of K tiles (256 weights, one block of each row); the slices of a
tile leave float32 partials that its last slice sums and stores in x's dtype
(``gguf_tiles.finish_at``).

Unpacking costs few instructions a weight: Q4_K's 32 nibble bytes of a chunk load as 16-byte
vectors (blocks are 144 bytes and rows a multiple of 16 bytes apart) and each 32-bit register of
four bytes gives four codes in one or two operations (``and 0x0F0F0F0F``, ``shr 4``) by
``tl.inline_asm_elementwise(pack=4)``; the interpreter (no inline assembly) runs the same kernel
with plain Triton byte operations (``ASM=False``).

Per output and group the scales cost three multiply-adds and no conversion instruction: the
int32 ``P`` enters the float unit through its bits (:func:`_times_x_step`), the scale bytes
likewise (:func:`_byte_float`).

Error: the activations' rounding (``gguf_q8``): each ``x`` moves by at most ``d_x / 2``; the
integer sums are exact, the scales float32 products, and ``P·d_x`` is exact but for at most
``0.75·d_x`` (:func:`_times_x_step`), below that rounding for any group whose codes sum past 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gguf_gemv, gguf_q8
from .gguf_tiles import f16_at, finish_at, small_int_float, split_buffers
from .triton_common import interpreting

Q4_K, Q5_K, Q6_K = gguf_gemv.Q4_K, gguf_gemv.Q5_K, gguf_gemv.Q6_K
TYPES = gguf_gemv.I8MMA_TYPES
MIN_M = 2
# activation rows a program (Q6_K's tile doubles them: half its registers' worth); more rows take
# more programs along the grid's first axis
MAX_BLOCK_M = {Q4_K: 64, Q5_K: 64, Q6_K: 32}
Q6K_STAGES = 2  # Q6_K's default software-pipeline depth: deeper ones spill registers
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}  # ggml-common.h's block_q4_K, _q5_K, _q6_K
TILE_K = 256


# ---- unpacking, four codes a 32-bit operation ----

@triton.jit
def _nibbles(b, HIGH: tl.constexpr, ASM: tl.constexpr):
    """int8 codes 0..15 of uint8 bytes ``b``: each byte's low nibble, or (HIGH) its high one.
    ASM: four bytes a register, one (two) PTX operations for four codes."""
    if ASM:
        if HIGH:
            q = tl.inline_asm_elementwise("shr.b32 $0, $1, 4;\n\tand.b32 $0, $0, 0x0F0F0F0F;",
                                          "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
        else:
            q = tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [b],
                                          dtype=tl.int8, is_pure=True, pack=4)
    else:
        q = ((b.to(tl.int32) >> (4 * HIGH)) & 0x0F).to(tl.int8)
    return q


@triton.jit
def _q5_codes(b, qh, HIGH: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):
    """int8 codes 0..31 of Q5_K's group ``G``: the nibble of uint8 ``b`` (high if HIGH) with bit
    ``G`` of uint8 ``qh`` as its fifth bit; four codes a register (ASM)."""
    if ASM:
        q = tl.inline_asm_elementwise(
            "{\n\t.reg .b32 lo, hi;\n\t"
            f"shr.b32 lo, $1, {4 * HIGH};\n\tand.b32 lo, lo, 0x0F0F0F0F;\n\t"
            f"shr.b32 hi, $2, {G};\n\tand.b32 hi, hi, 0x01010101;\n\t"
            "shl.b32 hi, hi, 4;\n\tor.b32 $0, lo, hi;\n\t}",
            "=r,r,r", [b, qh], dtype=tl.int8, is_pure=True, pack=4)
    else:
        lo = (b.to(tl.int32) >> (4 * HIGH)) & 0x0F
        q = (lo | (((qh.to(tl.int32) >> G) & 1) << 4)).to(tl.int8)
    return q


@triton.jit
def _q6_codes(ql, qh, T: tl.constexpr, ASM: tl.constexpr):
    """Signed int8 ``q - 32`` of quarter ``T`` of Q6_K's 6-bit codes from uint8 ``ql`` (nibble
    ``T // 2``) and ``qh`` (bits ``2T, 2T + 1``). ASM: four codes a register; ``q - 32`` with no
    borrow between bytes: ``q ^ 0x20`` is ``q - 32`` where bit 5 is set, else ``q + 32``,
    which bits 6 and 7 set make ``q + 32 - 64``."""
    if ASM:
        q = tl.inline_asm_elementwise(
            "{\n\t.reg .b32 lo, hi, neg;\n\t"
            f"shr.b32 lo, $1, {4 * (T // 2)};\n\tand.b32 lo, lo, 0x0F0F0F0F;\n\t"
            f"shr.b32 hi, $2, {2 * T};\n\tand.b32 hi, hi, 0x03030303;\n\t"
            "shl.b32 hi, hi, 4;\n\tor.b32 lo, lo, hi;\n\txor.b32 lo, lo, 0x20202020;\n\t"
            "and.b32 neg, lo, 0x20202020;\n\tshl.b32 hi, neg, 1;\n\tor.b32 lo, lo, hi;\n\t"
            "shl.b32 hi, neg, 2;\n\tor.b32 $0, lo, hi;\n\t}",
            "=r,r,r", [ql, qh], dtype=tl.int8, is_pure=True, pack=4)
    else:
        lo = (ql.to(tl.int32) >> (4 * (T // 2))) & 0x0F
        hi = (qh.to(tl.int32) >> (2 * T)) & 0x03
        q = ((lo | (hi << 4)) - 32).to(tl.int8)
    return q


# ---- the program's tile, the activations, the output ----

# shape arguments are not specialized (no recompiling per shape; the loads' alignment comes from
# the row stride's unit)
_SHAPE_ARGS = ["M", "N", "num_tiles", "tiles_per_split", "m_tiles", "splits"]


@triton.jit
def _tile(num_tiles, tiles_per_split, m_tiles, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (t, s) of output tile ``t = n·m_tiles + mt`` and K slice ``s``: its first
    activation row ``m0``, weight rows ``offs_n`` ``[BLOCK_N]``, activation rows ``offs_m``
    ``[BLOCK_M]`` and the K tiles ``kt0 .. end``. The M tile varies fastest, so the programs
    that read the same weights run side by side (one read from memory, the others from L2)."""
    m0 = (tl.program_id(0) % m_tiles) * BLOCK_M
    offs_n = (tl.program_id(0) // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    kt0 = tl.program_id(1) * tiles_per_split
    return m0, offs_n, m0 + tl.arange(0, BLOCK_M), kt0, tl.minimum(kt0 + tiles_per_split,
                                                                    num_tiles)


@triton.jit
def _x_group(xq_ptr, xd_ptr, x_off, offs_m, G, X_ROWS: tl.constexpr, MASK_M: tl.constexpr):
    """The int8 activations ``[32, BLOCK_M]`` of 32-group ``G`` (``gguf_q8.Q8Activations``:
    word-major for ``X_ROWS`` rows, so weight column ``kk`` of row ``m`` is byte
    ``((8G + kk // 4)·X_ROWS + m)·4 + kk % 4``; ``x_off`` that offset less ``32·G·X_ROWS``)
    and their steps ``d_x`` ``[BLOCK_M]``. MASK_M: the program's rows pass ``X_ROWS``."""
    if MASK_M:
        live = offs_m < X_ROWS
        xt = tl.load(xq_ptr + G * (32 * X_ROWS) + x_off, mask=live[None, :], other=0)
        xd = tl.load(xd_ptr + G * X_ROWS + offs_m, mask=live, other=0.0)
    else:
        xt = tl.load(xq_ptr + G * (32 * X_ROWS) + x_off)
        xd = tl.load(xd_ptr + G * X_ROWS + offs_m)
    return xt, xd


@triton.jit
def _x_sum(xs_ptr, offs_m, G, X_ROWS: tl.constexpr, MASK_M: tl.constexpr):
    """The exact ``Σ x`` ``[BLOCK_M]`` of 32-group ``G`` of each activation row."""
    if MASK_M:
        xs = tl.load(xs_ptr + G * X_ROWS + offs_m, mask=offs_m < X_ROWS, other=0.0)
    else:
        xs = tl.load(xs_ptr + G * X_ROWS + offs_m)
    return xs


@triton.jit
def _x_offsets(offs_m, X_ROWS: tl.constexpr):
    """:func:`_x_group`'s ``x_off`` ``[32, BLOCK_M]``."""
    kk = tl.arange(0, 32)
    return ((kk // 4) * (4 * X_ROWS) + kk % 4)[:, None] + (4 * offs_m)[None, :]


@triton.jit
def _store(acc, y_ptr, part_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_ym, splits,
           SPLIT: tl.constexpr):
    """``acc`` ``[BLOCK_N, BLOCK_M]`` into ``y[m, n]`` in y's dtype; split K slices through
    :func:`gguf_tiles.finish_at` (float32 partials ``[splits, M·N]``, the tile's last slice sums
    them in slice order: no zero-fill or cast launch)."""
    m2 = offs_m.to(tl.int64)[None, :]
    n2 = offs_n[:, None]
    finish_at(acc, y_ptr, m2 * stride_ym + n2, part_ptr, m2 * N + n2, M * N,
              (m2 < M) & (n2 < N), cnt_ptr, splits, SPLIT)


@triton.jit
def _k4_scale_words(blk):
    """The 6-bit scales and mins of Q4_K blocks (``blk``: uint8 pointers, 4-byte aligned), one
    a byte, four a 32-bit word: (scales 0..3, scales 4..7, mins 0..3, mins 4..7), from bytes
    4..7 (scales 0..3, and bits 4..5 of scales 4..7 in their top bits), 8..11 (the same for
    mins) and 12..15 (the low nibbles of scales 4..7, the high ones of mins 4..7), as ggml's
    ``get_scale_min_k4``: eight operations for the sixteen values."""
    blk32 = blk.to(tl.pointer_type(tl.int32))
    w1 = tl.load(blk32 + 1)
    w2 = tl.load(blk32 + 2)
    w3 = tl.load(blk32 + 3)
    sc_hi = (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)
    mn_hi = ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030)
    return w1 & 0x3F3F3F3F, sc_hi, w2 & 0x3F3F3F3F, mn_hi


@triton.jit
def _byte_float(word, B: tl.constexpr):
    """float32 of byte ``B`` of int32 ``word`` (as unsigned), exactly (``small_int_float``)."""
    if B == 3:
        v = (word >> 24) & 0xFF
    elif B == 0:
        v = word & 0xFF
    else:
        v = (word >> (8 * B)) & 0xFF
    return small_int_float(v)


@triton.jit
def _q6_scale_words(blk, hf):
    """The eight int8 scales of half ``hf`` of Q6_K blocks (``blk``: uint8 pointers, 2-byte
    aligned), each byte XOR 0x80 (the scale + 128, unsigned), four a word: (scales 0..3,
    4..7) of the half."""
    ptr = (blk + 192 + 8 * hf).to(tl.pointer_type(tl.int16))
    lo = (tl.load(ptr).to(tl.int32) & 0xFFFF) | (tl.load(ptr + 1).to(tl.int32) << 16)
    hi = (tl.load(ptr + 2).to(tl.int32) & 0xFFFF) | (tl.load(ptr + 3).to(tl.int32) << 16)
    return lo ^ -0x7F7F7F80, hi ^ -0x7F7F7F80  # -0x7F7F7F80: 0x80808080 as an int32


@triton.jit
def _times_x_step(p, xd):
    """float32 ``p·d_x`` of the int32 dot ``p`` ``[BLOCK_N, BLOCK_M]`` (``|p| < 2**22``) and the
    steps ``xd`` ``[BLOCK_M]``, in an integer add and one multiply-add: ``p + 1.5·2**23`` is a
    float's bits exactly, and ``(p + 1.5·2**23)·d_x - fl(1.5·2**23·d_x)`` is ``p·d_x`` but for
    the rounding of ``fl(1.5·2**23·d_x)``, at most ``0.75·d_x`` (half a float32 unit of it):
    below the rounding of x itself (``d_x / 2`` for each unit of a group's ``Σ |q|``)."""
    bits = (p + 0x4B400000).to(tl.float32, bitcast=True)
    return bits * xd[None, :] - (12582912.0 * xd)[None, :]


# ---- the kernels ----

@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _q45k_i8mma(xq_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, num_tiles,
                tiles_per_split, m_tiles, splits, row_16b, stride_ym, QTYPE: tl.constexpr,
                X_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                MASK_M: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                CHUNKS: tl.constexpr):
    """Q4_K (QTYPE 12) or Q5_K (13), program (t, s) as :func:`_tile`'s. ``row_16b``:
    the row stride in 16-byte units (rows are whole 144- or 176-byte blocks), so each chunk's 32
    nibble bytes load as 16-byte vectors and the scale words as 32-bit ones. Q5_K's block is
    Q4_K's with 32 bytes ``qh`` before the nibbles: bit ``G`` of byte ``l`` is the fifth bit of
    weight ``32G + l``."""
    BB: tl.constexpr = 144 if QTYPE == 12 else 176  # bytes a block
    QS: tl.constexpr = 16 if QTYPE == 12 else 48  # offset of the nibbles
    m0, offs_n, offs_m, kt0, end = _tile(num_tiles, tiles_per_split, m_tiles, BLOCK_N,
                                         BLOCK_M)
    rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * (row_16b * 16)  # rows past N: N - 1
    x_off = _x_offsets(offs_m, X_ROWS)
    lane = tl.arange(0, 32)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # a loop step is CHUNKS 64-weight chunks of a block (two groups each): fewer make the loads
    # that the compiler hoists ahead of a step's dots fewer, so a large BLOCK_M keeps few
    # registers and more programs fit; four run a block with no per-step overhead
    STEPS: tl.constexpr = 4 // CHUNKS
    for it in range(kt0 * STEPS, end * STEPS):
        blk = rows + (it // STEPS) * BB
        d = f16_at(blk)
        dmin = f16_at(blk + 2)
        sc_lo, sc_hi, mn_lo, mn_hi = _k4_scale_words(blk)
        if QTYPE == 13:
            qh = tl.load(blk[:, None] + 16 + lane)
        for cc in tl.static_range(CHUNKS):
            c = (it % STEPS) * CHUNKS + cc  # the chunk: groups 2c, 2c + 1
            b = tl.load(blk[:, None] + QS + 32 * c + lane)  # [BLOCK_N, 32] uint8
            sc_w = tl.where(c < 2, sc_lo, sc_hi)
            mn_w = tl.where(c < 2, mn_lo, mn_hi)
            if QTYPE == 13:
                qh_c = (qh >> (2 * c)).to(tl.uint8)  # bit 0 (1): group 2c (2c + 1)
            for h in tl.static_range(2):
                g = (it // STEPS) * 8 + 2 * c + h
                xt, xd = _x_group(xq_ptr, xd_ptr, x_off, offs_m, g, X_ROWS, MASK_M)
                xs = _x_sum(xs_ptr, offs_m, g, X_ROWS, MASK_M)
                if QTYPE == 12:
                    q = _nibbles(b, h, ASM)
                else:
                    q = _q5_codes(b, qh_c, h, h, ASM)
                p = tl.dot(q, xt, out_dtype=tl.int32)
                byte = 8 * ((2 * c + h) % 4)
                ds = d * small_int_float((sc_w >> byte) & 0xFF)
                dm = dmin * small_int_float((mn_w >> byte) & 0xFF)
                acc += _times_x_step(p, xd) * ds[:, None]
                acc -= dm[:, None] * xs[None, :]
    _store(acc, y_ptr, part_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_ym, splits, SPLIT)


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _q6k_i8mma(xq_ptr, xd_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, num_tiles,
               tiles_per_split, m_tiles, splits, stride_wn, stride_ym, X_ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, MASK_M: tl.constexpr,
               SPLIT: tl.constexpr, ASM: tl.constexpr):
    """Q6_K, program (t, s) as :func:`_tile`'s. ``stride_wn`` in 2-byte units (210-byte
    blocks are 2-byte aligned). Weight ``128hf + 32t + l`` of a block (half ``hf``, quarter
    ``t``, ``l`` 0..31) takes its low 4 bits from ql byte ``64hf + 32(t % 2) + l``, nibble
    ``t // 2``, its high 2 bits from qh byte ``128 + 32hf + l`` at bit ``2t``, and the scale
    ``8hf + 2t + l // 16``: 32-group ``4hf + t`` of the activations."""
    m0, offs_n, offs_m, kt0, end = _tile(num_tiles, tiles_per_split, m_tiles, BLOCK_N,
                                         BLOCK_M)
    rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * (stride_wn * 2)
    # the activation tile twice along N: column j is row offs_m[j % BLOCK_M] with only the
    # group's 16-weight half j // BLOCK_M kept (a masked load), so one dot gives both halves'
    # sums, each against its own scale
    cols = tl.arange(0, 2 * BLOCK_M)
    m2 = m0 + cols % BLOCK_M
    second = (cols >= BLOCK_M)[None, :]
    x_off = _x_offsets(m2, X_ROWS)
    keep = (tl.arange(0, 32) >= 16)[:, None] == second
    if MASK_M:
        keep = keep & (m2 < X_ROWS)[None, :]
    lane = tl.arange(0, 32)[None, :]
    acc = tl.zeros([BLOCK_N, 2 * BLOCK_M], tl.float32)
    for it in range(kt0 * 2, end * 2):  # a loop step is a block half: fewer registers
        kt = it // 2
        hf = it % 2
        blk = rows + kt * 210
        d = f16_at(blk + 208)
        ql_a = tl.load(blk[:, None] + 64 * hf + lane)  # quarters 0 and 2
        ql_b = tl.load(blk[:, None] + 64 * hf + 32 + lane)  # 1 and 3
        qh = tl.load(blk[:, None] + 128 + 32 * hf + lane)
        sc_a, sc_b = _q6_scale_words(blk, hf)  # scales 0..3, 4..7 of the half, + 128
        for t in tl.static_range(4):
            q = _q6_codes(ql_a if t % 2 == 0 else ql_b, qh, t, ASM)  # [BLOCK_N, 32] int8
            g = kt * 8 + 4 * hf + t
            xt = tl.load(xq_ptr + g * (32 * X_ROWS) + x_off, mask=keep, other=0)
            if MASK_M:
                xd = tl.load(xd_ptr + g * X_ROWS + m2, mask=m2 < X_ROWS, other=0.0)
            else:
                xd = tl.load(xd_ptr + g * X_ROWS + m2)
            p = tl.dot(q, xt, out_dtype=tl.int32)  # [BLOCK_N, 2·BLOCK_M]
            words = sc_a if t < 2 else sc_b
            ds_a = d * (_byte_float(words, (2 * t) % 4) - 128.0)
            ds_b = d * (_byte_float(words, (2 * t + 1) % 4) - 128.0)
            acc += _times_x_step(p, xd) * tl.where(second, ds_b[:, None], ds_a[:, None])
    acc = tl.sum(tl.reshape(acc, (BLOCK_N, 2, BLOCK_M)), axis=1)
    _store(acc, y_ptr, part_ptr, cnt_ptr, offs_n, offs_m, M, N, stride_ym, splits, SPLIT)


# ---- host side ----

def block_m(m: int, qtype: int) -> int:
    """Activation rows a program for ``m``: the power of two at or above it, at least 8 (the
    tensor core's least N, which this Triton pads an int8 dot to), at most
    ``MAX_BLOCK_M[qtype]``."""
    return min(MAX_BLOCK_M[int(qtype)], max(8, triton.next_power_of_2(m)))


def serves(raw: torch.Tensor, qtype: int, m: int) -> bool:
    """Whether this kernel takes the call: Q4_K, Q5_K or Q6_K, ``m >= MIN_M``, raw data aligned
    to the kernel's loads (16 bytes for Q4_K and Q5_K, whose rows must then be a multiple of 16
    bytes apart; 2 for Q6_K)."""
    step = 2 if int(qtype) == Q6_K else 16
    return (int(qtype) in TYPES and m >= MIN_M and raw.data_ptr() % step == 0
            and raw.stride(0) % step == 0)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
           cfg: gguf_gemv.DecodeConfig,
           x8: gguf_q8.Q8Activations | None = None) -> torch.Tensor:
    """``x [M, k] · Wᵀ`` -> ``[M, N]`` in x's dtype (float32/bf16/fp16) for ``M >= 2``, W the
    Q4_K, Q5_K or Q6_K blocks ``raw`` (uint8 ``[N, row_bytes]``, contiguous rows; the caller,
    ``gguf_gemm.matmul``, checks the shapes and :func:`serves`). ``cfg``: ``block_n`` (16, 32,
    64, 128), ``num_warps``, ``num_stages`` (0: Triton's default; Q6_K ``Q6K_STAGES``),
    ``split_k`` / ``programs_per_sm``, ``chunks_per_step`` (Q4_K, Q5_K). ``x8``:
    ``gguf_q8.quantize(x)`` already made (else made here). Raises ValueError for another type,
    M < 2, a ``chunks_per_step`` not 1, 2 or 4, or an ``x8`` of another shape."""
    qtype, (m, n) = int(qtype), (x.shape[0], raw.shape[0])
    if qtype not in TYPES or m < MIN_M:
        raise ValueError(f"gguf_i8mma serves Q4_K/Q5_K/Q6_K (12, 13, 14) at M >= {MIN_M}, got "
                         f"type {qtype}, M={m}")
    if cfg.chunks_per_step not in (1, 2, 4):
        raise ValueError(f"gguf_i8mma: chunks_per_step must be 1, 2 or 4, got "
                         f"{cfg.chunks_per_step}")
    x8 = gguf_q8.quantize(x) if x8 is None else x8
    x_rows = gguf_q8.m_pad(m)
    if tuple(x8.xd.shape) != (k // 32, x_rows):
        raise ValueError(f"x8 must be gguf_q8.quantize of {m} rows of k={k}, got steps "
                         f"{tuple(x8.xd.shape)}")
    tiles, bm = k // TILE_K, block_m(m, qtype)
    m_tiles = triton.cdiv(m, bm)
    n_tiles = m_tiles * triton.cdiv(n, cfg.block_n)
    per_split = triton.cdiv(tiles, gguf_gemv.splits_for(cfg, n_tiles, tiles, x.device))
    splits = triton.cdiv(tiles, per_split)  # no slice left empty
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part, cnt = split_buffers(y, splits, n_tiles)
    knobs = dict(X_ROWS=x_rows, BLOCK_N=cfg.block_n, BLOCK_M=bm, MASK_M=x_rows < bm,
                 SPLIT=splits > 1, ASM=not interpreting(), num_warps=cfg.num_warps)
    if cfg.num_stages or qtype == Q6_K:
        knobs["num_stages"] = cfg.num_stages or Q6K_STAGES
    shape = (m, n, tiles, per_split, m_tiles, splits)
    if qtype != Q6_K:
        _q45k_i8mma[(n_tiles, splits)](x8.xq, x8.xd, x8.xs, raw, y, part, cnt, *shape,
                                       raw.stride(0) // 16, y.stride(0), QTYPE=qtype,
                                       CHUNKS=cfg.chunks_per_step, **knobs)
    else:
        _q6k_i8mma[(n_tiles, splits)](x8.xq, x8.xd, raw, y, part, cnt, *shape,
                                      raw.stride(0) // 2, y.stride(0), **knobs)
    return y
