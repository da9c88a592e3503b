"""Triton paged decode attention: split-KV (FlashDecoding) with a synchronized (online-softmax)
and an asynchronized (unified max ``phi``, FlashDecoding++ §3) softmax, plus a 4-bit KV variant
(FlexGen §5 group-wise asymmetric quantization, dequantized in registers).

Layout (DESIGN.md, PagedAttention §4.1): per layer K and V ``[num_blocks, block_size,
num_kv_heads, head_dim]``; ``block_tables`` ``[num_seqs, max_blocks]`` (int64, padded entries
ignored); ``context_lens`` ``[num_seqs]``. One program owns the ``group = num_heads //
num_kv_heads`` query heads of one KV head (GQA), so each K/V tile is read once for the group.

Stage 1 (grid ``[num_seqs, num_kv_heads, num_splits]``): each program walks its slice of the
sequence in tiles of ``BLOCK_N`` tokens and writes an unnormalized partial output ``acc``, its
denominator ``l`` and its running max ``m`` (log2 units).
  * synchronized: ``p = exp2(s - m_running)``; ``acc``/``l`` rescaled whenever the max grows.
  * asynchronized: ``p = exp2(s - phi)`` with one model-wide ``phi``: no rescaling anywhere, the
    partials combine by plain sums. The running max is kept only to detect unsafe rows.
Stage 2 (grid ``[num_seqs, num_kv_heads]``): combine the splits. Synchronized: rescale by
``exp2(m_s - max_s m_s)``. Asynchronized: plain sums; if a row's max ``x - phi`` lies outside the
safe range ``(a, b)`` its flag is set and the program recomputes its KV head's rows with the
synchronized online softmax over the whole context (rare by calibration; always correct).

Why the row max decides: with ``M = max_j x_j``, every term ``exp(x_j - phi) <= exp(M - phi)``
(no overflow when ``M - phi < b``) and the denominator is ``>= exp(M - phi)`` (no underflow of
the sum when ``M - phi > a``); a single ``x_j - phi`` below ``a`` only means that term's weight is
tiny, which is exact enough. ``x`` is the pre-softmax score ``scale * q.k`` (natural log units).

All arithmetic is float32 in registers; tensor-core dots take the cache dtype (bf16/fp16) with a
float32 accumulator. Offsets into the caches are int64 (caches beyond 2^31 elements).
"""

