"""Attention on the CPU: the ``CpuBackend`` (torch) and the ``CpuKernelBackend`` (C decode kernel).

Decode is one query token per sequence over its paged context. Where the C kernel builds
(``localgen.kernels.paged_decode_cpu``: a C compiler on the machine), it reads K/V in place through
the block table, splits long contexts across threads and keeps the arithmetic in float32; its launch
(int64 tables and lengths, the split count) is planned once a step by the first layer.

Elsewhere (no compiler, fp16, a shape the kernel rejects) the torch path: what to read is planned
once per step (``CpuDecodePlan``): the block ids of every sequence and, when contexts differ in
length, an additive mask. Each layer then gathers its K and V blocks (both in one ``index_select``
when the cache holds them as one tensor) in context order and attends in one call of torch's CPU
flash-attention op, with the query heads of each KV head as that head's queries (GQA without
repeating K/V). The blocks are gathered even when they are consecutive: the flash kernel reads each
head's rows strided, head by head, which from memory is slower than a copy into a reused buffer
followed by the same kernel on cache-resident rows (docs/benchmarks.md). The op is called directly,
not through ``scaled_dot_product_attention``'s backend checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.attention.base import AttentionBackend
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.prefill import cpu_prefill_attention
from localgen.attention.spec import AttentionSpec
from localgen.kernels import cpu_build
from localgen.kernels import paged_attention_ref as ref
from localgen.kernels import paged_decode_cpu as kernel

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash = getattr(_flash, "default", None)


@dataclass
class CpuDecodePlan:
    """What every layer of one CPU decode step reads: the longest context ``max_len`` and its
    ``n_blocks``; ``blocks``: ``[num_seqs * n_blocks]`` block ids to gather; ``mask``:
    ``[num_seqs, 1, 1, max_len]`` additive (0 / -inf) in the query dtype, None when every
    sequence has ``max_len`` tokens."""

    max_len: int
    n_blocks: int
    blocks: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int,
              dtype: torch.dtype = torch.float32) -> "CpuDecodePlan":
        lens = meta.context_lens_list
        max_len = max(lens)
        n = -(-max_len // block_size)
        mask = None
        if min(lens) != max_len:
            pos = torch.arange(max_len, device=meta.context_lens.device)
            hide = pos[None, :] >= meta.context_lens[:, None]
            mask = torch.zeros(hide.shape, dtype=dtype).masked_fill_(hide, float("-inf"))
            mask = mask[:, None, None, :]
        return cls(max_len, n, meta.block_tables[:, :n].reshape(-1), mask)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """``[B, Hk, g, D]`` queries over ``[B, Hk, L, D]`` keys/values (any strides)."""
    if _flash is not None:
        return _flash(q, k, v, attn_mask=mask, scale=scale)[0]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _torch_decode_attention(q: torch.Tensor, kv: LayerKV, plan: CpuDecodePlan,
                            scale: float) -> torch.Tensor:
    """The gather + flash-op path (module docstring)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = kv.k_cache.shape
    L, nt = plan.max_len, plan.n_blocks * block_size
    if kv.pair is not None:
        both = kv.pair.index_select(1, plan.blocks).view(2, num_seqs, nt, kv_heads, head_dim)
        k, v = both[0, :, :L], both[1, :, :L]
    else:
        k = kv.k_cache.index_select(0, plan.blocks).view(num_seqs, nt, kv_heads, head_dim)[:, :L]
        v = kv.v_cache.index_select(0, plan.blocks).view(num_seqs, nt, kv_heads, head_dim)[:, :L]
    mask = plan.mask
    if mask is not None and mask.dtype != q.dtype:
        mask = plan.mask = mask.to(q.dtype)
    qg = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = _attend(qg, k.transpose(1, 2), v.transpose(1, 2), mask, scale)
    return out.reshape(num_seqs, num_heads, head_dim)


class CpuBackend(AttentionBackend):
    """The CPU backend through torch: K/V written with one ``index_copy_`` each, prefill by
    ``cpu_prefill_attention``, decode by the gather + flash-op path (``CpuDecodePlan``)."""

    name = "CPU"
    decodes_fused_writes = True

    def write_kv(self, kv: LayerKV, k, v, meta: AttentionMetadata) -> None:
        ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)

    def prefill(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        return cpu_prefill_attention(q, k, v, kv, meta, spec.scale)

    def decode(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        plan = meta.plan(CpuDecodePlan, lambda: CpuDecodePlan.build(meta, kv.k_cache.shape[1], q.dtype))
        return _torch_decode_attention(q, kv, plan, spec.scale)


class CpuKernelBackend(CpuBackend):
    """``CpuBackend`` whose decode runs the C kernel (``localgen.kernels.paged_decode_cpu``),
    its launch planned once a step. Chosen where the kernel builds and takes the cache's dtype;
    a call whose tensors it rejects (a strided query) takes the torch path."""

    name = "CPU C kernel"

    def decode(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        if not kernel.supports(q, kv.k_cache, kv.v_cache):
            return super().decode(kv, q, k, v, meta, spec)
        launch = meta.plan(kernel.Launch, lambda: kernel.plan(
            meta.block_tables, meta.context_lens, kv.k_cache.shape[2], max(meta.context_lens_list)))
        return kernel.run(launch, q, kv.k_cache, kv.v_cache, spec.scale)


def kernel_takes(dtype: torch.dtype) -> bool:
    """Whether the C decode kernel builds on this machine and takes a cache of ``dtype``."""
    return kernel.available() and dtype in cpu_build.DTYPE_CODES
