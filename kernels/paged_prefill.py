"""Triton causal prefill attention over the paged KV cache for packed variable-length sequences,
the twin of ``paged_attention_ref.paged_prefill_attention``.

Sequence ``i`` contributes its last ``query_lens[i]`` tokens (of ``context_lens[i]``) as packed
queries ``q[cu[i]:cu[i+1]]``; the tokens before them (a reused prefix) and the new ones are all in
the cache already (written by ``write_kv``). Query ``t`` sits at absolute position
``context_len - query_len + t`` and sees keys ``0..position`` (causal). FlashAttention-style online
softmax in float32; one program per (sequence, query head, ``BLOCK_M`` queries); K/V read through
the block table with int64 offsets.

A sliding window, a logit soft-cap and sink logits (``score_features``) are constexpr switches:
a query block's key loop starts at its first query's window (KV blocks before it are never
read) and masks each row's own window start; scores are capped before the masks; each head's
sink term joins the denominator at the end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .score_features import ScoreFeatures, sinks_arg, soft_capped, window_start, with_sink
from .triton_common import LOG2E, dot, dot_dtype, ieee_dots, pow2, token_rows


# The block table's address and row stride follow the batch: the graphs' tables are rows of a
# static one at any 8-byte offset, an eager prefill's a fresh tensor, and the stride is the
# table's width (1, 16, any other). Specialized (16-byte alignment, stride class), each would
# compile its own kernel in the first step that reaches it, as an eager prefill past a cached
# prefix does; the kernel reads the table a scalar a KV block, so alignment buys nothing.
PER_BATCH_ARGS = ["bt_ptr", "stride_btb"]


@triton.jit(do_not_specialize=PER_BATCH_ARGS)
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, cl_ptr, out_ptr, sinks_ptr,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
                    stride_ot, stride_oh, qk_scale,
                    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
                    SOFTCAP2: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(cl_ptr + seq).to(tl.int32)
    first = ctx - q_len  # absolute position of the first query

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    pos = first + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qd_mask = row_mask[:, None] & d_mask[None, :]
    tok_idx = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok_idx[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=qd_mask, other=0.0)

    # keys needed by this block: its first query's window start .. its last query's position
    # (none if the block is past q_len)
    lo = window_start(first + mblk * BLOCK_M, WINDOW)
    hi = tl.minimum(ctx, first + (mblk + 1) * BLOCK_M)
    hi = tl.where(mblk * BLOCK_M < q_len, hi, 0)
    kvh = (head // GQA).to(tl.int64)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    kp = k_ptr + kvh * stride_kh
    vp = v_ptr + kvh * stride_kh

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_mask = tok < hi
        trow = token_rows(bt_row, tok, tok_mask, BS, stride_kb, stride_kt)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(kp + trow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = soft_capped(dot(q, tl.trans(k), DOT_DTYPE, IEEE) * qk_scale, SOFTCAP2)
        visible = (tok[None, :] <= pos[:, None]) & tok_mask[None, :]
        if WINDOW > 0:
            visible &= tok[None, :] >= window_start(pos, WINDOW)[:, None]
        s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(vp + trow[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p, v, DOT_DTYPE, IEEE)
        m = m_new
    l = with_sink(l, m, sinks_ptr, head + rows * 0, row_mask, SINKS)
    l = tl.where(l == 0.0, 1.0, l)
    o = acc / l[:, None]
    tl.store(out_ptr + tok_idx[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens, query_lens, scale: float,
                            *, block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                            num_stages: int = 2, out: torch.Tensor | None = None,
                            sliding_window: int | None = None, logit_softcap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            lens: "PrefillLens | None" = None) -> torch.Tensor:
    """q ``[sum(query_lens), num_heads, head_dim]``; caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; ``context_lens``/``query_lens`` lists of ints (or 1-D tensors).
    Returns ``[sum(query_lens), num_heads, head_dim]`` in q's dtype. ``lens``: the same lengths
    already on q's device (``prefill_lens``), for a caller that runs several layers on them: no
    host-to-device copy here then, which a CUDA graph could not capture.

    Features (None: off; each compiles its own kernel): ``sliding_window``, a query at p sees
    keys ``p - sliding_window + 1 .. p``; ``logit_softcap`` c, scores ``c * tanh(s / c)``;
    ``sinks``, float ``[num_heads]`` sink logits joining each head's softmax denominator (the
    twin: ``paged_attention_ref.paged_feature_attention``). Raises ValueError for a window below
    1, a cap that is not positive, sinks of another shape, or mismatched lengths."""
    features = ScoreFeatures.of(sliding_window, logit_softcap, sinks)
    total, num_heads, head_dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_heads}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches need the same strides and a contiguous last dim")
    ql = [int(x) for x in query_lens]
    cl = [int(x) for x in context_lens]
    if sum(ql) != total:
        raise ValueError(f"sum(query_lens)={sum(ql)} != q.shape[0]={total}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if not ql or total == 0:
        return out
    cu_t, cl_t = lens if lens is not None else prefill_lens(cl, ql, q.device)
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    block_m = min(block_m, pow2(max(ql)))
    grid = (len(ql), num_heads, triton.cdiv(max(ql), block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, bt, cu_t, cl_t, out, sinks_arg(sinks, num_heads, q.device),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bt.stride(0), out.stride(0), out.stride(1), float(scale) * LOG2E,
        GQA=num_heads // kv_heads, HEAD_DIM=head_dim, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=pow2(head_dim), DOT_DTYPE=dot_dtype(q.dtype),
        IEEE=ieee_dots(q.dtype), **features.constexprs(),
        num_warps=num_warps, num_stages=num_stages)
    return out


class PrefillLens(NamedTuple):
    """A prefill's lengths on the device, int32: ``cu_query`` ``[num_seqs + 1]`` (the packed
    rows' offsets) and ``context`` ``[num_seqs]``."""

    cu_query: torch.Tensor
    context: torch.Tensor


