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
    return ref.paged_feature_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens,
                                       spec.scale, spec.sliding_window, spec.logit_softcap,
                                       spec.sinks)


def spec_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, first: int,
                   spec: AttentionSpec) -> torch.Tensor:
    """One sequence's queries q ``[n, num_heads, head_dim]`` at positions ``first .. first+n-1``
    over its keys/values ``[ctx, num_kv_heads, head_dim]`` (positions ``0 .. ctx-1``), causal, with
    ``spec``'s window, softcap and sinks (``paged_attention_ref.feature_attention``); float32
    arithmetic, returned in q's dtype."""
    return ref.feature_attention(q, keys, vals, first, spec.scale, spec.sliding_window,
                                 spec.logit_softcap, spec.sinks)
