"""Decode matmul (M <= 16) over GGUF Q4_K, Q5_K and Q6_K blocks in the file's layout, scales
applied once per group rather than once per weight.

``y[m, n] = x[m, k] · W[n, k]ᵀ``, W the raw bytes ``[N, row_bytes]`` of ``block_q4_K`` /
``block_q5_K`` / ``block_q6_K`` rows (ggml-common.h; value order as ``gguf.quants`` reads it).
Each weight is ``w = a·q - b`` with the code ``q`` and, per group of weights, ``a`` and ``b``
(Q4_K, Q5_K: 32-weight groups, ``a = d·scale``, ``b = dmin·min``; Q6_K: 16-weight groups,
``a = d·scale``, ``b = 32·a``). A group's share of the output is therefore
``a · Σ q·x  -  b · Σ x``: the codes meet the activations alone, and the two scale terms are
applied once per group and row. The activation sums ``Σ x`` of a group serve every row.

* ``gemv`` kernels (M = 1): a program owns ``BLOCK_N`` rows; each 256-weight tile of a row is
  read as a ``[4, 8]`` grid of 32-bit words (Q4_K, Q5_K: the 128 nibble bytes) or 16-bit words
  (Q6_K, whose 210-byte blocks are only 2-byte aligned), each word holding several codes whose
  products with ``x`` are summed in registers before the group's scale multiplies them.
  A code becomes a float without an int-to-float conversion (``CODE_MODES``): its bits, masked
  in place or shifted, are ORed into the mantissa of 1.0, and the constant and the power of two
  that this adds come off exactly, through the activation or the group's ``Σ x`` term.
  A loop step loads ``blocks_per_step`` blocks of each row, to keep more bytes in flight.
* ``codes="q8"`` (Q4_K, Q6_K; ``gguf_q8``): the activations are first rounded to int8
  per 32-group, and a word's four codes meet four of them in one ``dp4a``; at 2 <= M <= 16 a
  program loads each weight word once for every activation row and sums each group's
  products in integers before its scales apply. Not bit-compatible
  with the float kernels: the error is that rounding's; one rounding can serve every matrix
  that reads the same x.
* ``dot`` kernel (M <= 16): per group, the codes of ``BLOCK_N`` rows meet the ``[16, 32]``
  (Q6_K: ``[16, 16]``) activations in one ``tl.dot``; the group's scales then multiply the
  ``[16, BLOCK_N]`` result.

K is split across programs (``split_k``) when the rows alone do not fill the GPU. The gemv
kernels' slices store float32 partials and the last slice of a row tile sums them and stores
the output (``gguf_tiles.finish``: no zero-fill or cast launch); the dot kernel's slices add
atomically. Which kernel and tile serve a shape is the table ``DECODE_CONFIGS`` (the one place
to change after a sweep, ``gguf_gemm_bench --sweep``), unless the environment names a sweep's
results: ``LOCALGEN_GGUF_DECODE_CONFIGS=<sweep.json>`` makes
:func:`default_config` take that file's ``winners`` (``[{"qtype", "m", "cfg"}]``, one per type
and M measured; the entry of the nearest measured M at or above the call's, the table where the
file has none), so a sweep's choice runs without editing this module.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import gguf_q8
from .gguf_tiles import GEMV_ARGS, f16_at, finish, k4_scale_min, slots, split_buffers

Q4_K, Q5_K, Q6_K = 12, 13, 14  # GGMLQuantizationType values
TYPES = (Q4_K, Q5_K, Q6_K)
TILE_K = 256
MAX_M = 16
MMA_TYPES, MMA_MAX_M = (Q4_K, Q6_K), 64  # the types and the largest M of gguf_mma's kernel
I8MMA_TYPES = (Q4_K, Q5_K, Q6_K)  # gguf_i8mma's kernel: any M from 2 (decode and prefill)


@dataclass(frozen=True)
class DecodeConfig:
    """One launch of the decode kernels. ``kernel``: ``gemv`` (M = 1; with "q8" codes up to
    ``MAX_M`` rows), ``dot`` or ``file``
    (``gguf_gemm``'s kernel over the file's blocks, dequantizing each weight; M <= 16),
    ``mma`` (``gguf_mma``'s tensor-core kernel, Q4_K and Q6_K, 2 <= M <= 64), ``i8mma``
    (``gguf_i8mma``'s int8 tensor-core kernel over 8-bit activations, Q4_K, Q5_K and Q6_K,
    M >= 2)
    or ``dequant`` (the whole matrix dequantized, then cuBLAS: the prefill path); ``block_n``:
    output rows a program; ``split_k``: K slices (0: enough for ``programs_per_sm`` programs on
    every multiprocessor); ``num_warps``; ``codes``: how the gemv kernels turn codes into floats
    (``CODE_MODES``); ``blocks_per_step``: blocks of each row a gemv loop step loads (1, 2, 4, 8);
    ``num_stages``: the mma and i8mma kernels' software-pipeline depth over K (0: Triton's
    default); ``chunks_per_step``: the 64-weight chunks of a block an i8mma loop step takes
    for Q4_K and Q5_K (1, 2, 4: fewer keep fewer registers)."""

    kernel: str = "gemv"
    block_n: int = 16
    split_k: int = 0
    num_warps: int = 4
    codes: str = "mask"
    programs_per_sm: int = 4
    blocks_per_step: int = 1
    num_stages: int = 0
    chunks_per_step: int = 4


# gemv code-to-float modes (the MODE constexpr): "i2f" converts the integer; "shift" moves the
# code into the mantissa of 1.0 (``1 + q/2**B``, undone per group); "mask" keeps the code where
# it sits in its word and ORs in 1.0's exponent, so one mask and one subtraction give
# ``q·2**-s`` exactly and the activation carries the ``2**s``. "q8" (Q4_K, Q6_K) rounds the
# activations to int8 per 32-group first and multiplies codes in integers (``gguf_q8``).
CODE_MODES = {"i2f": 0, "shift": 1, "mask": 2}
Q8_TYPES = gguf_q8.TYPES


def serves(cfg: DecodeConfig, qtype: int, m: int) -> bool:
    """Whether ``cfg`` runs as itself for ``qtype`` at ``m`` rows (gemv at M = 1, and with its
    "q8" codes, only for ``Q8_TYPES``, up to ``MAX_M``; dot and file up to ``MAX_M``; mma for
    ``MMA_TYPES`` from 2 to ``MMA_MAX_M`` rows; i8mma for ``I8MMA_TYPES`` from 2 rows; dequant,
    the prefill path, past one row): the sweep's filter."""
    if cfg.kernel == "i8mma":  # Q6_K's loop step is a block half whatever chunks_per_step says
        return (int(qtype) in I8MMA_TYPES and m >= 2
                and (int(qtype) != Q6_K or cfg.chunks_per_step == 4))
    if cfg.kernel == "mma":
        return int(qtype) in MMA_TYPES and 2 <= m <= MMA_MAX_M
    if cfg.kernel == "dequant":
        return m > 1
    if cfg.kernel != "gemv":
        return m <= MAX_M
    if cfg.codes == "q8":
        return int(qtype) in Q8_TYPES and m <= MAX_M
    return m == 1


