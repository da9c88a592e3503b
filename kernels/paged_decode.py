"""Triton paged decode attention: split-KV (FlashDecoding) with a synchronized (online-softmax)
and an asynchronized (unified max ``phi``, FlashDecoding++ §3) softmax, plus a 4-bit KV variant
(FlexGen §5 group-wise asymmetric quantization, dequantized in registers).

Layout (DESIGN.md, PagedAttention §4.1): per layer K and V ``[num_blocks, block_size,
num_kv_heads, head_dim]``; ``block_tables`` ``[num_seqs, max_blocks]`` (int64, padded entries
ignored); ``context_lens`` ``[num_seqs]``. One program owns the ``group = num_heads //
num_kv_heads`` query heads of one KV head (GQA), so each K/V tile is read once for the group.

Stage 1 (grid ``[num_kv_heads, num_seqs, num_splits]``, heads fastest): each program walks its
slice of the sequence in tiles of ``BLOCK_N`` tokens and writes an unnormalized partial output
``acc``, its denominator ``l`` and its running max ``m`` (log2 units).
  * synchronized: ``p = exp2(s - m_running)``; ``acc``/``l`` rescaled whenever the max grows.
  * asynchronized: ``p = exp2(s - phi)`` with one model-wide ``phi``: no rescaling anywhere, the
    partials combine by plain sums. The running max is kept only to detect unsafe rows.
Stage 2 (grid ``[num_kv_heads, num_seqs]``): combine the splits. Synchronized: rescale by
``exp2(m_s - max_s m_s)``. Asynchronized: plain sums; if a row's max ``x - phi`` lies outside the
safe range ``(a, b)`` its flag is set and the program recomputes its KV head's rows with the
synchronized online softmax over the whole context (rare by calibration; always correct).

Why the row max decides: with ``M = max_j x_j``, every term ``exp(x_j - phi) <= exp(M - phi)``
(no overflow when ``M - phi < b``) and the denominator is ``>= exp(M - phi)`` (no underflow of
the sum when ``M - phi > a``); a single ``x_j - phi`` below ``a`` only means that term's weight is
tiny, which is exact enough. ``x`` is the pre-softmax score ``scale * q.k`` (natural log units).

The 4-bit variant can read each sequence's own (last) block in full precision from a pool row
(KIVI's recent tokens, ``localgen.runtime.offload.kv``): ``_attend_ctx`` attends the 4-bit part
and the pool part separately and merges the two states (``_merge``), in stage 1 and in the
recompute path alike.

All arithmetic is float32 in registers; tensor-core dots take the cache dtype (bf16/fp16) with a
float32 accumulator. Offsets into the caches are int64 (caches beyond 2^31 elements).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .quant_ref import QuantizedKV

LOG2E = 1.4426950408889634

# Safe ranges of ``x - phi`` for the asynchronized softmax, by the dtype p is cast to for the P@V
# dot. bf16/fp32 share fp32's exponent range: terms up to e^64 leave room for sums over 2^20
# tokens and |v| up to 1e3 below fp32's max (e^88.7); a row max above e^-64 keeps terms 2^-24
# below it normal. fp16: p <= 65504 = e^11.09, and e^-9 stays above fp16's smallest normal.
DEFAULT_BOUNDS = {torch.bfloat16: (-64.0, 64.0), torch.float32: (-64.0, 64.0),
                  torch.float16: (-9.0, 11.0)}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def wave_span(programs: int, saturate: int, slots: int) -> int:
    """How many programs' worth of bandwidth-time a launch of ``programs`` equal, memory-bound
    programs takes when ``slots`` of them are resident at once and ``saturate`` resident programs
    saturate HBM: full waves run at full rate; a partial last wave (or a single one) of ``n``
    programs takes as long as ``max(n, saturate)`` would."""
    full, tail = divmod(programs, slots)
    return full * slots + (max(tail, saturate) if tail else 0)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      block_n: int = 64, programs_per_sm: int = 4, min_tiles_per_split: int = 1,
                      max_splits: int = 128, resident_per_sm: int | None = None,
                      margin: float = 0.05, min_tiles_when_full: int = 8) -> int:
    """FlashDecoding's split count, at least ``min_tiles_per_split`` tiles of ``block_n`` tokens
    per split.

    Without ``resident_per_sm``: enough programs (``SMs * programs_per_sm``) to fill the GPU
    when ``num_seqs * num_kv_heads`` alone would not, else 1. With it: the fewest splits whose
    modelled time (``wave_span`` with ``programs_per_sm`` per SM saturating and
    ``resident_per_sm`` per SM resident, times the busiest split's whole tiles) is within
    ``margin`` of the best count's. The margin stands for what the model leaves out (partials
    written and combined: splitting B = 128 x 8 KV heads at 4k in 3 costs 1.2% on an H200, where
    the model promises 3%) and makes 256 programs on 132 SMs (0.97 of the 264 that saturate)
    count as full. The model splits a launch that would end in a thin last wave: B = 64 x 8 KV
    heads (512 programs, 1.3 waves) ran 11-14% faster in 2-6 splits at 16k-32k
    (docs/results/decode_splits_long_h200.txt). When the (sequence, KV head) programs alone
    saturate HBM, a split keeps at least ``min_tiles_when_full`` tiles: a short program's fixed
    costs (the partials, the combine) outweigh the thin wave: at 512-1024 tokens one split was
    the fastest or within 5% (B = 64 x 32 MHA heads at 544: 141.5 us unsplit, 179.1 in 5
    one-tile splits; docs/results/decode_splits_short_{mha,gqa}_h200.txt)."""
    base = max(1, num_seqs * num_kv_heads)
    tiles = -(-max(1, max_context_len) // block_n)
    most = max(1, min(tiles // min_tiles_per_split, max_splits))
    sms = _num_sms(device)
    if resident_per_sm is None:
        return int(min(-(-sms * programs_per_sm // base), most))
    saturate = sms * programs_per_sm
    if base >= saturate:
        most = max(1, min(most, tiles // min_tiles_when_full))
    return _wave_splits(base, tiles, most, saturate, sms * resident_per_sm, margin)


@functools.lru_cache(maxsize=4096)
def _wave_splits(base: int, tiles: int, most: int, saturate: int, slots: int,
                 margin: float) -> int:
    """``choose_num_splits``' wave-model search over 1..``most`` splits (cached: decode calls
    repeat a handful of shapes, and the search is up to 128 steps of Python)."""
    cost = {}
    for s in range(1, most + 1):
        per_split = -(-tiles // s)  # the kernel's whole-tile chunks: s may leave splits empty
        if -(-tiles // per_split) == s:
            cost[s] = per_split * wave_span(base * s, saturate, slots)
    best = min(cost.values())
    return min(s for s, c in cost.items() if c * (1 - margin) <= best)


def config_splits(cfg: dict, num_seqs: int, num_kv_heads: int, max_context_len: int,
                  device: torch.device, block_n: int | None = None) -> int:
    """``choose_num_splits`` with a ``decode_config`` result's split parameters."""
    return choose_num_splits(num_seqs, num_kv_heads, max_context_len, device,
                             block_n or cfg["block_n"], programs_per_sm=cfg["programs_per_sm"],
                             resident_per_sm=cfg.get("resident_per_sm"))


