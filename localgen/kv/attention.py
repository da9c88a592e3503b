"""The one attention call site of every model: write new K/V into the paged cache, then attend.

The kernels package can take over here (Triton on CUDA); elsewhere the pure-torch reference twin
runs. Layout and names follow PagedAttention (block tables, slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.kernels import paged_attention_ref as ref


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


@dataclass
class LayerKV:
    """The KV view of one layer: two ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``.

    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)
    if meta.is_prefill:
        return ref.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                           meta.context_lens_list, meta.query_lens, scale)
    return ref.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                      meta.context_lens, scale)