# every other type the decode path reads (gguf_gemm.KERNEL_TYPES): the file-layout kernel
FILE_CONFIG = DecodeConfig("file", block_n=32)
# past MAX_M rows, where the table names nothing else: dequantize, then cuBLAS
DEQUANT_CONFIG = DecodeConfig("dequant")


PREFILL_CLASS = MMA_MAX_M + 1  # decode_class of every M past MMA_MAX_M: PREFILL_CONFIGS


def decode_class(m: int) -> int:
    """The table's M class of ``m`` activation rows: 1, 16 (2..16), 64 (17..64) or
    ``PREFILL_CLASS`` (more)."""
    if m > MMA_MAX_M:
        return PREFILL_CLASS
    return 1 if m == 1 else (MAX_M if m <= MAX_M else MMA_MAX_M)

# (qtype, decode_class(M)) -> config: the one place to change after ``gguf_gemm_bench
# --sweep``, whose ranking on the 7B shapes (docs/benchmarks.md) chose these. At M = 1, Q4_K and
# Q6_K take 8-bit activations and dp4a in two-row tiles of one warp, K unsplit (many small
# programs keep the most loads in flight), Q4_K with four blocks of a row a loop step; Q5_K's
# gemv was not ranked, so it stays on the file kernel. From 2 to 16 rows the int8 tensor-core
# kernel (gguf_i8mma) in 64-row tiles beat the file kernel for Q4_K and Q6_K, and from 17 to 64
# rows for Q4_K; there Q6_K stays on the prefill path (DEQUANT_CONFIG), which beat it. Q5_K's
# i8mma tiles were not ranked.
DECODE_CONFIGS: dict[tuple[int, int], DecodeConfig] = {
    (Q4_K, 1): DecodeConfig("gemv", block_n=2, split_k=1, num_warps=1, codes="q8",
                            blocks_per_step=4),
    (Q6_K, 1): DecodeConfig("gemv", block_n=2, split_k=1, num_warps=1, codes="q8"),
    (Q5_K, 1): FILE_CONFIG,
    (Q4_K, 16): DecodeConfig("i8mma", block_n=64),
    (Q6_K, 16): DecodeConfig("i8mma", block_n=64, programs_per_sm=8),
    (Q5_K, 16): FILE_CONFIG,
    (Q4_K, 64): DecodeConfig("i8mma", block_n=64),
    (Q5_K, 64): DEQUANT_CONFIG, (Q6_K, 64): DEQUANT_CONFIG,
}
# qtype -> config past MMA_MAX_M rows (prefill), where a sweep's prefill rows (M = 128, 512)
# rank a kernel above the prefill path; a type not named takes DEQUANT_CONFIG.
PREFILL_CONFIGS: dict[int, DecodeConfig] = {}