# --------------------------------------------------------------------------------------------
# tile loaders (shared by stage 1 and the recompute path)
# --------------------------------------------------------------------------------------------

@triton.jit
def _token_rows(bt_row_ptr, tok, tok_mask, BS: tl.constexpr, stride_b, stride_t):
    """int64 offset of each token's row (block, slot) in a cache; masked tokens read block 0."""
    blk = tl.load(bt_row_ptr + tok // BS, mask=tok_mask, other=0).to(tl.int64)
    return blk * stride_b + (tok % BS).to(tl.int64) * stride_t


@triton.jit
def _load_kv_tile(c_ptr, rows, offs_d, tok_mask, d_mask):
    """A ``[BLOCK_N, BLOCK_D]`` tile of K or V in the cache dtype (rows of head_dim contiguous
    elements: 16-byte vector loads, coalesced along head_dim)."""
    return tl.load(c_ptr + rows[:, None] + offs_d[None, :],
                   mask=tok_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _load_q4_raw(c_ptr, s_ptr, z_ptr, rows, srows, tok_mask,
                 HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr):
    """A 4-bit K or V tile as stored: the packed bytes as one coalesced ``[BLOCK_N, NG_P * HG]``
    uint8 tile (row-contiguous) and each group's fp16 scale and min ``[BLOCK_N, NG_P]`` (read
    once per token row). Kept apart from ``_dequant_q4`` so a tile's loads can be issued early
    while its float32 values exist only where they are used (K and V dequantized together held
    256 registers a thread at 128-token tiles, and spilled). The bytes stay 2-D, as the dots
    take them: no reshape between the load and the dot."""
    col = tl.arange(0, NG_P * HG)  # byte index in the row
    m2 = tok_mask[:, None] & (col < HALF_D)[None, :]
    byte = tl.load(c_ptr + rows[:, None] + col[None, :], mask=m2, other=0)
    offs_g = tl.arange(0, NG_P)
    gm = tok_mask[:, None] & (offs_g < NG)[None, :]
    sc = tl.load(s_ptr + srows[:, None] + offs_g[None, :], mask=gm, other=0.0)
    mn = tl.load(z_ptr + srows[:, None] + offs_g[None, :], mask=gm, other=0.0)
    return byte, sc, mn


@triton.jit
def _dequant_q4(byte, sc, mn, BLOCK_N: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr,
                BLOCK_H: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``_load_q4_raw``'s tile dequantized in registers (float32 math), split by parity of the
    head_dim index: ``(lo, hi)`` ``[BLOCK_N, NG_P * HG]``, column ``c`` holding elements ``2c``
    (low nibbles) and ``2c + 1`` (high nibbles); each group's scale and min broadcast over its
    ``HG`` columns. In DOT_DTYPE where ``_dot`` would cast them to it anyway (tensor cores: 16+
    query rows, not IEEE; half the registers), else float32."""
    b = byte.to(tl.int32)
    sc = tl.reshape(tl.broadcast_to(sc.to(tl.float32)[:, :, None], [BLOCK_N, NG_P, HG]),
                    [BLOCK_N, NG_P * HG])
    mn = tl.reshape(tl.broadcast_to(mn.to(tl.float32)[:, :, None], [BLOCK_N, NG_P, HG]),
                    [BLOCK_N, NG_P * HG])
    lo = (b & 15).to(tl.float32) * sc + mn
    hi = (b >> 4).to(tl.float32) * sc + mn
    if not IEEE:
        if BLOCK_H >= 16:
            lo = lo.to(DOT_DTYPE)
            hi = hi.to(DOT_DTYPE)
    return lo, hi


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with float32 accumulation; operands cast to DOT_DTYPE (the model dtype). Under
    16 rows (tensor cores' least M; a decode program of one query head, MHA) as float32
    multiply-adds on the CUDA cores, operands uncast: nothing padded, no tensor-core layout
    shuffles."""
    if a.shape[-2] < 16:  # the M of a (batched) matmul; 3-D operands always have 16+
        r = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif IEEE:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)
    return r


@triton.jit
def _load_q(q_ptr, q_row, head_off, h_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            QUANT: tl.constexpr, QW: tl.constexpr):
    """The query rows of one KV head (``head_off`` ``[BLOCK_H]``): ``(q, q_odd)``. Plain: ``q``
    ``[BLOCK_H, BLOCK_D]``, ``q_odd`` unused. QUANT: even / odd elements of head_dim,
    ``[BLOCK_H, QW]`` each (the int4 tiles come split by parity)."""
    base = q_ptr + q_row + head_off[:, None]
    if QUANT:
        c = tl.arange(0, QW)
        msk = h_mask[:, None] & (2 * c < HEAD_DIM)[None, :]
        qe = tl.load(base + 2 * c[None, :], mask=msk, other=0.0)
        qo = tl.load(base + 2 * c[None, :] + 1, mask=msk, other=0.0)
    else:
        d = tl.arange(0, BLOCK_D)
        qe = tl.load(base + d[None, :], mask=h_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        qo = qe
    return qe, qo


@triton.jit
def _attend_range(q, q_odd, bt_row_ptr, lo, hi,
                  k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr,
                  stride_kb, stride_kt, stride_sb, stride_st,
                  qk_scale, phi2, offs_d, d_mask,
                  BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                  HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """Attend ``q`` to tokens ``[lo, hi)``. Returns (acc, acc_odd, l, m), m the running max of
    ``s = qk_scale * q.k`` (log2 units). Plain: ``acc`` ``[BLOCK_H, BLOCK_D]``. QUANT: ``acc``
    and ``acc_odd`` ``[BLOCK_H, NG_P * HG]`` hold the even and odd output elements.
    Synchronized: acc and l are relative to m. Asynchronized: relative to ``phi2``."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    if QUANT:
        acc = tl.zeros([BLOCK_H, NG_P * HG], tl.float32)
        acc_o = tl.zeros([BLOCK_H, NG_P * HG], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        acc_o = tl.zeros([BLOCK_H, 16], tl.float32)  # unused
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_mask = tok < hi
        rows = _token_rows(bt_row_ptr, tok, tok_mask, BS, stride_kb, stride_kt)
        if QUANT:
            srows = _token_rows(bt_row_ptr, tok, tok_mask, BS, stride_sb, stride_st)
            kb, ksc, kmn = _load_q4_raw(k_ptr, ks_ptr, kz_ptr, rows, srows, tok_mask,
                                        HALF_D, NG, NG_P, HG)
            vb, vsc, vmn = _load_q4_raw(v_ptr, vs_ptr, vz_ptr, rows, srows, tok_mask,
                                        HALF_D, NG, NG_P, HG)  # issued before K is used
            k_lo, k_hi = _dequant_q4(kb, ksc, kmn, BLOCK_N, NG_P, HG, BLOCK_H, DOT_DTYPE, IEEE)
            s = (_dot(q, tl.trans(k_lo), DOT_DTYPE, IEEE)
                 + _dot(q_odd, tl.trans(k_hi), DOT_DTYPE, IEEE)) * qk_scale
            v_lo, v_hi = _dequant_q4(vb, vsc, vmn, BLOCK_N, NG_P, HG, BLOCK_H, DOT_DTYPE,
                                     IEEE)  # after K's values are dead
        else:
            k = _load_kv_tile(k_ptr, rows, offs_d, tok_mask, d_mask)
            v_lo = _load_kv_tile(v_ptr, rows, offs_d, tok_mask, d_mask)  # issued before K is used
            v_hi = v_lo  # unused
            s = _dot(q, tl.trans(k), DOT_DTYPE, IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        acc, acc_o, l, m = _online_update(s, v_lo, v_hi, acc, acc_o, l, m, phi2, ASYNC, QUANT,
                                          DOT_DTYPE, IEEE)
    return acc, acc_o, l, m


@triton.jit
def _online_update(s, v_a, v_b, acc, acc_o, l, m, phi2, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """One tile's softmax step: scores ``s`` ``[BLOCK_H, BLOCK_N]`` (log2 units, masked to
    -inf), values ``v_a`` (plain: the tile; QUANT: the even elements) and ``v_b`` (QUANT: the
    odd elements). Returns the updated (acc, acc_o, l, m)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    if ASYNC:
        p = tl.exp2(s - phi2)
        l += tl.sum(p, 1)
        acc += _dot(p, v_a, DOT_DTYPE, IEEE)
        if QUANT:
            acc_o += _dot(p, v_b, DOT_DTYPE, IEEE)
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p, v_a, DOT_DTYPE, IEEE)
        if QUANT:
            acc_o = acc_o * alpha[:, None] + _dot(p, v_b, DOT_DTYPE, IEEE)
    return acc, acc_o, l, m_new


@triton.jit
def _attend_pool(q, q_odd, pk_ptr, pv_ptr, row64, lo, hi, stride_pr, stride_pt, qk_scale, phi2,
                 BLOCK_H: tl.constexpr, OWN_N: tl.constexpr, ASYNC: tl.constexpr,
                 HALF_D: tl.constexpr, QW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 IEEE: tl.constexpr):
    """Attend to slots ``[lo, hi)`` of pool row ``row64`` (the sequence's own block in full
    precision, KIVI's recent tokens): fp K/V rows read split by parity like the int4 tiles.
    Returns a fresh (acc, acc_o, l, m) for ``_merge``; an empty range leaves m at -inf."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, QW], tl.float32)
    acc_o = tl.zeros([BLOCK_H, QW], tl.float32)
    c = tl.arange(0, QW)
    for start in range(lo, hi, OWN_N):
        tok = start + tl.arange(0, OWN_N)
        tok_mask = tok < hi
        msk = tok_mask[:, None] & (c < HALF_D)[None, :]
        off = (row64 * stride_pr + tok.to(tl.int64) * stride_pt)[:, None] + 2 * c[None, :]
        k_lo = tl.load(pk_ptr + off, mask=msk, other=0.0).to(tl.float32)
        k_hi = tl.load(pk_ptr + off + 1, mask=msk, other=0.0).to(tl.float32)
        v_lo = tl.load(pv_ptr + off, mask=msk, other=0.0).to(tl.float32)
        v_hi = tl.load(pv_ptr + off + 1, mask=msk, other=0.0).to(tl.float32)
        s = (_dot(q, tl.trans(k_lo), DOT_DTYPE, IEEE)
             + _dot(q_odd, tl.trans(k_hi), DOT_DTYPE, IEEE)) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        acc, acc_o, l, m = _online_update(s, v_lo, v_hi, acc, acc_o, l, m, phi2, ASYNC, True,
                                          DOT_DTYPE, IEEE)
    return acc, acc_o, l, m


@triton.jit
def _merge(acc, acc_o, l, m, acc2, acc_o2, l2, m2, ASYNC: tl.constexpr):
    """Combine two partial states over disjoint token ranges (asynchronized: both are relative
    to phi, plain sums; synchronized: rescaled to the larger max)."""
    m_new = tl.maximum(m, m2)
    if ASYNC:
        acc = acc + acc2
        acc_o = acc_o + acc_o2
        l = l + l2
    else:
        ref_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - ref_m)
        b = tl.exp2(m2 - ref_m)
        acc = acc * a[:, None] + acc2 * b[:, None]
        acc_o = acc_o * a[:, None] + acc_o2 * b[:, None]
        l = l * a + l2 * b
    return acc, acc_o, l, m_new


@triton.jit
def _own_start(own_ptr, seq64, ctx, BS: tl.constexpr, OWN_FP: tl.constexpr):
    """(pool row, first slot of the own block) of a sequence; without a row (or without
    OWN_FP) the own block starts at ``ctx``: everything is read 4-bit."""
    if OWN_FP:
        row = tl.load(own_ptr + seq64).to(tl.int64)
        own_lo = tl.where(row >= 0, (tl.maximum(ctx, 1) - 1) // BS * BS, ctx)
    else:
        row = seq64 * 0
        own_lo = ctx
    return row, own_lo


@triton.jit
def _attend_ctx(q, q_odd, bt_row_ptr, lo, hi, own_row, own_lo,
                k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, pk_ptr, pv_ptr,
                stride_kb, stride_kt, stride_sb, stride_st, stride_pr, stride_pt,
                qk_scale, phi2, offs_d, d_mask,
                BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr,
                DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, OWN_FP: tl.constexpr,
                OWN_N: tl.constexpr):
    """``_attend_range`` over ``[lo, hi)``; with OWN_FP the part from ``own_lo`` on (the own
    block) comes from the fp pool row instead of the 4-bit cache, merged into one state."""
    if OWN_FP:
        acc, acc_o, l, m = _attend_range(
            q, q_odd, bt_row_ptr, lo, tl.minimum(hi, own_lo), k_ptr, ks_ptr, kz_ptr, v_ptr,
            vs_ptr, vz_ptr, stride_kb, stride_kt, stride_sb, stride_st, qk_scale, phi2, offs_d,
            d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D, NG, NG_P, HG,
            DOT_DTYPE, IEEE)
        acc2, acc_o2, l2, m2 = _attend_pool(
            q, q_odd, pk_ptr, pv_ptr, own_row, tl.maximum(lo, own_lo) - own_lo, hi - own_lo,
            stride_pr, stride_pt, qk_scale, phi2, BLOCK_H, OWN_N, ASYNC, HALF_D, NG_P * HG,
            DOT_DTYPE, IEEE)
        acc, acc_o, l, m = _merge(acc, acc_o, l, m, acc2, acc_o2, l2, m2, ASYNC)
    else:
        acc, acc_o, l, m = _attend_range(
            q, q_odd, bt_row_ptr, lo, hi, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr,
            stride_kb, stride_kt, stride_sb, stride_st, qk_scale, phi2, offs_d, d_mask,
            BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE)
    return acc, acc_o, l, m


@triton.jit
def _store_rows(ptr, rows, acc, acc_o, scale, h_mask, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, QUANT: tl.constexpr, QW: tl.constexpr):
    """``ptr[rows[h] + d] = acc[h, d] * scale[h]`` (QUANT: even/odd halves interleaved)."""
    if QUANT:
        c = tl.arange(0, QW)
        msk = h_mask[:, None] & (2 * c < HEAD_DIM)[None, :]
        p = ptr + rows[:, None] + 2 * c[None, :]
        tl.store(p, (acc * scale[:, None]).to(ptr.dtype.element_ty), mask=msk)
        tl.store(p + 1, (acc_o * scale[:, None]).to(ptr.dtype.element_ty), mask=msk)
    else:
        d = tl.arange(0, BLOCK_D)
        tl.store(ptr + rows[:, None] + d[None, :], (acc * scale[:, None]).to(ptr.dtype.element_ty),
                 mask=h_mask[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def _finish(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
            mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr, pk_ptr, pv_ptr, own_ptr, seq64, kvh,
            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
            stride_sb, stride_st, stride_sh, stride_btb,
            stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
            stride_pr, stride_pt, stride_ph,
            qk_scale, phi2, lo2, hi2, num_splits,
            GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
            QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr,
            HG: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
            OWN_FP: tl.constexpr, OWN_N: tl.constexpr):
    """Combine the splits of one (sequence, KV head) into ``out``. Synchronized: rescale by
    ``exp2(m_s - max m_s)``. Asynchronized: plain sums, rows outside the safe range flagged and
    the KV head's rows recomputed by the synchronized online softmax. The partials are read
    with ``.cg`` (L2, not L1): in the fused path other programs wrote them during this launch."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, S_CHUNK)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    out_rows = seq64 * stride_ob + heads.to(tl.int64) * stride_oh
    row_base = seq64 * stride_mb + heads.to(tl.int64) * stride_mh  # [BLOCK_H]
    recompute = False
    if ASYNC:
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        m_s = tl.load(mid_m_ptr + row_base[:, None] + offs_s[None, :] * stride_ms, mask=hs_mask,
                      other=float("-inf"), cache_modifier=".cg")
        excess = tl.max(m_s, 1) - phi2
        bad = ((excess <= lo2) | (excess >= hi2)) & h_mask
        tl.store(flag_ptr + seq64 * stride_fb + heads, bad.to(tl.int32), mask=h_mask)
        recompute = tl.max(bad.to(tl.int32), 0) > 0
    if recompute:
        # synchronized online softmax over the whole context, one program (FlashDecoding++ §3)
        ctx = tl.load(cl_ptr + seq64).to(tl.int32)
        q, q_odd = _load_q(q_ptr, seq64 * stride_qb, heads * stride_qh, h_mask, HEAD_DIM, BLOCK_D,
                           QUANT, NG_P * HG)
        kvh64 = kvh.to(tl.int64)
        own_row, own_lo = _own_start(own_ptr, seq64, ctx, BS, OWN_FP)
        r_acc, r_acc_o, r_l, r_m = _attend_ctx(
            q, q_odd, bt_ptr + seq64 * stride_btb, 0, ctx, own_row, own_lo,
            k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh, kz_ptr + kvh64 * stride_sh,
            v_ptr + kvh64 * stride_kh, vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh,
            pk_ptr + kvh64 * stride_ph, pv_ptr + kvh64 * stride_ph,
            stride_kb, stride_kt, stride_sb, stride_st, stride_pr, stride_pt, qk_scale, phi2,
            offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, False, QUANT, HALF_D, NG, NG_P, HG,
            DOT_DTYPE, IEEE, OWN_FP, OWN_N)
        r_l = tl.where(r_l == 0.0, 1.0, r_l)
        _store_rows(out_ptr, out_rows, r_acc, r_acc_o, 1.0 / r_l, h_mask, HEAD_DIM, BLOCK_D,
                    QUANT, NG_P * HG)
    else:
        # all GQA heads at once, loads independent of each other (one round of L2 latency,
        # not one chain per head): m and l [BLOCK_H, BLOCK_S], partials in S_CHUNK-split tiles
        # [BLOCK_H, S_CHUNK, BLOCK_D] unrolled over BLOCK_S (a constexpr bound)
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        hs_off = row_base[:, None] + offs_s[None, :] * stride_ms
        l_s = tl.load(mid_l_ptr + hs_off, mask=hs_mask, other=0.0, cache_modifier=".cg")
        if ASYNC:
            big = tl.zeros([BLOCK_H], tl.float32)  # plain sums: every partial shares exp(-phi)
            den = tl.sum(l_s, 1)
        else:
            m_s = tl.load(mid_m_ptr + hs_off, mask=hs_mask, other=float("-inf"),
                          cache_modifier=".cg")
            big = tl.max(m_s, 1)
            big = tl.where(big == float("-inf"), 0.0, big)
            den = tl.sum(tl.exp2(m_s - big[:, None]) * l_s, 1)  # empty splits: exp2(-inf) = 0
        den = tl.where(den == 0.0, 1.0, den)
        o = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s0 in tl.static_range(0, BLOCK_S, S_CHUNK):
            sc_ = s0 + offs_c
            c_mask = h_mask[:, None] & (sc_ < num_splits)[None, :]  # [BLOCK_H, S_CHUNK]
            c_off = row_base[:, None] + sc_[None, :] * stride_ms
            part = tl.load(mid_o_ptr + c_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                           mask=c_mask[:, :, None] & d_mask[None, None, :], other=0.0,
                           cache_modifier=".cg")
            if ASYNC:
                o += tl.sum(part, 1)
            else:
                m_c = tl.load(mid_m_ptr + c_off, mask=c_mask, other=float("-inf"),
                              cache_modifier=".cg")
                o += tl.sum(part * tl.exp2(m_c - big[:, None])[:, :, None], 1)
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :],
                 (o / den[:, None]).to(out_ptr.dtype.element_ty),
                 mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_stage1(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
                   mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr, pk_ptr, pv_ptr, own_ptr, count_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_sb, stride_st, stride_sh, stride_btb,
                   stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
                   stride_pr, stride_pt, stride_ph,
                   qk_scale, phi2, lo2, hi2, num_splits, num_kv_heads,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
                   QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr,
                   NG_P: tl.constexpr, HG: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   IEEE: tl.constexpr, FUSED: tl.constexpr, ONE_SPLIT: tl.constexpr,
                   OWN_FP: tl.constexpr, OWN_N: tl.constexpr):
    """Stage 1: one split of one (sequence, KV head). ONE_SPLIT: the program owns the whole
    context and writes ``out`` itself (no partials). FUSED: after writing its partials, the
    program takes a ticket from the (sequence, KV head)'s counter; the last one to arrive
    combines the splits (``_finish``) and resets the counter, so no second launch is needed."""
    # KV heads vary fastest in the launch order: the programs running together read the same
    # tokens' rows of every head (neighbouring bytes of the cache, and of the 4-bit scale/min
    # rows, which are shorter than a memory sector per head)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    ctx = tl.load(cl_ptr + seq).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    q, q_odd = _load_q(q_ptr, seq64 * stride_qb, heads * stride_qh, h_mask, HEAD_DIM, BLOCK_D,
                       QUANT, NG_P * HG)

    kvh64 = kvh.to(tl.int64)
    own_row, own_lo = _own_start(own_ptr, seq64, ctx, BS, OWN_FP)
    pk_h = pk_ptr + kvh64 * stride_ph
    pv_h = pv_ptr + kvh64 * stride_ph
    acc, acc_o, l, m = _attend_ctx(
        q, q_odd, bt_ptr + seq64 * stride_btb, lo, hi, own_row, own_lo,
        k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh, kz_ptr + kvh64 * stride_sh,
        v_ptr + kvh64 * stride_kh, vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh,
        pk_h, pv_h, stride_kb, stride_kt, stride_sb, stride_st, stride_pr, stride_pt,
        qk_scale, phi2, offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D,
        NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N)
    if ONE_SPLIT:
        out_rows = seq64 * stride_ob + heads.to(tl.int64) * stride_oh
        recompute = False
        if ASYNC:
            excess = m - phi2
            bad = ((excess <= lo2) | (excess >= hi2)) & h_mask
            tl.store(flag_ptr + seq64 * stride_fb + heads, bad.to(tl.int32), mask=h_mask)
            recompute = tl.max(bad.to(tl.int32), 0) > 0
        if recompute:
            r_acc, r_acc_o, r_l, r_m = _attend_ctx(
                q, q_odd, bt_ptr + seq64 * stride_btb, 0, ctx, own_row, own_lo,
                k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh, kz_ptr + kvh64 * stride_sh,
                v_ptr + kvh64 * stride_kh, vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh,
                pk_h, pv_h, stride_kb, stride_kt, stride_sb, stride_st, stride_pr, stride_pt,
                qk_scale, phi2, offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, False, QUANT,
                HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N)
            r_l = tl.where(r_l == 0.0, 1.0, r_l)
            _store_rows(out_ptr, out_rows, r_acc, r_acc_o, 1.0 / r_l, h_mask, HEAD_DIM, BLOCK_D,
                        QUANT, NG_P * HG)
        else:
            l = tl.where(l == 0.0, 1.0, l)
            _store_rows(out_ptr, out_rows, acc, acc_o, 1.0 / l, h_mask, HEAD_DIM, BLOCK_D,
                        QUANT, NG_P * HG)
    else:
        base = seq64 * stride_mb + heads.to(tl.int64) * stride_mh + split * stride_ms
        tl.store(mid_l_ptr + base, l, mask=h_mask)
        tl.store(mid_m_ptr + base, m, mask=h_mask)
        _store_rows(mid_o_ptr, base * HEAD_DIM, acc, acc_o, tl.full([BLOCK_H], 1.0, tl.float32),
                    h_mask, HEAD_DIM, BLOCK_D, QUANT, NG_P * HG)
        if FUSED:
            # every thread's partials are written before the ticket (barrier, then one
            # acq_rel gpu-scope atomic: the cooperative-groups grid-sync pattern)
            tl.debug_barrier()
            cnt_ptr = count_ptr + seq * num_kv_heads + kvh
            ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                _finish(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
                        mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr, pk_ptr, pv_ptr, own_ptr,
                        seq64, kvh,
                        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_sb, stride_st, stride_sh, stride_btb,
                        stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
                        stride_pr, stride_pt, stride_ph,
                        qk_scale, phi2, lo2, hi2, num_splits,
                        GQA, HEAD_DIM, BS, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_S, S_CHUNK, ASYNC,
                        QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N)
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _decode_stage2(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
                   mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr, pk_ptr, pv_ptr, own_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_sb, stride_st, stride_sh, stride_btb,
                   stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
                   stride_pr, stride_pt, stride_ph,
                   qk_scale, phi2, lo2, hi2, num_splits,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
                   QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr,
                   NG_P: tl.constexpr, HG: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   IEEE: tl.constexpr, OWN_FP: tl.constexpr, OWN_N: tl.constexpr):
    """Stage 2 (unfused path), grid ``[num_kv_heads, num_seqs]``: ``_finish``."""
    _finish(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
            mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr, pk_ptr, pv_ptr, own_ptr,
            tl.program_id(1).to(tl.int64), tl.program_id(0),
            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
            stride_sb, stride_st, stride_sh, stride_btb,
            stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
            stride_pr, stride_pt, stride_ph,
            qk_scale, phi2, lo2, hi2, num_splits,
            GQA, HEAD_DIM, BS, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_S, S_CHUNK, ASYNC,
            QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N)


