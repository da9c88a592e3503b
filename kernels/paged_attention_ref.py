"""Pure-torch paged attention: the reference twin of the Triton kernels (with their sliding
window, logit soft-cap and sinks: ``feature_attention``), and the CPU path.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``;
a sequence's tokens live in the blocks its block table lists, in order (PagedAttention, §4.1).
GQA/MQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at flat slots
    ``block_id * block_size + offset`` (``slot_mapping``: ``[num_tokens]``, int64)."""
    kv_heads, head_dim = k_cache.shape[-2:]
    for cache, x in ((k_cache, k), (v_cache, v)):
        # no cast when the dtypes match: a .to() call is a dispatch even when it returns x
        x = x if x.dtype == cache.dtype else x.to(cache.dtype)
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, x)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    return cache[block_table[:n_blocks]].flatten(0, 1)[:length]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q: ``[num_seqs, num_heads, head_dim]``; block_tables: ``[num_seqs, max_blocks]`` (int, padded
    entries ignored); context_lens: ``[num_seqs]`` tokens in the cache, incl. the current one.
    Returns ``[num_seqs, num_heads, head_dim]`` in q's dtype (fused SDPA, float accumulation).
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    n_blocks = -(-max_len // block_size)
    flat = block_tables[:, :n_blocks].reshape(-1)
    # gather each sequence's blocks, then view as [B, kvh, L, d] (strided, no second copy)
    k = k_cache.index_select(0, flat).view(num_seqs, -1, kv_heads, head_dim)[:, :max_len]
    v = v_cache.index_select(0, flat).view(num_seqs, -1, kv_heads, head_dim)[:, :max_len]
    # the query heads sharing a KV head act as that head's queries: GQA without repeating K/V
    qg = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None].to(q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: list[int],
                            query_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention for packed variable-length queries over their cached context.

    q: ``[sum(query_lens), num_heads, head_dim]``; sequence ``i``'s queries are its last
    ``query_lens[i]`` tokens of ``context_lens[i]`` (tokens before them are a reused prefix).
    Returns ``[sum(query_lens), num_heads, head_dim]``.
    """
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    outs, start = [], 0
    for i, (ctx, ql) in enumerate(zip(context_lens, query_lens)):
        qi = q[start:start + ql].transpose(0, 1)  # [H, ql, d]
        k = gather_kv(k_cache, block_tables[i], ctx).transpose(0, 1)  # [kvh, ctx, d]
        v = gather_kv(v_cache, block_tables[i], ctx).transpose(0, 1)
        if ctx == ql:  # nothing cached before these queries: plain causal attention
            mask, causal = None, True
        else:  # key j is visible to query t (absolute position ctx - ql + t) when j <= it
            qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= qpos, False
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=kv_heads != num_heads)
        outs.append(o.transpose(0, 1))
        start += ql
    return torch.cat(outs, dim=0)


def feature_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, first: int,
                      scale: float, sliding_window: int | None = None,
                      logit_softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's queries q ``[n, num_heads, head_dim]`` at positions ``first .. first+n-1``
    over its keys/values ``[ctx, num_kv_heads, head_dim]`` (positions ``0 .. ctx-1``), causal,
    in float32 arithmetic; returned in q's dtype. GQA: query head h reads KV head ``h // (num_heads
    // num_kv_heads)``.

    ``sliding_window``: a query at p sees keys ``p - sliding_window + 1 .. p`` (Mistral, Jiang et
    al. 2023 §2; transformers' convention). ``logit_softcap``: scores ``c * tanh(s / c)`` before
    the masks (Gemma 2, Team Gemma 2024 §2). ``sinks``: ``[num_heads]`` logits, head h's softmax
    denominator gains ``exp(sinks[h])`` with no value attached (gpt-oss). None: off."""
    n, num_heads, _ = q.shape
    ctx, kv_heads = keys.shape[:2]
    group = num_heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logit_softcap is not None:
        s = logit_softcap * torch.tanh(s / logit_softcap)
    qpos = torch.arange(first, first + n, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    visible = kpos <= qpos
    if sliding_window is not None:
        visible &= kpos > qpos - sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.device, torch.float32)[:, None, None].expand(num_heads, n, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :ctx]
    out = torch.einsum("hqk,khd->qhd", p, vals.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)


def paged_feature_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: list[int],
                            query_lens: list[int], scale: float,
                            sliding_window: int | None = None, logit_softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``feature_attention`` of each sequence's packed queries (q ``[num_tokens, num_heads,
    head_dim]``, ``query_lens[i]`` of them, the last ones of its ``context_lens[i]`` positions)
    over its context gathered from the paged caches through ``block_tables``: the twin of the
    Triton prefill and decode kernels with their window, soft-cap and sinks. q's shape and
    dtype."""
    out, start = torch.empty_like(q), 0
    for i, (ctx, ql) in enumerate(zip(context_lens, query_lens)):
        keys = gather_kv(k_cache, block_tables[i], ctx)
        vals = gather_kv(v_cache, block_tables[i], ctx)
        out[start:start + ql] = feature_attention(q[start:start + ql], keys, vals, ctx - ql, scale,
                                                  sliding_window, logit_softcap, sinks)
        start += ql
    return out