def prefill_lens(context_lens, query_lens, device) -> PrefillLens:
    """``context_lens`` and ``query_lens`` (lists of ints) as ``PrefillLens`` on ``device``."""
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + int(n))
    cl = [int(x) for x in context_lens]
    return PrefillLens(torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
                       torch.tensor(cl, dtype=torch.int32).to(device, non_blocking=True))


def fresh_rows(query_lens, device) -> torch.Tensor:
    """``[num_seqs, max(query_lens)]`` int64: row i lists sequence i's rows of the packed k/v
    (the block table ``fresh_prefill_attention`` reads them through); entries past a sequence's
    length repeat the last row and are never read (keys stop at its context length)."""
    ql = [int(x) for x in query_lens]
    starts = torch.tensor([0] + ql[:-1]).cumsum(0)
    rows = (starts[:, None] + torch.arange(max(ql))[None, :]).clamp_(max=sum(ql) - 1)
    return rows.to(device)


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens,
                            scale: float, rows: torch.Tensor | None = None,
                            **features) -> torch.Tensor:
    """Whole prompts (nothing cached before them) attending over their own packed k/v
    ``[sum(query_lens), num_kv_heads, head_dim]`` instead of a cache; q, ``features`` and the
    result as in ``paged_prefill_attention``. The packed rows are read as a cache of one-token KV
    blocks whose block table is ``rows`` (``fresh_rows``, built here when None), so the same
    kernel runs (the twin: ``localgen.attention.prefill.fresh_feature_attention``)."""
    ql = [int(x) for x in query_lens]
    if not ql or not sum(ql):
        return torch.empty_like(q)
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if rows is None:
        rows = fresh_rows(ql, q.device)
    return paged_prefill_attention(q, k.unsqueeze(1), v.unsqueeze(1), rows, ql, ql, scale,
                                   **features)


__all__ = ["PrefillLens", "fresh_prefill_attention", "fresh_rows", "paged_prefill_attention",
           "prefill_lens"]