# --------------------------------------------------------------------------------------------
# launch configuration (chosen offline on an H200, scripts/decode_sweep.py; no runtime autotune,
# so the kernels stay capturable in CUDA graphs)
# --------------------------------------------------------------------------------------------

def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def _dot_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def decode_config(num_seqs: int, num_kv_heads: int, max_context_len: int, head_dim: int,
                  device: torch.device, quant: bool = False, gqa: int = 0) -> dict:
    """Launch parameters by shape: ``block_n`` (tokens per tile), ``num_warps``, ``num_stages``,
    ``programs_per_sm`` and ``resident_per_sm`` (split-KV, ``choose_num_splits``) and ``fused``
    (the last split combines the partials in-kernel: one launch). From the H200 sweeps
    (scripts/decode_sweep.py, docs/results/kernels_bench_h200_v2.txt, decode_splits_long_h200):
    128-token tiles with 4 warps and a 2-deep pipeline beat 32/64-token tiles, 8 warps and 3
    stages at every measured shape; for bf16 about two programs per SM (one 64 KiB K+V tile pair
    each in flight) saturate HBM and three are resident (512 programs, 1.3 waves, ran at 0.87-0.89
    of 256 or 768 programs' rate; decode_kernel_resources_h200.txt: 158-168 registers and 72 KiB of
    shared memory a program allow three); the int4 cache (a quarter of the bytes per token, 249-255
    registers: two resident) wants about four per SM below 256 (sequence, KV head) programs and no
    split above (re-swept with the 2-D tiles, decode_sweep_int4_h200_v2: 128-token tiles with 4
    warps best or within 3% everywhere; 8 warps slower everywhere).
    The int4 cache under MHA (``gqa`` 1: one query head a program) runs its dots on the CUDA
    cores in 64-token tiles with 2 warps: 68 us against the tensor-core tiles' 88 us at
    Llama-2-7B's 16 x 32 heads x 544 tokens on an H100 (scripts/decode_shape_sweep.py,
    docs/results/decode_shape_sweep_h100.txt); with GQA the CUDA-core dots lose everywhere
    measured (4 query heads: 2.3x to 5x slower)."""
    del head_dim, device  # one table for now (measured at head_dim 128, bf16)
    if not quant:
        return dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=2, resident_per_sm=3,
                    fused=True, min_block_h=16)
    base = num_seqs * num_kv_heads
    if base >= 256:  # enough (sequence, KV head) programs without splitting
        pps = 1
    else:
        pps = 2 if (base <= 8 and max_context_len > 4096) else 4
    if gqa == 1:
        return dict(block_n=64, num_warps=2, num_stages=2, programs_per_sm=pps, fused=True,
                    min_block_h=1)
    return dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=pps, fused=True,
                min_block_h=16)