from __future__ import annotations

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


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      block_n: int = 64, programs_per_sm: int = 2, min_tiles_per_split: int = 2,
                      max_splits: int = 128) -> int:
    """FlashDecoding's split count: enough programs (``SMs * programs_per_sm``) to fill the GPU
    when ``num_seqs * num_kv_heads`` alone would not, with at least ``min_tiles_per_split`` tiles
    of ``block_n`` tokens per split."""
    base = max(1, num_seqs * num_kv_heads)
    want = -(-_num_sms(device) * programs_per_sm // base)
    tiles = -(-max(1, max_context_len) // block_n)
    most = max(1, tiles // min_tiles_per_split)
    return int(max(1, min(want, most, max_splits)))


# --------------------------------------------------------------------------------------------
# tile loaders (shared by stage 1 and the recompute path)
# --------------------------------------------------------------------------------------------

@triton.jit
def _token_rows(bt_row_ptr, tok, tok_mask, BS: tl.constexpr, stride_b, stride_t):
    """int64 offset of each token's row (block, slot) in a cache; masked tokens read block 0."""
    blk = tl.load(bt_row_ptr + tok // BS, mask=tok_mask, other=0).to(tl.int64)
    return blk * stride_b + (tok % BS).to(tl.int64) * stride_t


@triton.jit
def _load_kv_tile(c_ptr, s_ptr, z_ptr, rows, srows, offs_d, tok_mask, d_mask,
                  QUANT: tl.constexpr, GROUP: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D]`` float32 tile of K or V. QUANT: ``c_ptr`` holds uint8 bytes with two
    4-bit codes (even d in the low nibble), ``s_ptr``/``z_ptr`` fp16 scale/min per group of
    ``GROUP`` along head_dim (last dims contiguous)."""
    m2 = tok_mask[:, None] & d_mask[None, :]
    if QUANT:
        byte = tl.load(c_ptr + rows[:, None] + (offs_d // 2)[None, :], mask=m2, other=0).to(tl.int32)
        code = (byte >> ((offs_d % 2) * 4)[None, :]) & 15
        g = (offs_d // GROUP)[None, :]
        sc = tl.load(s_ptr + srows[:, None] + g, mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(z_ptr + srows[:, None] + g, mask=m2, other=0.0).to(tl.float32)
        x = code.to(tl.float32) * sc + mn
    else:
        x = tl.load(c_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    return x


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with float32 accumulation; operands cast to DOT_DTYPE (the model dtype)."""
    if IEEE:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)
    return r


@triton.jit
def _attend_range(q, bt_row_ptr, lo, hi,
                  k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr,
                  stride_kb, stride_kt, stride_sb, stride_st,
                  qk_scale, phi2, offs_d, d_mask,
                  BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                  GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    """Attend ``q`` ``[BLOCK_H, BLOCK_D]`` to tokens ``[lo, hi)``. Returns (acc, l, m), m the
    running max of ``s = qk_scale * q.k`` (log2 units). Synchronized: acc and l are relative to
    m. Asynchronized: relative to ``phi2`` (no rescaling)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_mask = tok < hi
        rows = _token_rows(bt_row_ptr, tok, tok_mask, BS, stride_kb, stride_kt)
        srows = rows
        if QUANT:
            srows = _token_rows(bt_row_ptr, tok, tok_mask, BS, stride_sb, stride_st)
        k = _load_kv_tile(k_ptr, ks_ptr, kz_ptr, rows, srows, offs_d, tok_mask, d_mask, QUANT, GROUP)
        s = _dot(q, tl.trans(k), DOT_DTYPE, IEEE) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        v = _load_kv_tile(v_ptr, vs_ptr, vz_ptr, rows, srows, offs_d, tok_mask, d_mask, QUANT, GROUP)
        if ASYNC:
            p = tl.exp2(s - phi2)
            l += tl.sum(p, 1)
            acc += _dot(p, v, DOT_DTYPE, IEEE)
        else:
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE, IEEE)
        m = m_new
    return acc, l, m


@triton.jit
def _decode_stage1(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
                   mid_o_ptr, mid_l_ptr, mid_m_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_sb, stride_st, stride_sh, stride_btb,
                   stride_mb, stride_mh, stride_ms,
                   qk_scale, phi2, num_splits,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   ASYNC: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
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
    q = tl.load(q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    kvh64 = kvh.to(tl.int64)
    acc, l, m = _attend_range(q, bt_ptr + seq64 * stride_btb, lo, hi,
                              k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh,
                              kz_ptr + kvh64 * stride_sh, v_ptr + kvh64 * stride_kh,
                              vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh,
                              stride_kb, stride_kt, stride_sb, stride_st,
                              qk_scale, phi2, offs_d, d_mask,
                              BS, BLOCK_H, BLOCK_N, BLOCK_D, ASYNC, QUANT, GROUP, DOT_DTYPE, IEEE)
    base = seq64 * stride_mb + heads.to(tl.int64) * stride_mh + split * stride_ms
    tl.store(mid_l_ptr + base, l, mask=h_mask)
    tl.store(mid_m_ptr + base, m, mask=h_mask)
    tl.store(mid_o_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_stage2(q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, bt_ptr, cl_ptr,
                   mid_o_ptr, mid_l_ptr, mid_m_ptr, out_ptr, flag_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_sb, stride_st, stride_sh, stride_btb,
                   stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, stride_fb,
                   qk_scale, phi2, lo2, hi2, num_splits,
                   GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, ASYNC: tl.constexpr, QUANT: tl.constexpr,
                   GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    seq64 = seq.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    h_mask = offs_h < GQA
    d_mask = offs_d < HEAD_DIM
    s_mask = offs_s < num_splits
    heads = kvh * GQA + offs_h
    hs_mask = h_mask[:, None] & s_mask[None, :]

    base = seq64 * stride_mb + heads.to(tl.int64)[:, None] * stride_mh + offs_s[None, :] * stride_ms
    m_s = tl.load(mid_m_ptr + base, mask=hs_mask, other=float("-inf"))  # [BLOCK_H, BLOCK_S]
    l_s = tl.load(mid_l_ptr + base, mask=hs_mask, other=0.0)
    big_m = tl.max(m_s, 1)  # [BLOCK_H]
    out_rows = seq64 * stride_ob + heads.to(tl.int64) * stride_oh
    row_base = seq64 * stride_mb + heads.to(tl.int64) * stride_mh  # [BLOCK_H]
    hd_mask = h_mask[:, None] & d_mask[None, :]

    if ASYNC:
        excess = big_m - phi2
        bad = ((excess <= lo2) | (excess >= hi2)) & h_mask
        tl.store(flag_ptr + seq64 * stride_fb + heads, bad.to(tl.int32), mask=h_mask)
        recompute = tl.max(bad.to(tl.int32), 0) > 0
        if recompute:
            # synchronized online softmax over the whole context, one program (FlashDecoding++ §3)
            ctx = tl.load(cl_ptr + seq).to(tl.int32)
            q = tl.load(q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=hd_mask, other=0.0)
            kvh64 = kvh.to(tl.int64)
            r_acc, r_l, r_m = _attend_range(q, bt_ptr + seq64 * stride_btb, 0, ctx,
                                            k_ptr + kvh64 * stride_kh, ks_ptr + kvh64 * stride_sh,
                                            kz_ptr + kvh64 * stride_sh, v_ptr + kvh64 * stride_kh,
                                            vs_ptr + kvh64 * stride_sh, vz_ptr + kvh64 * stride_sh,
                                            stride_kb, stride_kt, stride_sb, stride_st,
                                            qk_scale, phi2, offs_d, d_mask,
                                            BS, BLOCK_H, BLOCK_N, BLOCK_D, False, QUANT, GROUP,
                                            DOT_DTYPE, IEEE)
            r_l = tl.where(r_l == 0.0, 1.0, r_l)
            tl.store(out_ptr + out_rows[:, None] + offs_d[None, :],
                     (r_acc / r_l[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)
        else:
            # plain sums: every partial already shares the scaling exp(-phi)
            a_acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for s in range(0, num_splits):
                a_acc += tl.load(mid_o_ptr + (row_base + s * stride_ms)[:, None] * HEAD_DIM
                                 + offs_d[None, :], mask=hd_mask, other=0.0)
            a_l = tl.sum(l_s, 1)
            a_l = tl.where(a_l == 0.0, 1.0, a_l)
            tl.store(out_ptr + out_rows[:, None] + offs_d[None, :],
                     (a_acc / a_l[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        safe_m = tl.where(big_m == float("-inf"), 0.0, big_m)
        w = tl.exp2(m_s - safe_m[:, None])  # [BLOCK_H, BLOCK_S]; empty splits: exp2(-inf) = 0
        s_l = tl.sum(w * l_s, 1)
        s_l = tl.where(s_l == 0.0, 1.0, s_l)
        s_acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in range(0, num_splits):
            m_one = tl.load(mid_m_ptr + row_base + s * stride_ms, mask=h_mask, other=float("-inf"))
            w_one = tl.exp2(m_one - safe_m)
            s_acc += tl.load(mid_o_ptr + (row_base + s * stride_ms)[:, None] * HEAD_DIM
                             + offs_d[None, :], mask=hd_mask, other=0.0) * w_one[:, None]
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :],
                 (s_acc / s_l[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)


# --------------------------------------------------------------------------------------------
# python wrappers
# --------------------------------------------------------------------------------------------

def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


def _dot_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def _launch(q, k, v, block_tables, context_lens, scale, *, quant_group, phi, bounds, num_splits,
            max_context_len, block_n, num_warps, num_stages, return_flags, out):
    """Shared launcher; ``k``/``v`` are plain caches or QuantizedKV."""
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
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, kv_heads, max_context_len, q.device, block_n)
    num_splits = max(1, int(num_splits))
    is_async = phi is not None
    if is_async and bounds is None:
        bounds = DEFAULT_BOUNDS.get(q.dtype, (-64.0, 64.0))
    if out is None:
        out = torch.empty_like(q)
    flags = torch.zeros(num_seqs, num_heads, dtype=torch.int32, device=q.device)
    if num_seqs == 0:
        return (out, flags) if return_flags else out
    mid_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_l = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    mid_m = torch.empty_like(mid_l)

    if quant:
        ks, kz, vs, vz = k.scale, k.min, v.scale, v.min
        s_strides = (ks.stride(0), ks.stride(1), ks.stride(2))
        group = quant_group
    else:
        ks = kz = vs = vz = kc  # unused
        s_strides = (0, 0, 0)
        group = 1
    interp = _interpreting()
    ieee = q.dtype == torch.float32 or (interp and q.dtype == torch.bfloat16)
    dot_dtype = _dot_dtype(q.dtype)
    block_h = _pow2(gqa)
    block_d = _pow2(head_dim)
    qk_scale = float(scale) * LOG2E
    phi2 = float(phi) * LOG2E if is_async else 0.0
    lo2 = float(bounds[0]) * LOG2E if is_async else 0.0
    hi2 = float(bounds[1]) * LOG2E if is_async else 0.0
    common = dict(GQA=gqa, HEAD_DIM=head_dim, BS=bs, BLOCK_H=block_h, BLOCK_N=block_n,
                  BLOCK_D=block_d, ASYNC=is_async, QUANT=quant, GROUP=group,
                  DOT_DTYPE=dot_dtype, IEEE=ieee)
    launch = dict(num_warps=num_warps, num_stages=num_stages)
    kv_strides = (kc.stride(0), kc.stride(1), kc.stride(2))
    mid_strides = (mid_l.stride(0), mid_l.stride(1), mid_l.stride(2))
    _decode_stage1[(num_seqs, kv_heads, num_splits)](
        q, kc, ks, kz, vc, vs, vz, block_tables, context_lens, mid_o, mid_l, mid_m,
        q.stride(0), q.stride(1), *kv_strides, *s_strides, block_tables.stride(0),
        *mid_strides, qk_scale, phi2, num_splits, **common, **launch)
    _decode_stage2[(num_seqs, kv_heads)](
        q, kc, ks, kz, vc, vs, vz, block_tables, context_lens, mid_o, mid_l, mid_m, out, flags,
        q.stride(0), q.stride(1), *kv_strides, *s_strides, block_tables.stride(0),
        *mid_strides, out.stride(0), out.stride(1), flags.stride(0), qk_scale, phi2, lo2, hi2, num_splits,
        BLOCK_S=_pow2(num_splits, 1), **common, num_warps=4)
    return (out, flags) if return_flags else out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, phi: float | None = None, bounds: tuple[float, float] | None = None,
                           num_splits: int | None = None, max_context_len: int | None = None,
                           block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                           return_flags: bool = False, out: torch.Tensor | None = None):
    """Paged decode attention (FlashDecoding split-KV), the Triton twin of
    ``paged_attention_ref.paged_decode_attention``.

    q ``[num_seqs, num_heads, head_dim]`` (bf16/fp16/fp32); caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; block_tables ``[num_seqs, max_blocks]``; context_lens
    ``[num_seqs]``. ``phi=None``: synchronized online softmax. ``phi`` given: asynchronized
    softmax with unified max ``phi`` and safe range ``bounds = (a, b)`` of ``x - phi``
    (FlashDecoding++ §3; default by dtype, ``DEFAULT_BOUNDS``); rows outside it are flagged and
    recomputed synchronously. ``num_splits=None`` picks ``choose_num_splits`` (needs
    ``max_context_len``, else reads ``context_lens.max()``: one host sync). Returns
    ``[num_seqs, num_heads, head_dim]`` in q's dtype, and with ``return_flags`` also the int32
    ``[num_seqs, num_heads]`` recompute flags.
    """
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, quant_group=None,
                   phi=phi, bounds=bounds, num_splits=num_splits, max_context_len=max_context_len,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                   return_flags=return_flags, out=out)


def paged_decode_attention_int4(q: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, *, phi: float | None = None,
                                bounds: tuple[float, float] | None = None,
                                num_splits: int | None = None, max_context_len: int | None = None,
                                block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                                return_flags: bool = False, out: torch.Tensor | None = None):
    """Decode attention over a 4-bit KV cache (FlexGen §5: group-wise asymmetric, groups of
    ``group_size`` along head_dim; ``quant_ref.quantize_kv``), dequantized in registers. Same
    contract as ``paged_decode_attention``; the math runs in q's dtype/float32."""
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
                   num_stages=num_stages, return_flags=return_flags, out=out)


__all__ = ["paged_decode_attention", "paged_decode_attention_int4", "choose_num_splits",
           "DEFAULT_BOUNDS", "LOG2E"]