ENV_CONFIGS = "LOCALGEN_GGUF_DECODE_CONFIGS"  # a sweep's JSON whose ``winners`` to take


def default_config(qtype: int, m: int) -> DecodeConfig:
    """The config for ``qtype`` at ``m`` activation rows: the ``ENV_CONFIGS`` file's winner of
    the nearest measured M at or above ``m`` that serves ``m`` where it has one (past
    ``MMA_MAX_M`` rows, else its largest measured M past them: a prefill row serves every longer
    prompt), else the table's (``PREFILL_CONFIGS`` past ``MMA_MAX_M`` rows); for a type none
    names ``FILE_CONFIG`` up to ``MAX_M`` rows, ``DEQUANT_CONFIG`` past it. Raises ValueError
    (naming the file) for a file that cannot be read or whose winners are not configs that
    serve their type and M."""
    path = os.environ.get(ENV_CONFIGS)
    if path:
        mine = [(wm, cfg) for wq, wm, cfg in measured_winners(path) if wq == int(qtype)
                and serves(cfg, qtype, m)]
        above = [e for e in mine if e[0] >= m]
        if above:
            return min(above, key=lambda e: e[0])[1]
        prefill = [e for e in mine if e[0] > MMA_MAX_M]
        if m > MMA_MAX_M and prefill:
            return max(prefill, key=lambda e: e[0])[1]
    if m > MMA_MAX_M:
        return PREFILL_CONFIGS.get(int(qtype), DEQUANT_CONFIG)
    return DECODE_CONFIGS.get((int(qtype), decode_class(m)),
                              FILE_CONFIG if m <= MAX_M else DEQUANT_CONFIG)


