"""Store new keys and values into the paged KV cache in ONE launch (Triton), the twin of
``paged_attention_ref.write_kv`` (two ``index_copy_`` launches).

One program per new token writes that token's ``[num_kv_heads, head_dim]`` K row and V row at
its flat slot ``block_id * block_size + offset`` (PagedAttention §4.1 layout, DESIGN.md). At
batch-1 decode the two ``index_copy_`` kernels per layer were ~3% of a Llama-2-7B step on an H200
(scripts/decode_profile.py); this is one small kernel instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` (any strides with a unit last
    dim, e.g. views of a fused qkv projection; cast to the cache dtype) at flat slots
    ``slot_mapping`` ``[num_tokens]`` of contiguous caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``. Raises ValueError on mismatched shapes or a non-contiguous cache."""
    n, kv_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[-2:] != (kv_heads, head_dim) or \
            v_cache.shape != k_cache.shape or slot_mapping.shape != (n,):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
                         f"{tuple(k_cache.shape)}, slots {tuple(slot_mapping.shape)} do not match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous caches")
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if n == 0:
        return
    _write_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(1), k_cache.stride(2),
                           KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                           BLOCK_H=triton.next_power_of_2(kv_heads),
                           BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if kv_heads * head_dim <= 512 else 4)


__all__ = ["write_kv"]
