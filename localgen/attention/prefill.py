"""Prefill attention in torch: whole prompts over their own k/v (no read-back from any cache),
with every ``AttentionSpec`` feature (``fresh_feature_attention``), and the CPU's packed
variable-length prefill over the paged cache. Same math as
``paged_attention_ref.paged_prefill_attention`` / ``feature_attention``."""

from __future__ import annotations

import functools
from typing import Iterator

import torch

from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.spec import AttentionSpec
from localgen.kernels import paged_attention_ref as ref

# Queries per SDPA call in CPU prefill: torch's CPU flash kernel computes every query block
# against all keys even when causal (one 512-key block), so chunks of 64 queries that see only
# the keys up to their last position skip the masked upper triangle.
PREFILL_QUERY_CHUNK = 64
# Queries per call of the float32 reference attention with score features (window, soft-cap,
# sinks): it materialises the scores, so a call's memory is this many rows of keys per head.
FEATURE_QUERY_CHUNK = 256


@functools.lru_cache(maxsize=256)
def _causal_chunk_mask(a: int, e: int, device: torch.device) -> torch.Tensor:
    """``[e - a, e]`` bool: query ``a + t`` sees keys ``0 .. a + t``."""
    return torch.ones(e - a, e, dtype=torch.bool, device=device).tril_(a)


def _attend_fresh_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      n: int, ql: int, scale: float, query_chunk: int | None) -> None:
    """``n`` whole prompts of ``ql`` tokens (packed rows of q/k/v, written into ``out``) attend
    causally over their own k/v in batched 4-D SDPA calls (4-D inputs take torch's flash kernel,
    where 3-D GQA inputs fall back to the unfused math path); ``query_chunk`` queries a call over
    the keys they can see, or all at once with ``is_causal`` (None)."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = k.shape[1]
    qb = q.view(n, ql, num_heads, head_dim).transpose(1, 2)
    kb = k.view(n, ql, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    vb = v.view(n, ql, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    ob = out.view(n, ql, num_heads, head_dim)
    gqa = kv_heads != num_heads
    if query_chunk is None:
        ob.copy_(torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, scale=scale, enable_gqa=gqa, is_causal=True).transpose(1, 2))
        return
    for a in range(0, ql, query_chunk):
        e = min(ql, a + query_chunk)
        ob[:, a:e] = torch.nn.functional.scaled_dot_product_attention(
            qb[:, :, a:e], kb[:, :, :e], vb[:, :, :e], scale=scale, enable_gqa=gqa,
            attn_mask=_causal_chunk_mask(a, e, q.device)).transpose(1, 2)


def equal_runs(keys: list) -> Iterator[tuple[int, int]]:
    """``(i, j)`` index ranges of the consecutive equal items of ``keys``."""
    i = 0
    while i < len(keys):
        j = i + 1
        while j < len(keys) and keys[j] == keys[i]:
            j += 1
        yield i, j
        i = j


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            query_lens: list[int], scale: float,
                            query_chunk: int | None = None) -> torch.Tensor:
    """Causal attention of packed whole prompts (nothing cached before them) over their own k/v,
    not read back from any cache: q ``[num_tokens, num_heads, head_dim]``, k/v with the KV heads;
    runs of equal-length prompts attend together. Returns ``[num_tokens, num_heads, head_dim]``."""
    out = torch.empty_like(q)
    start = 0
    for i, j in equal_runs(query_lens):
        end = start + (j - i) * query_lens[i]
        _attend_fresh_run(q[start:end], k[start:end], v[start:end], out[start:end], j - i,
                          query_lens[i], scale, query_chunk)
        start = end
    return out


def fresh_feature_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            query_lens: list[int], spec: AttentionSpec,
                            query_chunk: int = FEATURE_QUERY_CHUNK) -> torch.Tensor:
    """Packed whole prompts (nothing cached before them; ``query_lens[i]`` rows of sequence i)
    attending causally over their own k/v with ``spec``'s window, soft-cap and sinks
    (``paged_attention_ref.feature_attention``, float32 arithmetic): q ``[num_tokens, num_heads,
    head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``; returns q's shape and dtype.

    ``query_chunk`` queries a call, each chunk over only the keys it can see (up to its last
    position, and no further back than the window), so the float32 scores of a call are at most
    ``num_heads × query_chunk × keys`` however long the prompt: a sliding layer's are bounded by
    the window, a full layer's grow with the prompt but not with its square."""
    out, start = torch.empty_like(q), 0
    window = spec.sliding_window
    for n in query_lens:
        for a in range(0, n, query_chunk):
            e = min(n, a + query_chunk)
            ks = 0 if window is None else max(0, a - window + 1)
            out[start + a:start + e] = ref.feature_attention(
                q[start + a:start + e], k[start + ks:start + e], v[start + ks:start + e], a - ks,
                spec.scale, window, spec.logit_softcap, spec.sinks)
        start += n
    return out


def cpu_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of packed variable-length prompts on the CPU. Runs of consecutive
    sequences with nothing cached before their queries and the same length attend together over
    this step's own k/v (no gather from the cache; ``_attend_fresh_run``), ``PREFILL_QUERY_CHUNK``
    queries a call over the keys they can see; a sequence with a cached prefix attends over its
    gathered context with a causal offset mask.
    Same math as ``paged_attention_ref.paged_prefill_attention``."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = kv.k_cache.shape[2]
    gqa = kv_heads != num_heads
    out = torch.empty_like(q)
    lens = list(zip(meta.context_lens_list, meta.query_lens))
    start = 0
    for i, j in equal_runs(lens):
        ctx, ql = lens[i]
        if ctx == ql:  # a run of fresh prompts of one length: batched, chunked calls
            end = start + (j - i) * ql
            _attend_fresh_run(q[start:end], k[start:end], v[start:end], out[start:end], j - i, ql,
                              scale, PREFILL_QUERY_CHUNK)
            start = end
            continue
        for s in range(i, j):  # a cached prefix: each sequence over its own gathered context
            kc = ref.gather_kv(kv.k_cache, meta.block_tables[s], ctx).transpose(0, 1)[None]
            vc = ref.gather_kv(kv.v_cache, meta.block_tables[s], ctx).transpose(0, 1)[None]
            qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos  # key j visible to query t
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:start + ql].transpose(0, 1)[None], kc.to(q.dtype), vc.to(q.dtype),
                attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start:start + ql] = o[0].transpose(0, 1)
            start += ql
    return out
