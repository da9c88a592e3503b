"""The per-step description every attention backend reads (``AttentionMetadata``) and the KV view of
one paged layer (``LayerKV``). Layout and names follow PagedAttention (block tables, slot mapping)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

if TYPE_CHECKING:
    from localgen.attention.base import AttentionBackend
    from localgen.attention.spec import AttentionSpec

P = TypeVar("P")


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch, shared by all layers.

    slot_mapping: ``[num_tokens]`` int64 flat cache slot of each new token.
    block_tables: ``[num_seqs, max_blocks]`` int64 (padded with 0).
    context_lens: ``[num_seqs]`` cached tokens per sequence after this step's writes.
    query_lens: new tokens per sequence (all 1 in decode).

    With several KV groups (``localgen.kv.groups``: layers of different windows, each group with
    its own pool and block table per sequence) this object holds group 0's slot mapping and block
    tables and ``groups`` holds groups 1.. (lengths shared); a layer reads its own through
    ``of_group``. A metadata without ``groups`` serves every group with its one block table (each
    group's pool addressed by the same block ids).

    ``fresh_prefill``: a prefill whose every sequence starts from an empty cache, into a pool that
    keeps only the window of each sequence's last token (a sliding group of a model of several KV
    groups, ``localgen.kv.groups``): the K/V of positions behind it go to a scratch block, so the
    layers attend over the step's own k/v (``AttentionBackend.fresh_prefill``), not the cache.

    A backend keeps what it derives once per step (its own typed plan) through ``plan``; each
    group's metadata keeps its own plans.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int]
    context_lens_list: list[int]
    # ``[num_seqs]`` int64, set by a decode step replayed as a CUDA graph (runtime/cuda_graphs.py),
    # None elsewhere: each sequence's row of a 4-bit cache's fp recent-block pool, and the flat
    # pool slot (row * block_size + offset) its new token goes to
    pool_rows: torch.Tensor | None = None
    pool_slots: torch.Tensor | None = None
    # a whole-prompt prefill replayed as a CUDA graph (runtime/offload/prefill_graphs.py): its
    # 4-bit cache's pool writes, settled on the host before the replay (offload StaticPrefill)
    static_prefill: object = None
    # the metadata of KV groups 1.. (class docstring); empty with one group
    groups: tuple["AttentionMetadata", ...] = ()
    fresh_prefill: bool = False  # class docstring
    _plans: dict = field(default_factory=dict, repr=False)

    def of_group(self, group: int) -> "AttentionMetadata":
        """The metadata whose slot mapping and block tables address KV group ``group``'s pool."""
        return self.groups[group - 1] if group and self.groups else self

    def plan(self, kind: type[P], build: Callable[[], P]) -> P:
        """The step's plan of type ``kind``: ``build()`` by the first layer that asks, then the
        same object for every later layer of the step."""
        got = self._plans.get(kind)
        if got is None:
            got = self._plans[kind] = build()
        return got

    def clear_plans(self) -> None:
        """Forget the step's plans (a reused metadata object whose lengths changed)."""
        self._plans.clear()


def pool_slot(row, offset, block_size: int):
    """Flat slot ``row * block_size + offset`` of a recent-block pool (``pool_slots``; the
    cache's own slot-mapping form); ints or numpy arrays alike."""
    return row * block_size + offset


@dataclass
class LayerKV:
    """The KV view of one layer: two ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors;
    ``pair``, when the layer's K and V are one ``[2, num_blocks, ...]`` tensor (``PagedKVCache``),
    lets the CPU decode path gather both in one index. ``kv_group``: the KV group whose pool holds
    the tensors (``localgen.kv.groups``); the view attends through that group's metadata.

    ``backend``: the attention backend bound to this layer when the runner is built
    (``localgen.attention.select``); an unbound view takes its device's default on first use."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pair: torch.Tensor | None = None
    backend: "AttentionBackend | None" = None
    kv_group: int = 0

    def bound(self) -> "AttentionBackend":
        """The bound backend (its device's default, bound now, when none was)."""
        if self.backend is None:
            from localgen.attention.select import default_backend
            self.backend = default_backend(self.k_cache.device)
        return self.backend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               spec: "AttentionSpec") -> torch.Tensor:
        """Write new k/v ``[num_tokens, num_kv_heads, head_dim]`` at ``meta.slot_mapping``, then
        attention of q ``[num_tokens, num_heads, head_dim]``; returns q's shape."""
        return self.bound().forward(self, q, k, v, meta.of_group(self.kv_group), spec)

    def attend_written(self, q: torch.Tensor, meta: AttentionMetadata,
                       spec: "AttentionSpec") -> torch.Tensor:
        """Decode attention of q ``[num_seqs, num_heads, head_dim]`` whose K/V the caller has
        already written (the fused CPU decode layer)."""
        return self.bound().decode(self, q, None, None, meta.of_group(self.kv_group), spec)

    def fuses_cpu_decode(self, dtype: torch.dtype) -> bool:
        """Whether a CPU decode layer may write K/V into ``pair`` itself and then call
        ``attend_written``: K and V in one contiguous tensor of ``dtype`` under a backend that
        decodes this view on the CPU and observes nothing."""
        return (self.pair is not None and self.pair.dtype == dtype and self.pair.is_contiguous()
                and self.bound().takes_fused_writes)