_COUNTERS: dict = {}


def _flags_buffer(flags, num_seqs: int, num_heads: int, device, is_async: bool, wanted: bool):
    """The int32 ``[num_seqs, num_heads]`` recompute flags, or None when nobody needs them.
    The async kernels store every row's flag, so their buffer needs no clearing (a memset would
    be a second launch on every call, ~1.5 us at decode sizes); the sync kernels store none, so
    their returned flags are zeros."""
    if not wanted:
        return None
    if flags is None:
        alloc = torch.empty if is_async else torch.zeros
        return alloc(num_seqs, num_heads, dtype=torch.int32, device=device)
    if flags.shape != (num_seqs, num_heads) or flags.dtype != torch.int32 \
            or flags.stride(-1) != 1:
        raise ValueError(f"flags must be contiguous int32 [{num_seqs}, {num_heads}], got "
                         f"{flags.dtype} {tuple(flags.shape)}")
    if not is_async:
        flags.zero_()
    return flags


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-device int32 tickets for the fused combine; every launch leaves them at zero. Not
    safe for two fused launches running concurrently on one device (use ``fused=False``)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _launch(q, k, v, block_tables, context_lens, scale, *, quant_group, phi, bounds, num_splits,
            max_context_len, block_n, num_warps, num_stages, return_flags, out, fused=None,
            own=None, block_h=None, flags=None):
    """Shared launcher; ``k``/``v`` are plain caches or QuantizedKV; ``own`` = (pool K, pool V,
    row per sequence) for the int4 cache's fp own blocks, or None."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    quant = quant_group is not None
    kc = k.packed if quant else k
    vc = v.packed if quant else v
    num_blocks, bs, kv_heads = kc.shape[:3]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_heads}")
    if kc.stride(-1) != 1 or vc.stride(-1) != 1 or kc.stride() != vc.stride():
        raise ValueError("K and V caches need the same strides and a contiguous last dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    gqa = num_heads // kv_heads
    block_tables = block_tables if block_tables.dtype in (torch.int32, torch.int64) \
        else block_tables.long()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    cfg = decode_config(num_seqs, kv_heads, max_context_len, head_dim, q.device, quant, gqa)
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    fused = cfg["fused"] if fused is None else fused
    block_h = _pow2(gqa, cfg["min_block_h"]) if block_h is None else _pow2(block_h, 1)
    if block_h < gqa:
        raise ValueError(f"block_h {block_h} holds fewer rows than the {gqa} query heads "
                         "of a KV head")
    if num_splits is None:
        num_splits = config_splits(cfg, num_seqs, kv_heads, max_context_len, q.device, block_n)
    num_splits = max(1, int(num_splits))
    is_async = phi is not None
    if is_async and bounds is None:
        bounds = DEFAULT_BOUNDS.get(q.dtype, (-64.0, 64.0))
    if out is None:
        out = torch.empty_like(q)
    flags = _flags_buffer(flags, num_seqs, num_heads, q.device, is_async,
                          return_flags or is_async)
    if flags is None:
        flags = out  # never written: the sync kernels store no flags
    if num_seqs == 0:
        return (out, flags) if return_flags else out
    one_split = num_splits == 1
    ms = 1 if one_split else num_splits
    if one_split:  # no partials: tiny placeholders
        mid_o = mid_l = mid_m = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    else:
        mid_o = torch.empty(num_seqs, num_heads, ms, head_dim, dtype=torch.float32,
                            device=q.device)
        mid_l = torch.empty(num_seqs, num_heads, ms, dtype=torch.float32, device=q.device)
        mid_m = torch.empty_like(mid_l)
    use_fused = fused and not one_split
    count = _counters(q.device, num_seqs * kv_heads) if use_fused else mid_l

    if quant:
        ks, kz, vs, vz = k.scale, k.min, v.scale, v.min
        s_strides = (ks.stride(0), ks.stride(1), ks.stride(2))
        group = int(quant_group)
        if group % 2 or group & (group - 1):
            raise ValueError(f"int4 group size must be an even power of two, got {group}")
        ng = -(-head_dim // group)
        qdims = dict(HALF_D=head_dim // 2, NG=ng, NG_P=_pow2(ng, 1), HG=group // 2)
        if qdims["NG_P"] * qdims["HG"] < 16:
            raise ValueError("int4 decode needs head_dim / 2 >= 16 (tensor-core dot width)")
    else:
        ks = kz = vs = vz = kc  # unused
        s_strides = (0, 0, 0)
        qdims = dict(HALF_D=1, NG=1, NG_P=1, HG=1)
    if own is not None:
        pk, pv, own_rows = own
        if not quant or pk.shape[1:] != (bs, kv_heads, head_dim) or pv.shape != pk.shape \
                or pk.stride() != pv.stride() or pk.stride(-1) != 1 or own_rows.shape != (num_seqs,):
            raise ValueError(f"own-block pool: K {tuple(pk.shape)}, V {tuple(pv.shape)}, rows "
                             f"{tuple(own_rows.shape)} do not match an int4 cache of block size "
                             f"{bs}, {kv_heads} KV heads, head_dim {head_dim}, {num_seqs} sequences")
        p_strides = (pk.stride(0), pk.stride(1), pk.stride(2))
    else:
        pk = pv = own_rows = kc  # unused
        p_strides = (0, 0, 0)
    interp = _interpreting()
    ieee = q.dtype == torch.float32 or (interp and q.dtype == torch.bfloat16)
    dot_dtype = _dot_dtype(q.dtype)
    block_d = _pow2(head_dim)
    block_s = _pow2(ms, 1)
    qk_scale = float(scale) * LOG2E
    phi2 = float(phi) * LOG2E if is_async else 0.0
    lo2 = float(bounds[0]) * LOG2E if is_async else 0.0
    hi2 = float(bounds[1]) * LOG2E if is_async else 0.0
    common = dict(GQA=gqa, HEAD_DIM=head_dim, BS=bs, BLOCK_H=block_h, BLOCK_N=block_n,
                  BLOCK_D=block_d, BLOCK_S=block_s, S_CHUNK=min(block_s, max(1, 32 // block_h)), ASYNC=is_async,
                  QUANT=quant, **qdims, DOT_DTYPE=dot_dtype, IEEE=ieee, OWN_FP=own is not None,
                  OWN_N=_pow2(bs))
    kv_strides = (kc.stride(0), kc.stride(1), kc.stride(2))
    mid_strides = (mid_l.stride(0), mid_l.stride(1), mid_l.stride(2)) if not one_split else (0, 0, 0)
    f_stride = flags.stride(0) if flags is not out else 0
    _decode_stage1[(kv_heads, num_seqs, num_splits)](
        q, kc, ks, kz, vc, vs, vz, block_tables, context_lens, mid_o, mid_l, mid_m, out, flags,
        pk, pv, own_rows, count, q.stride(0), q.stride(1), *kv_strides, *s_strides,
        block_tables.stride(0), *mid_strides, out.stride(0), out.stride(1), f_stride, *p_strides,
        qk_scale, phi2, lo2, hi2,
        num_splits, kv_heads, **common, FUSED=use_fused, ONE_SPLIT=one_split,
        num_warps=num_warps, num_stages=num_stages)
    if not one_split and not use_fused:
        _decode_stage2[(kv_heads, num_seqs)](
            q, kc, ks, kz, vc, vs, vz, block_tables, context_lens, mid_o, mid_l, mid_m, out, flags,
            pk, pv, own_rows, q.stride(0), q.stride(1), *kv_strides, *s_strides,
            block_tables.stride(0), *mid_strides, out.stride(0), out.stride(1), f_stride,
            *p_strides, qk_scale, phi2, lo2, hi2,
            num_splits, **common, num_warps=4)
    if return_flags:
        return out, flags
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, phi: float | None = None, bounds: tuple[float, float] | None = None,
                           num_splits: int | None = None, max_context_len: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, fused: bool | None = None,
                           return_flags: bool = False, out: torch.Tensor | None = None,
                           block_h: int | None = None, flags: torch.Tensor | None = None):
    """Paged decode attention (FlashDecoding split-KV), the Triton twin of
    ``paged_attention_ref.paged_decode_attention``.

    q ``[num_seqs, num_heads, head_dim]`` (bf16/fp16/fp32); caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; block_tables ``[num_seqs, max_blocks]``; context_lens
    ``[num_seqs]``. ``phi=None``: synchronized online softmax. ``phi`` given: asynchronized
    softmax with unified max ``phi`` and safe range ``bounds = (a, b)`` of ``x - phi``
    (FlashDecoding++ §3; default by dtype, ``DEFAULT_BOUNDS``); rows outside it are flagged and
    recomputed synchronously. ``num_splits``/``block_n``/``num_warps``/``num_stages``/``fused``
    default to ``decode_config`` by shape (``num_splits`` needs ``max_context_len``, else reads
    ``context_lens.max()``: one host sync). ``fused``: the last split of each (sequence, KV
    head) combines the partials in the same launch (a per-device ticket counter; do not run two
    fused calls concurrently on one device). ``block_h``: query rows per program (rounded up to
    a power of two, at least the GQA group); below 16 the dots run on the CUDA cores, at 16 and
    above on the tensor cores (default: ``decode_config``). ``flags``: an int32 ``[num_seqs,
    num_heads]`` buffer for the recompute flags (default: a fresh one). Returns ``[num_seqs,
    num_heads, head_dim]`` in q's dtype, and with ``return_flags`` also the recompute flags (1:
    the row was recomputed synchronously; all 0 for the sync path). Raises ValueError when
    ``block_h`` is below the GQA group or ``flags`` has the wrong shape or dtype.
    """
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, quant_group=None,
                   phi=phi, bounds=bounds, num_splits=num_splits, max_context_len=max_context_len,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                   return_flags=return_flags, out=out, fused=fused, block_h=block_h,
                   flags=flags)


def paged_decode_attention_int4(q: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, *, phi: float | None = None,
                                bounds: tuple[float, float] | None = None,
                                num_splits: int | None = None, max_context_len: int | None = None,
                                block_n: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None, fused: bool | None = None,
                                return_flags: bool = False, out: torch.Tensor | None = None,
                                block_h: int | None = None,
                                own_k: torch.Tensor | None = None, own_v: torch.Tensor | None = None,
                                own_rows: torch.Tensor | None = None,
                                flags: torch.Tensor | None = None):
    """Decode attention over a 4-bit KV cache (FlexGen §5: group-wise asymmetric, groups of
    ``group_size`` along head_dim; ``quant_ref.quantize_kv``), dequantized in registers: the
    packed bytes are read as coalesced tiles, each group's scale/min once per token, and the
    nibbles unpacked by parity (even elements from low nibbles, odd from high), so the two
    halves of q.k and p@V are two tensor-core dots each. Same contract as
    ``paged_decode_attention``; the math runs in q's dtype/float32.

    Own block in full precision (KIVI, Liu et al. 2024, §3.3; ``localgen.runtime.offload.kv``'s
    recent-block pool): with ``own_k``/``own_v`` ``[pool_rows, block_size, num_kv_heads,
    head_dim]`` (q's dtype) and ``own_rows`` ``[num_seqs]`` (int), sequence i reads the slots of
    its last block (positions ``block_size * ((ctx - 1) // block_size)`` .. ``ctx - 1``) from
    pool row ``own_rows[i]`` and every earlier block 4-bit; ``own_rows[i] < 0`` reads all of it
    4-bit. Raises ValueError when the pool's shape does not match the cache."""
    if k_cache.group_size != v_cache.group_size:
        raise ValueError("K and V must share the quantization group size")
    for c in (k_cache, v_cache):
        if c.scale.stride() != c.min.stride() or c.scale.stride(-1) != 1:
            raise ValueError("scale and min need identical strides, contiguous last dim")
    if k_cache.scale.stride() != v_cache.scale.stride():
        raise ValueError("K and V scales need the same strides")
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale,
                   quant_group=k_cache.group_size, phi=phi, bounds=bounds, num_splits=num_splits,
                   max_context_len=max_context_len, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, return_flags=return_flags, out=out, fused=fused,
                   own=None if own_k is None else (own_k, own_v, own_rows), block_h=block_h,
                   flags=flags)


__all__ = ["paged_decode_attention", "paged_decode_attention_int4", "choose_num_splits",
           "config_splits", "wave_span", "decode_config", "DEFAULT_BOUNDS", "LOG2E"]