@functools.lru_cache(maxsize=4)
def measured_winners(path: str) -> tuple[tuple[int, int, DecodeConfig], ...]:
    """``(qtype, m, config)`` of each entry of the ``winners`` list in ``gguf_gemm_bench
    --sweep``'s JSON at ``path`` (read once a process). Raises ValueError naming the file and
    the entry that is missing or wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)["winners"]
        out = tuple((int(e["qtype"]), int(e["m"]), DecodeConfig(**e["cfg"])) for e in entries)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{ENV_CONFIGS}={path}: not a sweep result with a 'winners' list of "
                         f"{{qtype, m, cfg}} ({type(exc).__name__}: {exc})") from exc
    bad = [e for e in out if not serves(e[2], e[0], e[1])]
    if bad:
        raise ValueError(f"{ENV_CONFIGS}={path}: winner {bad[0]} does not serve its type and M")
    return out


# ---- shared device helpers ----

@triton.jit
def _code_float(q, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """float32 of non-negative int32 codes ``q < 2**BITS``: ``1 + q / 2**BITS`` by mantissa bits
    (MAGIC) or ``q`` itself. :func:`_coefs` undoes either form per group."""
    if MAGIC:
        f = ((q << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)
    else:
        f = q.to(tl.float32)
    return f


@triton.jit
def _code_x(words, P: tl.constexpr, BITS: tl.constexpr, xv, MODE: tl.constexpr):
    """``f(q)·x`` for the ``BITS``-bit codes ``q`` at bit ``P`` of int32 ``words``: ``q·x``
    (MODE 0, 2) or ``(1 + q/2**BITS)·x`` (MODE 1). MODE 2 needs the field below bit 23, or
    (``P >= 20``) below bit 35, read from ``words >> 12``."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if MODE == 2:
        if P + BITS <= 23:
            f = ((words & (MASK << P)) | 0x3F800000).to(tl.float32, bitcast=True)
            out = (f - 1.0) * (xv * (1 << (23 - P)))
        else:
            f = (((words >> 12) & (MASK << (P - 12))) | 0x3F800000).to(tl.float32, bitcast=True)
            out = (f - 1.0) * (xv * (1 << (35 - P)))
    else:
        out = _code_float((words >> P) & MASK, BITS, MODE == 1) * xv
    return out


