"""The one attention call site of every model: write new K/V into the paged cache, then attend.

On CUDA, when triton imports, the Triton kernels run (``localgen.kernels.paged_decode`` /
``paged_prefill``); elsewhere the pure-torch reference twin runs, unchanged. Layout and names follow
PagedAttention (block tables, slot mapping).

Decode uses the synchronized split-KV kernel unless ``set_async_softmax(phi, (a, b))`` configured
the unified max value of FlashDecoding++ §3 (from ``profiles/softmax_<model>.json``, written by
``python -m localgen.bench.calibrate_softmax``).

``set_score_observer(fn)`` installs a hook called as ``fn(q, kv, meta, scale)`` after the new K/V
are written (calibration reads pre-softmax scores through it); off by default, one ``is None``
test per call when off.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from localgen.kernels import paged_attention_ref as ref
from localgen.kv.cpu_decode import CpuDecodePlan, cpu_decode_attention  # noqa: F401 (re-exported)

ScoreObserver = Callable[[torch.Tensor, "LayerKV", "AttentionMetadata", float], None]
_score_observer: ScoreObserver | None = None
_async_softmax: tuple[float, tuple[float, float] | None] | None = None
_triton_mods = None  # (paged_decode, paged_prefill) once imported; False when triton is missing


def set_score_observer(fn: ScoreObserver | None) -> ScoreObserver | None:
    """Install (or with None remove) the score observer; returns the previous one."""
    global _score_observer
    prev, _score_observer = _score_observer, fn
    return prev


def set_async_softmax(phi: float | None, bounds: tuple[float, float] | None = None) -> None:
    """Use the asynchronized softmax with unified max ``phi`` and safe range ``bounds`` of
    ``x - phi`` for CUDA decode (FlashDecoding++ §3); ``phi=None`` returns to synchronized."""
    global _async_softmax
    _async_softmax = None if phi is None else (float(phi), bounds)


def _triton():
    global _triton_mods
    if _triton_mods is None:
        try:
            from localgen.kernels import kv_write, paged_decode, paged_prefill
            _triton_mods = (paged_decode, paged_prefill, kv_write)
        except Exception:  # triton missing or unusable: the reference twins serve
            _triton_mods = False
    return _triton_mods


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch, shared by all layers.

    slot_mapping: ``[num_tokens]`` int64 flat cache slot of each new token.
    block_tables: ``[num_seqs, max_blocks]`` int64 (padded with 0).
    context_lens: ``[num_seqs]`` cached tokens per sequence after this step's writes.
    query_lens: new tokens per sequence (all 1 in decode).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int]
    context_lens_list: list[int]
    # the CPU decode path's per-step plan (the C kernel's Launch, or the torch path's
    # CpuDecodePlan), built by the first layer
    cpu_decode: object = None
    # the offload cache's per-step plan (runtime/offload/kv.py), built by the first layer
    tier_plan: object = None
    # ``[num_seqs]`` int64, set by a decode step replayed as a CUDA graph (runtime/cuda_graphs.py),
    # None elsewhere: each sequence's row of a 4-bit cache's fp recent-block pool, and the flat
    # pool slot (row * block_size + offset) its new token goes to
    pool_rows: torch.Tensor | None = None
    pool_slots: torch.Tensor | None = None
    # a whole-prompt prefill replayed as a CUDA graph (runtime/offload/prefill_graphs.py): its
    # 4-bit cache's pool writes, settled on the host before the replay (offload.kv.StaticPrefill)
    static_prefill: object = None


def pool_slot(row, offset, block_size: int):
    """Flat slot ``row * block_size + offset`` of a recent-block pool (``pool_slots``; the
    cache's own slot-mapping form); ints or numpy arrays alike."""
    return row * block_size + offset


@dataclass
class LayerKV:
    """The KV view of one layer: two ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors;
    ``pair``, when the layer's K and V are one ``[2, num_blocks, ...]`` tensor (``PagedKVCache``),
    lets the CPU decode path gather both in one index."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pair: torch.Tensor | None = None


# Queries per SDPA call in CPU prefill: torch's CPU flash kernel computes every query block
# against all keys even when causal (one 512-key block), so chunks of 64 queries that see only
# the keys up to their last position skip the masked upper triangle (511-token prompt, 9 heads,
# 1 thread: 8.6 ms per layer in one causal call, 5.9 ms in 64-query chunks).
PREFILL_QUERY_CHUNK = 64


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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``.

    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    attend = getattr(kv, "attend", None)  # an offloaded / 4-bit layer cache (runtime.offload.kv)
    if attend is not None:
        return attend(q, k, v, meta, scale)
    on_triton = q.is_cuda and _triton()
    if on_triton:  # K and V in one launch (kernels/kv_write.py)
        _triton_mods[2].write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)
    else:
        ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)
    if _score_observer is not None:
        _score_observer(q, kv, meta, scale)
    if on_triton:
        decode, prefill = _triton_mods[:2]
        if meta.is_prefill:
            return prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                                   meta.context_lens_list, meta.query_lens, scale)
        phi, bounds = _async_softmax if _async_softmax is not None else (None, None)
        return decode.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                             meta.context_lens, scale, phi=phi, bounds=bounds,
                                             max_context_len=max(meta.context_lens_list))
    if not q.is_cuda:
        if meta.is_prefill:
            return cpu_prefill_attention(q, k, v, kv, meta, scale)
        return cpu_decode_attention(q, kv, meta, scale)
    if meta.is_prefill:
        return ref.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                           meta.context_lens_list, meta.query_lens, scale)
    return ref.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                      meta.context_lens, scale)
