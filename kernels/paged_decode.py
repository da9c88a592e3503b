"""Triton paged decode attention: split-KV (FlashDecoding) with a synchronized (online-softmax)
and an asynchronized (unified max ``phi``, FlashDecoding++ §3) softmax, plus a 4-bit KV variant
(FlexGen §5 group-wise asymmetric quantization, dequantized in registers).

Layout (PagedAttention §4.1): per layer K and V ``[num_blocks, block_size,
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

A sliding window, a logit soft-cap and sink logits (``score_features``) are constexpr switches
of the same kernels: a windowed query's splits share the keys from its window's first one on,
the cap applies to every tile's scores, and the sink terms join the denominators where a row
is normalized (stage 1's single pass, the combine, the recompute).

The kernel's compile-time switches are named by ``DecodeModes`` (softmax, cache format, own
KV block, single pass or split, fused combine, score features), its launch arguments packed
in one place (``decode_args.DecodeArgs``); the tile-level functions are in
``paged_decode_tiles``, the launch parameters by shape in ``decode_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_args import (DecodeModes, checked_inputs, flags_buffer, int4_geometry,
                          pack_args)
from .decode_splits import (choose_num_splits, config_splits, decode_config,  # noqa: F401
                            wave_span)
from .paged_decode_tiles import at_kv_head, attend_ctx, load_q, own_start, store_rows
from .quant_ref import QuantizedKV
from .score_features import ScoreFeatures, sinks_arg, window_start, with_sink, with_sink_max
from .triton_common import LOG2E, dot_dtype, ieee_dots, pow2, tickets

# Safe ranges of ``x - phi`` for the asynchronized softmax, by the dtype p is cast to for the P@V
# dot. bf16/fp32 share fp32's exponent range: terms up to e^64 leave room for sums over 2^20
# tokens and |v| up to 1e3 below fp32's max (e^88.7); a row max above e^-64 keeps terms 2^-24
# below it normal. fp16: p <= 65504 = e^11.09, and e^-9 stays above fp16's smallest normal.
DEFAULT_BOUNDS = {torch.bfloat16: (-64.0, 64.0), torch.float32: (-64.0, 64.0),
                  torch.float16: (-9.0, 11.0)}


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _flag_unsafe(row_max, phi2, lo2, hi2, h_mask, flag_row_ptr, heads):
    """Asynchronized softmax: flag the rows whose max ``x - phi`` (log2 units) lies outside the
    safe range ``(lo2, hi2)``; returns whether any row of the head group needs a recompute."""
    excess = row_max - phi2
    bad = ((excess <= lo2) | (excess >= hi2)) & h_mask
    tl.store(flag_row_ptr + heads, bad.to(tl.int32), mask=h_mask)
    return tl.max(bad.to(tl.int32), 0) > 0


@triton.jit
def _recompute_rows(q, q_odd, bt_row_ptr, lo, ctx, own_row, own_lo, cache, pool, cache_strides,
                    pool_strides, qk_scale, phi2, sinks_ptr, heads, offs_d, d_mask, out_ptr,
                    out_rows, h_mask,
                    HEAD_DIM: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                    HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr,
                    HG: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
                    OWN_FP: tl.constexpr, OWN_N: tl.constexpr, SOFTCAP2: tl.constexpr,
                    SINKS: tl.constexpr):
    """The head group's rows by the synchronized online softmax over the visible context
    ``[lo, ctx)``, one program (FlashDecoding++ §3's fallback), stored to ``out``."""
    r_acc, r_acc_o, r_l, r_m = attend_ctx(
        q, q_odd, bt_row_ptr, lo, ctx, own_row, own_lo, cache, pool, cache_strides,
        pool_strides, qk_scale, phi2, offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, False,
        QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N, SOFTCAP2)
    r_l = with_sink(r_l, r_m, sinks_ptr, heads, h_mask, SINKS)
    r_l = tl.where(r_l == 0.0, 1.0, r_l)
    store_rows(out_ptr, out_rows, r_acc, r_acc_o, 1.0 / r_l, h_mask, HEAD_DIM, BLOCK_D, QUANT,
               NG_P * HG)


@triton.jit
def _finish(seq64, kvh, q_ptr, cache, pool, own_ptr, bt_ptr, cl_ptr, parts, out_ptr, flag_ptr,
            strides, softmax, num_splits,
            GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
            QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr,
            HG: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
            OWN_FP: tl.constexpr, OWN_N: tl.constexpr, WINDOW: tl.constexpr,
            SOFTCAP2: tl.constexpr, SINKS: tl.constexpr):
    """Combine the splits of one (sequence, KV head) into ``out``. Synchronized: rescale by
    ``exp2(m_s - max m_s)``. Asynchronized: plain sums, rows outside the safe range flagged and
    the KV head's rows recomputed by the synchronized online softmax. The partials are read
    with ``.cg`` (L2, not L1): in the fused path other programs wrote them during this launch."""
    q_st, cache_st, head_st, pool_st, part_st, out_st, stride_btb, stride_fb = strides
    stride_mb, stride_mh, stride_ms = part_st
    mid_o_ptr, mid_l_ptr, mid_m_ptr = parts
    qk_scale, phi2, lo2, hi2, sinks_ptr = softmax
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, S_CHUNK)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    out_rows = seq64 * out_st[0] + heads.to(tl.int64) * out_st[1]
    row_base = seq64 * stride_mb + heads.to(tl.int64) * stride_mh  # [BLOCK_H]
    recompute = False
    if ASYNC:
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        m_s = tl.load(mid_m_ptr + row_base[:, None] + offs_s[None, :] * stride_ms, mask=hs_mask,
                      other=float("-inf"), cache_modifier=".cg")
        recompute = _flag_unsafe(with_sink_max(tl.max(m_s, 1), sinks_ptr, heads, h_mask, SINKS),
                                 phi2, lo2, hi2, h_mask, flag_ptr + seq64 * stride_fb, heads)
    if recompute:
        ctx = tl.load(cl_ptr + seq64).to(tl.int32)
        q, q_odd = load_q(q_ptr, seq64 * q_st[0], heads * q_st[1], h_mask, HEAD_DIM, BLOCK_D,
                          QUANT, NG_P * HG)
        own_row, own_lo = own_start(own_ptr, seq64, ctx, BS, OWN_FP)
        cache_h, pool_h = at_kv_head(cache, pool, kvh.to(tl.int64), head_st)
        _recompute_rows(q, q_odd, bt_ptr + seq64 * stride_btb, window_start(ctx - 1, WINDOW),
                        ctx, own_row, own_lo, cache_h, pool_h, cache_st, pool_st, qk_scale, phi2,
                        sinks_ptr, heads, offs_d, d_mask, out_ptr, out_rows, h_mask, HEAD_DIM, BS,
                        BLOCK_H, BLOCK_N, BLOCK_D, QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE,
                        OWN_FP, OWN_N, SOFTCAP2, SINKS)
    else:
        # all GQA heads at once, loads independent of each other (one round of L2 latency,
        # not one chain per head): m and l [BLOCK_H, BLOCK_S], partials in S_CHUNK-split tiles
        # [BLOCK_H, S_CHUNK, BLOCK_D] unrolled over BLOCK_S (a constexpr bound)
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        hs_off = row_base[:, None] + offs_s[None, :] * stride_ms
        l_s = tl.load(mid_l_ptr + hs_off, mask=hs_mask, other=0.0, cache_modifier=".cg")
        if ASYNC:
            big = tl.zeros([BLOCK_H], tl.float32)  # plain sums: every partial shares exp(-phi)
            den = with_sink(tl.sum(l_s, 1), phi2, sinks_ptr, heads, h_mask, SINKS)
        else:
            m_s = tl.load(mid_m_ptr + hs_off, mask=hs_mask, other=float("-inf"),
                          cache_modifier=".cg")
            big = tl.max(m_s, 1)
            big = tl.where(big == float("-inf"), 0.0, big)
            den = tl.sum(tl.exp2(m_s - big[:, None]) * l_s, 1)  # empty splits: exp2(-inf) = 0
            den = with_sink(den, big, sinks_ptr, heads, h_mask, SINKS)
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
def _decode_stage1(q_ptr, cache, pool, own_ptr, bt_ptr, cl_ptr, parts, out_ptr, flag_ptr,
                   strides, softmax, num_splits, count_ptr, num_kv_heads,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
                   QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr,
                   NG_P: tl.constexpr, HG: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   IEEE: tl.constexpr, FUSED: tl.constexpr, ONE_SPLIT: tl.constexpr,
                   OWN_FP: tl.constexpr, OWN_N: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP2: tl.constexpr, SINKS: tl.constexpr):
    """Stage 1: one split of one (sequence, KV head). ONE_SPLIT: the program owns the whole
    context and writes ``out`` itself (no partials). FUSED: after writing its partials, the
    program takes a ticket from the (sequence, KV head)'s counter; the last one to arrive
    combines the splits (``_finish``) and resets the counter, so no second launch is needed.
    The arguments are packed by ``decode_args.DecodeArgs``."""
    # KV heads vary fastest in the launch order: the programs running together read the same
    # tokens' rows of every head (neighbouring bytes of the cache, and of the 4-bit scale/min
    # rows, which are shorter than a memory sector per head)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_st, cache_st, head_st, pool_st, part_st, out_st, stride_btb, stride_fb = strides
    qk_scale, phi2, lo2, hi2, sinks_ptr = softmax
    seq64 = seq.to(tl.int64)
    ctx = tl.load(cl_ptr + seq).to(tl.int32)
    # the splits share the keys the query sees: from the window's first one (KV blocks before
    # it are never read; the table may point them at a released placeholder)
    first = window_start(ctx - 1, WINDOW)
    chunk = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, ctx)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_h
    q, q_odd = load_q(q_ptr, seq64 * q_st[0], heads * q_st[1], h_mask, HEAD_DIM, BLOCK_D,
                      QUANT, NG_P * HG)
    own_row, own_lo = own_start(own_ptr, seq64, ctx, BS, OWN_FP)
    cache_h, pool_h = at_kv_head(cache, pool, kvh.to(tl.int64), head_st)
    bt_row = bt_ptr + seq64 * stride_btb
    acc, acc_o, l, m = attend_ctx(
        q, q_odd, bt_row, lo, hi, own_row, own_lo, cache_h, pool_h, cache_st, pool_st,
        qk_scale, phi2, offs_d, d_mask, BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, HALF_D,
        NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N, SOFTCAP2)
    if ONE_SPLIT:
        out_rows = seq64 * out_st[0] + heads.to(tl.int64) * out_st[1]
        recompute = False
        if ASYNC:
            recompute = _flag_unsafe(with_sink_max(m, sinks_ptr, heads, h_mask, SINKS), phi2,
                                     lo2, hi2, h_mask, flag_ptr + seq64 * stride_fb, heads)
        if recompute:
            _recompute_rows(q, q_odd, bt_row, first, ctx, own_row, own_lo, cache_h, pool_h,
                            cache_st, pool_st, qk_scale, phi2, sinks_ptr, heads, offs_d, d_mask,
                            out_ptr, out_rows, h_mask, HEAD_DIM, BS, BLOCK_H, BLOCK_N, BLOCK_D,
                            QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N, SOFTCAP2,
                            SINKS)
        else:
            if ASYNC:
                l = with_sink(l, phi2, sinks_ptr, heads, h_mask, SINKS)
            else:
                l = with_sink(l, m, sinks_ptr, heads, h_mask, SINKS)
            l = tl.where(l == 0.0, 1.0, l)
            store_rows(out_ptr, out_rows, acc, acc_o, 1.0 / l, h_mask, HEAD_DIM, BLOCK_D,
                       QUANT, NG_P * HG)
    else:
        mid_o_ptr, mid_l_ptr, mid_m_ptr = parts
        base = seq64 * part_st[0] + heads.to(tl.int64) * part_st[1] + split * part_st[2]
        tl.store(mid_l_ptr + base, l, mask=h_mask)
        tl.store(mid_m_ptr + base, m, mask=h_mask)
        store_rows(mid_o_ptr, base * HEAD_DIM, acc, acc_o, tl.full([BLOCK_H], 1.0, tl.float32),
                   h_mask, HEAD_DIM, BLOCK_D, QUANT, NG_P * HG)
        if FUSED:
            # every thread's partials are written before the ticket (barrier, then one
            # acq_rel gpu-scope atomic: the cooperative-groups grid-sync pattern)
            tl.debug_barrier()
            cnt_ptr = count_ptr + seq * num_kv_heads + kvh
            ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                _finish(seq64, kvh, q_ptr, cache, pool, own_ptr, bt_ptr, cl_ptr, parts, out_ptr,
                        flag_ptr, strides, softmax, num_splits,
                        GQA, HEAD_DIM, BS, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_S, S_CHUNK, ASYNC,
                        QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N, WINDOW,
                        SOFTCAP2, SINKS)
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _decode_stage2(q_ptr, cache, pool, own_ptr, bt_ptr, cl_ptr, parts, out_ptr, flag_ptr,
                   strides, softmax, num_splits,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, S_CHUNK: tl.constexpr, ASYNC: tl.constexpr,
                   QUANT: tl.constexpr, HALF_D: tl.constexpr, NG: tl.constexpr,
                   NG_P: tl.constexpr, HG: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   IEEE: tl.constexpr, OWN_FP: tl.constexpr, OWN_N: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP2: tl.constexpr, SINKS: tl.constexpr):
    """Stage 2 (unfused path), grid ``[num_kv_heads, num_seqs]``: ``_finish``."""
    _finish(tl.program_id(1).to(tl.int64), tl.program_id(0), q_ptr, cache, pool, own_ptr, bt_ptr,
            cl_ptr, parts, out_ptr, flag_ptr, strides, softmax, num_splits,
            GQA, HEAD_DIM, BS, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_S, S_CHUNK, ASYNC,
            QUANT, HALF_D, NG, NG_P, HG, DOT_DTYPE, IEEE, OWN_FP, OWN_N, WINDOW, SOFTCAP2,
            SINKS)