@triton.jit
def _coefs(a, b, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """The multipliers of ``Σ f·x`` and of ``Σ x`` for a group whose weights are ``a·q - b`` and
    whose codes were read as ``f = _code_float(q)``: ``a·q = a·2**B·(f - 1)`` under MAGIC."""
    if MAGIC:
        ca = a * (1 << BITS)
        cb = ca + b
    else:
        ca = a
        cb = b
    return ca, cb


# ---- M = 1 ----

@triton.jit(do_not_specialize=GEMV_ARGS + ["row_16b"])
def _q45k_gemv(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, num_tiles, tiles_per_split, splits,
               row_16b, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               SPLIT: tl.constexpr, MODE: tl.constexpr):
    """Q4_K (QTYPE 12) or Q5_K (13). Program (n, s): rows ``n*BLOCK_N ..`` over K tiles
    ``s*tiles_per_split ..``. A tile's 128 nibble bytes are 32 words ``[chunk c, word i]``; byte
    ``b`` of word (c, i) holds weight ``64c + 4i + b`` (low nibble, group 2c) and
    ``64c + 32 + 4i + b`` (high nibble, group 2c+1). Q5_K's fifth bit of weight
    ``32G + l`` is bit ``G`` of qh byte ``l``, so qh word ``i`` serves word (c, i) of every chunk.
    ``row_16b``: the row stride in 16-byte units (a row is whole 144/176-byte blocks), so that
    the compiler knows every tile's words start 16-byte aligned and loads them four at a time.
    Blocks past the slice are read from its last block with their activations masked to 0."""
    BW: tl.constexpr = 36 if QTYPE == 12 else 44  # 32-bit words a block
    QS: tl.constexpr = 4 if QTYPE == 12 else 12  # word of the nibbles
    offs_n, kt0, end, j2 = slots(tl.program_id(0), tl.program_id(1), num_tiles,
                                  tiles_per_split, BLOCK_N, KB)
    rows = (w_ptr.to(tl.pointer_type(tl.int32))
            + tl.minimum(offs_n, N - 1).to(tl.int64) * (row_16b * 4))[:, None, None]
    j3 = j2[:, :, None]
    c3 = j3 % 4
    i3 = tl.arange(0, 8)[None, None, :]
    # every per-group value is [BLOCK_N, 4·KB, 1], broadcast along the words: no layout changes
    acc = tl.zeros([BLOCK_N, 4 * KB, 8], tl.float32)
    for kt in range(kt0, end, KB):
        kb3 = kt + j3 // 4
        blk = rows + tl.minimum(kb3, end - 1) * BW
        words = tl.load(blk + QS + 8 * c3 + i3)
        if QTYPE == 13:
            qh = tl.load(blk + 4 + i3)
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        d = f16_at(blk8)
        dmin = f16_at(blk8 + 2)
        x_tile = x_ptr + kb3 * 256 + 64 * c3 + 4 * i3
        live = kb3 < end
        for h in tl.static_range(2):
            s = tl.zeros([BLOCK_N, 4 * KB, 8], tl.float32)
            xs = tl.zeros([1, 4 * KB, 8], tl.float32)
            if QTYPE == 13:  # byte b of q5: the 5-bit code of weight 64c + 32h + 4i + b
                q5 = (((words >> (4 * h)) & 0x0F0F0F0F)
                      | (((qh >> (2 * c3 + h)) & 0x01010101) << 4))
            for b in tl.static_range(4):
                xv = tl.load(x_tile + 32 * h + b, mask=live, other=0.0).to(tl.float32)
                if QTYPE == 12:
                    s += _code_x(words, 8 * b + 4 * h, 4, xv, MODE)
                else:
                    s += _code_x(q5, 8 * b, 5, xv, MODE)
                xs += xv
            sc, mn = k4_scale_min(blk8, 2 * c3 + h)
            ca, cb = _coefs(d * sc, dmin * mn, 4 if QTYPE == 12 else 5, MODE == 1)
            acc += s * ca - xs * cb
    finish(tl.sum(tl.sum(acc, axis=2), axis=1), y_ptr, part_ptr, cnt_ptr, offs_n, N, splits,
           SPLIT)


@triton.jit(do_not_specialize=GEMV_ARGS + ["stride_wn"])
def _q6k_gemv(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, num_tiles, tiles_per_split, splits,
              stride_wn, BLOCK_N: tl.constexpr, KB: tl.constexpr, SPLIT: tl.constexpr,
              MODE: tl.constexpr):
    """Q6_K as :func:`_q45k_gemv`, over 16-bit words (``stride_wn`` in them). A tile is two
    128-weight halves ``hf``; with ``l = 2v + e`` (``v`` 0..15, ``e`` the byte of a word) and
    quarter ``t``, weight ``128hf + 32t + l`` takes its low 4 bits from ql byte ``64hf + l``
    (t = 0, 2) or ``64hf + 32 + l`` (t = 1, 3), nibble ``t // 2``, its high 2 bits from qh byte
    ``128 + 32hf + l`` at bit ``2t``, and scale ``8hf + 2t + l // 16``. A block's part
    ``p = j % 4`` is ``hf = p // 2``, ``v = 8(p % 2) + 0..7``, so a slot shares one scale per
    quarter."""
    offs_n, kt0, end, j2 = slots(tl.program_id(0), tl.program_id(1), num_tiles,
                                  tiles_per_split, BLOCK_N, KB)
    rows = (w_ptr.to(tl.pointer_type(tl.int16))
            + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn)[:, None, None]
    j3 = j2[:, :, None]
    p3 = j3 % 4
    hf3 = p3 // 2
    v3 = 8 * (p3 % 2) + tl.arange(0, 8)[None, None, :]
    acc = tl.zeros([BLOCK_N, 4 * KB, 8], tl.float32)
    for kt in range(kt0, end, KB):
        kb3 = kt + j3 // 4
        blk = rows + tl.minimum(kb3, end - 1) * 105
        w3 = blk + 32 * hf3 + v3
        ql_a = tl.load(w3).to(tl.int32)
        ql_b = tl.load(w3 + 16).to(tl.int32)
        qh = tl.load(w3 + 64 - 16 * hf3).to(tl.int32)
        blk8 = blk.to(tl.pointer_type(tl.uint8))
        d = f16_at(blk8 + 208)
        x_tile = x_ptr + kb3 * 256 + 128 * hf3 + 2 * v3
        live = kb3 < end
        for t in tl.static_range(4):
            src = ql_a if t % 2 == 0 else ql_b
            # both bytes' 6-bit codes at once: byte e of q2 is the code of l = 2v + e
            q2 = ((src >> (4 * (t // 2))) & 0x0F0F) | (((qh >> (2 * t)) & 0x0303) << 4)
            s = tl.zeros([BLOCK_N, 4 * KB, 8], tl.float32)
            xs = tl.zeros([1, 4 * KB, 8], tl.float32)
            for e in tl.static_range(2):
                xv = tl.load(x_tile + 32 * t + e, mask=live, other=0.0).to(tl.float32)
                s += _code_x(q2, 8 * e, 6, xv, MODE)
                xs += xv
            scale = tl.load(blk8 + 192 + 8 * hf3 + 2 * t + p3 % 2).to(tl.int8, bitcast=True)
            a = d * scale.to(tl.float32)
            ca, cb = _coefs(a, 32 * a, 6, MODE == 1)
            acc += s * ca - xs * cb
    finish(tl.sum(tl.sum(acc, axis=2), axis=1), y_ptr, part_ptr, cnt_ptr, offs_n, N, splits,
           SPLIT)


# ---- 1 < M <= 16 ----

@triton.jit
def _group_codes(blk8, G: tl.constexpr, QTYPE: tl.constexpr):
    """int32 codes ``[BLOCK_N, GS]`` of group ``G`` of a tile (``blk8``: ``[BLOCK_N]`` uint8
    pointers to each row's block), with the group's ``a`` and ``b`` ``[BLOCK_N]`` (weight
    ``a·q - b``). Q4_K: 32-weight groups ``G`` 0..7; Q6_K: 16-weight groups 0..15 (the
    ``_q6k_gemv`` docstring's layout, ``G = 8hf + 2t + l // 16``)."""
    if QTYPE == 12 or QTYPE == 13:
        lane = tl.arange(0, 32)[None, :]
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        q = (tl.load(blk8[:, None] + QS + 32 * (G // 2) + lane).to(tl.int32) >> (4 * (G % 2))) & 15
        if QTYPE == 13:
            q = q | (((tl.load(blk8[:, None] + 16 + lane).to(tl.int32) >> G) & 1) << 4)
        sc, mn = k4_scale_min(blk8, G)
        a = f16_at(blk8) * sc
        b = f16_at(blk8 + 2) * mn
    else:
        hf = G // 8
        t = (G % 8) // 2
        lane = 16 * (G % 2) + tl.arange(0, 16)[None, :]
        lo = tl.load(blk8[:, None] + 64 * hf + 32 * (t % 2) + lane).to(tl.int32) >> (4 * (t // 2))
        hi = tl.load(blk8[:, None] + 128 + 32 * hf + lane).to(tl.int32) >> (2 * t)
        q = (lo & 15) | ((hi & 3) << 4)
        a = f16_at(blk8 + 208) * tl.load(blk8 + 192 + G).to(tl.int8, bitcast=True).to(tl.float32)
        b = 32 * a
    return q, a, b


@triton.jit(do_not_specialize=GEMV_ARGS + ["M"])  # stride_wn's alignment serves the loads
def _gemm_dot(x_ptr, w_ptr, y_ptr, M, N, num_tiles, tiles_per_split, stride_xm, stride_wn,
              stride_ym, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr,
              DOT_DTYPE: tl.constexpr, CODE_BITS: tl.constexpr, CODE_OFF: tl.constexpr):
    """Program (n, s) of ``[16, BLOCK_N]`` outputs over K tiles ``s*tiles_per_split ..``: per
    group, ``P = x_g · f_gᵀ`` by ``tl.dot``, then ``acc += P·a - (Σ x_g)·(b + CODE_OFF·a)``.
    The codes enter the dot as ``f = CODE_OFF + q``: for bf16 (fp16) activations the code ORed
    under the exponent of 128 (1024), ``CODE_BITS`` 0x4300 (0x6400), exact and without an
    int-to-float conversion; for float32 activations (``CODE_BITS`` 0) ``q`` itself, and the
    dot in IEEE float32 (no TF32 rounding)."""
    GS: tl.constexpr = 16 if QTYPE == 14 else 32
    BB: tl.constexpr = 144 if QTYPE == 12 else (176 if QTYPE == 13 else 210)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + tl.arange(0, GS)[None, :]
    m_mask = (offs_m < M)[:, None]
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    kt0 = pid_k * tiles_per_split
    for kt in range(kt0, tl.minimum(kt0 + tiles_per_split, num_tiles)):
        blk8 = rows + kt * BB
        for g in tl.static_range(256 // GS):
            x = tl.load(x_rows + kt * 256 + GS * g, mask=m_mask, other=0.0)
            q, a, b = _group_codes(blk8, g, QTYPE)
            if CODE_BITS == 0:
                p = tl.dot(x, tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:
                f = (q | CODE_BITS).to(tl.int16).to(DOT_DTYPE, bitcast=True)
                p = tl.dot(x.to(DOT_DTYPE), tl.trans(f))
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += p * a[None, :] - xsum[:, None] * (b + CODE_OFF * a)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask & (offs_n < N)[None, :]
    if not ATOMIC:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y, acc, mask=mask)


# ---- host side ----

def splits_for(cfg: DecodeConfig, n_programs: int, num_tiles: int, device: torch.device) -> int:
    """K slices: ``cfg.split_k``, or where 0 enough for ``cfg.programs_per_sm`` programs on each
    multiprocessor (one on a CPU), at most one slice per tile."""
    if cfg.split_k:
        want = cfg.split_k
    elif device.type != "cuda":
        want = 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = -(-cfg.programs_per_sm * sms // n_programs)
    return max(1, min(num_tiles, want))


def _split(cfg: DecodeConfig, n_programs: int, num_tiles: int,
           device: torch.device) -> tuple[int, int]:
    """(K slices, tiles a slice) of a launch (:func:`splits_for`, no slice left empty)."""
    per_split = triton.cdiv(num_tiles, splits_for(cfg, n_programs, num_tiles, device))
    return triton.cdiv(num_tiles, per_split), per_split


def split_output(cfg: DecodeConfig, x: torch.Tensor, n: int, n_programs: int,
                 num_tiles: int) -> tuple[int, int, torch.Tensor]:
    """(K slices, tiles a slice, the output ``[M, n]``): in x's dtype for one slice, else
    float32 zeros that the slices add into (the dot, mma and file kernels)."""
    splits, per_split = _split(cfg, n_programs, num_tiles, x.device)
    y = (torch.empty if splits == 1 else torch.zeros)(
        x.shape[0], n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    return splits, per_split, y


def rounds_x(qtype: int, m: int = 1) -> bool:
    """Whether the default config of ``qtype`` at ``m`` rows rounds x to 8 bits
    (``gguf_q8``), so that one ``x8`` made for several matrices saves each of them a launch."""
    cfg = default_config(qtype, m)
    if cfg.kernel == "i8mma":  # gguf_i8mma reads gguf_q8's rounding too
        return serves(cfg, qtype, m)
    return (cfg.kernel == "gemv" and cfg.codes == "q8" and int(qtype) in Q8_TYPES
            and m <= MAX_M)


# activation dtype -> (dot operand dtype, CODE_BITS, CODE_OFF) of ``_gemm_dot``
_DOT_CODES = {torch.float32: (tl.float32, 0, 0.0), torch.bfloat16: (tl.bfloat16, 0x4300, 128.0),
              torch.float16: (tl.float16, 0x6400, 1024.0)}


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
           cfg: DecodeConfig | None = None,
           x8: gguf_q8.Q8Activations | None = None) -> torch.Tensor:
    """``x [M, k] · Wᵀ`` -> ``[M, N]`` in x's dtype (float32/bf16/fp16) for ``1 <= M <= 16``,
    W the Q4_K, Q5_K or Q6_K blocks ``raw`` (uint8 ``[N, row_bytes]``, contiguous rows, 16-byte
    aligned data; the caller, ``gguf_gemm.matmul``, checks the shapes). ``cfg`` (default
    :func:`default_config`) must not be ``file``; a ``gemv`` config at M > 1 runs the ``dot``
    kernel with its tile, except with "q8" codes (``gguf_q8``'s multi-row kernels). ``x8``:
    ``gguf_q8.quantize(x)`` already made, for matrices that read the same ``x`` (used by a "q8"
    config, else ignored). Raises ValueError for another type, M, dtype or a ``file`` config."""
    qtype, (m, n) = int(qtype), (x.shape[0], raw.shape[0])
    if qtype not in TYPES or not 1 <= m <= MAX_M:
        raise ValueError(f"gguf_gemv serves Q4_K/Q5_K/Q6_K (12, 13, 14) at 1 <= M <= {MAX_M}, "
                         f"got type {qtype}, M={m}")
    x = x.contiguous()
    if x.dtype not in _DOT_CODES:
        raise ValueError(f"gguf_gemv takes float32/bf16/fp16 activations, got {x.dtype}")
    cfg = cfg or default_config(qtype, m)
    if cfg.kernel == "file":
        raise ValueError("a file-layout config runs through gguf_gemm.matmul")
    if cfg.kernel == "gemv" and m > 1 and cfg.codes != "q8":
        cfg = replace(cfg, kernel="dot")
    tiles, n_programs = k // TILE_K, triton.cdiv(n, cfg.block_n)
    if cfg.kernel == "gemv":
        return _gemv(x, raw, qtype, cfg, x8, tiles, n_programs)
    splits, per_split, y = split_output(cfg, x, n, n_programs, tiles)
    dot, code_bits, code_off = _DOT_CODES[x.dtype]
    _gemm_dot[(n_programs, splits)](
        x, raw, y, m, n, tiles, per_split, x.stride(0), raw.stride(0), y.stride(0), QTYPE=qtype,
        BLOCK_N=cfg.block_n, ATOMIC=splits > 1, DOT_DTYPE=dot, CODE_BITS=code_bits,
        CODE_OFF=code_off, num_warps=cfg.num_warps)
    return y.to(x.dtype)


def _gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int, cfg: DecodeConfig, x8,
          tiles: int, n_programs: int) -> torch.Tensor:
    """``matmul`` by the gemv kernels (float codes at M = 1, or "q8": ``gguf_q8``, at any M,
    rounding x unless ``x8`` is given), straight into an output in x's dtype (K slices
    combined in the launch, ``gguf_tiles.finish_at``)."""
    splits, per_split = _split(cfg, n_programs, tiles, x.device)
    grid = (n_programs, splits)
    y = torch.empty(x.shape[0], raw.shape[0], dtype=x.dtype, device=x.device)
    if cfg.codes == "q8":
        if qtype not in Q8_TYPES:
            raise ValueError(f"codes='q8' serves GGUF types {Q8_TYPES}, not {qtype}")
        if x8 is None:
            x8 = gguf_q8.quantize(x)
        gguf_q8.gemv(x8, raw, qtype, y, grid, per_split, cfg.block_n, cfg.blocks_per_step,
                     cfg.num_warps)
        return y
    part, cnt = split_buffers(y, splits, n_programs)
    knobs = dict(BLOCK_N=cfg.block_n, KB=cfg.blocks_per_step, SPLIT=splits > 1,
                 MODE=CODE_MODES[cfg.codes], num_warps=cfg.num_warps)
    args = (x, raw, y, part, cnt, raw.shape[0], tiles, per_split, splits)
    if qtype == Q6_K:
        _q6k_gemv[grid](*args, raw.stride(0) // 2, **knobs)
    else:
        _q45k_gemv[grid](*args, raw.stride(0) // 16, QTYPE=qtype, **knobs)
    return y
