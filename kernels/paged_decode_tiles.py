"""Tile-level Triton functions of the paged decode kernel (``paged_decode``): loading K/V tiles
(plain or 4-bit), the online-softmax step, attending a token range of one KV head, and storing
a head group's rows. Shared by stage 1 and the combine/recompute path.

Arguments that travel together are tuples: ``cache`` = the K, K-scale, K-min, V, V-scale and
V-min pointers of one KV head (the scale/min pointers unused for plain caches); ``cache_strides``
= (K/V stride per KV block, per slot, scale stride per KV block, per slot); ``pool`` = the
full-precision pool's K and V pointers of one KV head and ``pool_strides`` = (per row, per slot).
The softmax runs in log2 units: ``qk_scale`` includes log2(e), ``phi2`` is the unified max.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .score_features import soft_capped
from .triton_common import dot, token_rows


@triton.jit
def at_kv_head(cache, pool, kvh64, head_strides):
    """``cache`` and ``pool`` pointers moved to KV head ``kvh64``; ``head_strides`` = (K/V,
    scale/min, pool) strides per KV head."""
    stride_kh, stride_sh, stride_ph = head_strides
    k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr = cache
    pk_ptr, pv_ptr = pool
    return ((k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh, kz_ptr + kvh64 * stride_sh,
             v_ptr + kvh64 * stride_kh, vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh),
            (pk_ptr + kvh64 * stride_ph, pv_ptr + kvh64 * stride_ph))


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
    while its float32 values exist only where they are used (K and V dequantized together would
    hold enough registers a thread to spill). The bytes stay 2-D, as the dots take them: no
    reshape between the load and the dot."""
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
    ``HG`` columns. In DOT_DTYPE where ``dot`` would cast them to it anyway (tensor cores: 16+
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
def load_q(q_ptr, q_row, head_off, h_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
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
def _attend_range(q, q_odd, bt_row_ptr, lo, hi, cache, cache_strides, qk_scale, phi2, offs_d,
                  d_mask, BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                  HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP2: tl.constexpr):
    """Attend ``q`` to tokens ``[lo, hi)`` of the paged cache. Returns (acc, acc_odd, l, m), m the
    running max of ``s = qk_scale * q.k`` (log2 units; soft-capped by ``SOFTCAP2`` when it is
    not 0). Plain: ``acc`` ``[BLOCK_H, BLOCK_D]``.
    QUANT: ``acc`` and ``acc_odd`` ``[BLOCK_H, NG_P * HG]`` hold the even and odd output
    elements. Synchronized: acc and l are relative to m. Asynchronized: relative to ``phi2``."""
    k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr = cache
    stride_kb, stride_kt, stride_sb, stride_st = cache_strides
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
        rows = token_rows(bt_row_ptr, tok, tok_mask, BS, stride_kb, stride_kt)
        if QUANT:
            srows = token_rows(bt_row_ptr, tok, tok_mask, BS, stride_sb, stride_st)
            kb, ksc, kmn = _load_q4_raw(k_ptr, ks_ptr, kz_ptr, rows, srows, tok_mask,
                                        HALF_D, NG, NG_P, HG)
            vb, vsc, vmn = _load_q4_raw(v_ptr, vs_ptr, vz_ptr, rows, srows, tok_mask,
                                        HALF_D, NG, NG_P, HG)  # issued before K is used
            k_lo, k_hi = _dequant_q4(kb, ksc, kmn, BLOCK_N, NG_P, HG, BLOCK_H, DOT_DTYPE, IEEE)
            s = (dot(q, tl.trans(k_lo), DOT_DTYPE, IEEE)
                 + dot(q_odd, tl.trans(k_hi), DOT_DTYPE, IEEE)) * qk_scale
            v_lo, v_hi = _dequant_q4(vb, vsc, vmn, BLOCK_N, NG_P, HG, BLOCK_H, DOT_DTYPE,
                                     IEEE)  # after K's values are dead
        else:
            k = _load_kv_tile(k_ptr, rows, offs_d, tok_mask, d_mask)
            v_lo = _load_kv_tile(v_ptr, rows, offs_d, tok_mask, d_mask)  # issued before K is used
            v_hi = v_lo  # unused
            s = dot(q, tl.trans(k), DOT_DTYPE, IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_mask[None, :], soft_capped(s, SOFTCAP2), float("-inf"))
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
        acc += dot(p, v_a, DOT_DTYPE, IEEE)
        if QUANT:
            acc_o += dot(p, v_b, DOT_DTYPE, IEEE)
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p, v_a, DOT_DTYPE, IEEE)
        if QUANT:
            acc_o = acc_o * alpha[:, None] + dot(p, v_b, DOT_DTYPE, IEEE)
    return acc, acc_o, l, m_new


@triton.jit
def _attend_pool(q, q_odd, pool, row64, lo, hi, pool_strides, qk_scale, phi2,
                 BLOCK_H: tl.constexpr, OWN_N: tl.constexpr, ASYNC: tl.constexpr,
                 HALF_D: tl.constexpr, QW: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 IEEE: tl.constexpr, SOFTCAP2: tl.constexpr):
    """Attend to slots ``[lo, hi)`` of pool row ``row64`` (the sequence's own KV block in full
    precision, KIVI's recent tokens): fp K/V rows read split by parity like the int4 tiles.
    Returns a fresh (acc, acc_o, l, m) for ``_merge``; an empty range leaves m at -inf."""
    pk_ptr, pv_ptr = pool
    stride_pr, stride_pt = pool_strides
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
        s = (dot(q, tl.trans(k_lo), DOT_DTYPE, IEEE)
             + dot(q_odd, tl.trans(k_hi), DOT_DTYPE, IEEE)) * qk_scale
        s = tl.where(tok_mask[None, :], soft_capped(s, SOFTCAP2), float("-inf"))
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
def own_start(own_ptr, seq64, ctx, BS: tl.constexpr, OWN_FP: tl.constexpr):
    """(pool row, first slot of the own KV block) of a sequence; without a row (or without
    OWN_FP) the own block starts at ``ctx``: everything is read 4-bit."""
    if OWN_FP:
        row = tl.load(own_ptr + seq64).to(tl.int64)
        own_lo = tl.where(row >= 0, (tl.maximum(ctx, 1) - 1) // BS * BS, ctx)
    else:
        row = seq64 * 0
        own_lo = ctx
    return row, own_lo


@triton.jit
def attend_ctx(q, q_odd, bt_row_ptr, lo, hi, own_row, own_lo, cache, pool, cache_strides,
               pool_strides, qk_scale, phi2, offs_d, d_mask,
               BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
               HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr, HG: tl.constexpr,
               DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, OWN_FP: tl.constexpr,
               OWN_N: tl.constexpr, SOFTCAP2: tl.constexpr):
    """``_attend_range`` over ``[lo, hi)``; with OWN_FP the part from ``own_lo`` on (the own
    KV block) comes from the fp pool row instead of the 4-bit cache, merged into one state."""
    if OWN_FP:
        acc, acc_o, l, m = _attend_range(
            q, q_odd, bt_row_ptr, lo, tl.minimum(hi, own_lo), cache, cache_strides, qk_scale,
            phi2, offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D, NG, NG_P,
            HG, DOT_DTYPE, IEEE, SOFTCAP2)
        acc2, acc_o2, l2, m2 = _attend_pool(
            q, q_odd, pool, own_row, tl.maximum(lo, own_lo) - own_lo, hi - own_lo, pool_strides,
            qk_scale, phi2, BLOCK_H, OWN_N, ASYNC, HALF_D, NG_P * HG, DOT_DTYPE, IEEE, SOFTCAP2)
        acc, acc_o, l, m = _merge(acc, acc_o, l, m, acc2, acc_o2, l2, m2, ASYNC)
    else:
        acc, acc_o, l, m = _attend_range(
            q, q_odd, bt_row_ptr, lo, hi, cache, cache_strides, qk_scale, phi2, offs_d, d_mask,
            BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE,
            SOFTCAP2)
    return acc, acc_o, l, m


@triton.jit
def store_rows(ptr, rows, acc, acc_o, scale, h_mask, HEAD_DIM: tl.constexpr,
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


__all__ = ["at_kv_head", "load_q", "own_start", "attend_ctx", "store_rows"]
