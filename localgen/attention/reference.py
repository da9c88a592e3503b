"""The torch reference backend: the pure-torch twins of the paged kernels
(``localgen.kernels.paged_attention_ref``), and the one backend that computes every
``AttentionSpec`` feature (sliding window, logit soft-capping, sinks), per sequence over its
gathered context."""

from __future__ import annotations

import torch

from localgen.attention.base import AttentionBackend
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.spec import AttentionSpec
from localgen.kernels import paged_attention_ref as ref


class TorchReferenceBackend(AttentionBackend):
    """Any device; K/V in the plain paged layout (``LayerKV``)."""

    name = "torch reference"

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def write_kv(self, kv: LayerKV, k, v, meta: AttentionMetadata) -> None:
        ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)

    def prefill(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        if spec.plain:
            return ref.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                               meta.context_lens_list, meta.query_lens, spec.scale)
        return per_sequence_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                      meta.context_lens_list, meta.query_lens, spec)

    def decode(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        if spec.plain:
            return ref.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                              meta.context_lens, spec.scale)
        return per_sequence_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                      meta.context_lens_list, meta.query_lens, spec)


def per_sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: list[int], query_lens: list[int],
                           spec: AttentionSpec) -> torch.Tensor:
    """Each sequence's packed queries (q ``[num_tokens, num_heads, head_dim]``, ``query_lens[i]``
    of them, the last ones of its ``context_lens[i]`` positions) over its context gathered from
    the paged ``k_cache``/``v_cache`` (``[num_blocks, block_size, num_kv_heads, head_dim]``)
    through ``block_tables`` ``[num_seqs, max_blocks]``, with ``spec_attention``; q's shape and
    dtype. Any backend whose K/V can be brought into the plain paged layout computes every spec
    feature through this one function."""
    out, start = torch.empty_like(q), 0
    for i, (ctx, ql) in enumerate(zip(context_lens, query_lens)):
        keys = ref.gather_kv(k_cache, block_tables[i], ctx)
        vals = ref.gather_kv(v_cache, block_tables[i], ctx)
        out[start:start + ql] = spec_attention(q[start:start + ql], keys, vals, ctx - ql, spec)
        start += ql
    return out


def spec_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, first: int,
                   spec: AttentionSpec) -> torch.Tensor:
    """One sequence's queries q ``[n, num_heads, head_dim]`` at positions ``first .. first+n-1``
    over its keys/values ``[ctx, num_kv_heads, head_dim]`` (positions ``0 .. ctx-1``), causal, with
    ``spec``'s window, softcap and sinks; float32 arithmetic, returned in q's dtype. GQA: query
    head h reads KV head ``h // (num_heads // num_kv_heads)``."""
    n, num_heads, _ = q.shape
    ctx, kv_heads = keys.shape[:2]
    group = num_heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * spec.scale
    if spec.logit_softcap is not None:
        s = spec.logit_softcap * torch.tanh(s / spec.logit_softcap)
    qpos = torch.arange(first, first + n, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    visible = kpos <= qpos
    if spec.sliding_window is not None:
        visible &= kpos > qpos - spec.sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.to(s.device, torch.float32)[:, None, None].expand(num_heads, n, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :ctx]
    out = torch.einsum("hqk,khd->qhd", p, vals.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)