def _launch(q, k, v, block_tables, context_lens, scale, modes: DecodeModes, *, quant_group, phi,
            bounds, num_splits, max_context_len, block_n, num_warps, num_stages, return_flags,
            out, fused=None, own=None, block_h=None, flags=None, sinks=None):
    """Shared launcher; ``k``/``v`` are plain caches or QuantizedKV (``modes.int4``); ``own`` =
    (pool K, pool V, row per sequence) for the int4 cache's fp own KV blocks, or None;
    ``sinks``: the ``[num_heads]`` sink logits when ``modes.features.sinks``."""
    kc = k.packed if modes.int4 else k
    vc = v.packed if modes.int4 else v
    q, block_tables = checked_inputs(q, kc, vc, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = kc.shape[2]
    gqa = num_heads // kv_heads
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    # the longest stretch of keys one sequence's program walks: its window, at most
    span = min(max_context_len, modes.features.window or max_context_len)
    cfg = decode_config(num_seqs, kv_heads, span, head_dim, q.device, modes.int4, gqa)
    block_n = cfg["block_n"] if block_n is None else block_n
    block_h = pow2(gqa, cfg["min_block_h"]) if block_h is None else pow2(block_h, 1)
    if block_h < gqa:
        raise ValueError(f"block_h {block_h} holds fewer rows than the {gqa} query heads "
                         "of a KV head")
    if num_splits is None:
        num_splits = config_splits(cfg, num_seqs, kv_heads, span, q.device, block_n)
    num_splits = max(1, int(num_splits))
    fused = cfg["fused"] if fused is None else fused
    modes = modes.single_pass() if num_splits == 1 else modes.split(fused)
    if modes.async_softmax and bounds is None:
        bounds = DEFAULT_BOUNDS.get(q.dtype, (-64.0, 64.0))
    if out is None:
        out = torch.empty_like(q)
    flags = flags_buffer(flags, num_seqs, num_heads, q.device, modes.async_softmax,
                          return_flags or modes.async_softmax)
    if flags is None:
        flags = out  # never written: the sync kernels store no flags
    if num_seqs == 0:
        return (out, flags) if return_flags else out
    block_s = pow2(num_splits, 1)
    geometry = dict(GQA=gqa, HEAD_DIM=head_dim, BS=kc.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
                    BLOCK_D=pow2(head_dim), BLOCK_S=block_s,
                    S_CHUNK=min(block_s, max(1, 32 // block_h)),
                    **int4_geometry(quant_group, head_dim), DOT_DTYPE=dot_dtype(q.dtype),
                    IEEE=ieee_dots(q.dtype), OWN_N=pow2(kc.shape[1]))
    args = pack_args(q, k, v, kc, vc, own, block_tables, context_lens, out, flags, scale, phi,
                     bounds, num_splits, sinks_arg(sinks, num_heads, q.device))
    count = tickets(q.device, num_seqs * kv_heads) if modes.fused else args.parts[1]
    _decode_stage1[(kv_heads, num_seqs, num_splits)](
        *args.stage1(count, kv_heads), **geometry, **modes.stage1_constexprs(),
        num_warps=cfg["num_warps"] if num_warps is None else num_warps,
        num_stages=cfg["num_stages"] if num_stages is None else num_stages)
    if modes.combine_launch:
        _decode_stage2[(kv_heads, num_seqs)](*args.stage2(), **geometry, **modes.constexprs(),
                                             num_warps=4)
    return (out, flags) if return_flags else out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, phi: float | None = None, bounds: tuple[float, float] | None = None,
                           num_splits: int | None = None, max_context_len: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, fused: bool | None = None,
                           return_flags: bool = False, out: torch.Tensor | None = None,
                           block_h: int | None = None, flags: torch.Tensor | None = None,
                           sliding_window: int | None = None, logit_softcap: float | None = None,
                           sinks: torch.Tensor | None = None):
    """Paged decode attention (FlashDecoding split-KV), the Triton twin of
    ``paged_attention_ref.paged_decode_attention`` (``paged_feature_attention`` with the
    features below).

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

    Features (``score_features``; each compiles its own kernel, None: off): ``sliding_window``,
    the query (position ``context_len - 1``) sees the last ``sliding_window`` keys and KV blocks
    before them are never read; ``logit_softcap`` c, scores ``c * tanh(s / c)``; ``sinks``, a
    float ``[num_heads]`` tensor of sink logits joining each head's softmax denominator. Raises
    ValueError for a window below 1, a cap that is not positive, or sinks of another shape.
    """
    features = ScoreFeatures.of(sliding_window, logit_softcap, sinks)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale,
                   DecodeModes.plain(async_softmax=phi is not None, features=features),
                   quant_group=None, phi=phi, bounds=bounds, num_splits=num_splits,
                   max_context_len=max_context_len, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, return_flags=return_flags, out=out, fused=fused,
                   block_h=block_h, flags=flags, sinks=sinks)


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
                                flags: torch.Tensor | None = None,
                                sliding_window: int | None = None,
                                logit_softcap: float | None = None,
                                sinks: torch.Tensor | None = None):
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
    4-bit. Raises ValueError when the pool's shape does not match the cache. ``sliding_window``,
    ``logit_softcap``, ``sinks``: as ``paged_decode_attention``'s."""
    if k_cache.group_size != v_cache.group_size:
        raise ValueError("K and V must share the quantization group size")
    for c in (k_cache, v_cache):
        if c.scale.stride() != c.min.stride() or c.scale.stride(-1) != 1:
            raise ValueError("scale and min need identical strides, contiguous last dim")
    if k_cache.scale.stride() != v_cache.scale.stride():
        raise ValueError("K and V scales need the same strides")
    modes = DecodeModes.int4_cache(async_softmax=phi is not None, own_fp=own_k is not None,
                                   features=ScoreFeatures.of(sliding_window, logit_softcap, sinks))
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, modes,
                   quant_group=k_cache.group_size, phi=phi, bounds=bounds, num_splits=num_splits,
                   max_context_len=max_context_len, block_n=block_n, num_warps=num_warps,
                   num_stages=num_stages, return_flags=return_flags, out=out, fused=fused,
                   own=None if own_k is None else (own_k, own_v, own_rows), block_h=block_h,
                   flags=flags, sinks=sinks)


__all__ = ["paged_decode_attention", "paged_decode_attention_int4", "choose_num_splits",
           "config_splits", "wave_span", "decode_config", "DecodeModes", "DEFAULT_BOUNDS", "LOG2E"]
