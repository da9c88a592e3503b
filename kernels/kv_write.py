"""Store new keys and values into the paged KV cache in ONE launch (Triton), the twin of
``paged_attention_ref.write_kv`` (two ``index_copy_`` launches).

One program per new token writes that token's ``[num_kv_heads, head_dim]`` K row and V row at
its flat slot ``block_id * block_size + offset`` (PagedAttention §4.1 layout). At batch-1 decode
the two ``index_copy_`` kernels per layer are a visible share of a step's launches; this is one
small kernel instead of two. ``write_kv_int4`` does the
same for a 4-bit cache, quantizing in registers (the twin of ``quant_ref.write_kv_int4``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_ref import QuantizedKV


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


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit-stride last dim (the kernels index rows by their first two strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


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
    if n == 0:
        return
    k, v = _unit_last(k), _unit_last(v)
    _write_kv_kernel[(n,)](k, v, k_cache, v_cache, slot_mapping,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(1), k_cache.stride(2),
                           KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                           BLOCK_H=triton.next_power_of_2(kv_heads),
                           BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if kv_heads * head_dim <= 512 else 4)


@triton.jit
def _quant_store(x_ptr, stride_xt, stride_xh, p_ptr, s_ptr, z_ptr, t64, slot, h0,
                 stride_ps, stride_ph, stride_ss, stride_sh, e_ptr, stride_et, stride_eh,
                 KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NG: tl.constexpr,
                 G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                 ECHO: tl.constexpr):
    """Quantize heads ``h0 .. h0 + BLOCK_H - 1`` of one token's ``[KV_HEADS, HEAD_DIM]`` row of
    K or V (as ``[BLOCK_H, BLOCK_G, G]`` groups) and store packed codes, scale and min at
    ``slot``; the ops mirror ``quant_ref.quantize_int4`` one for one so the result is
    bit-identical. ECHO: also store ``code * scale + min`` (what the cache now holds) at the
    token's row of ``e_ptr``."""
    h = h0 + tl.arange(0, BLOCK_H)
    grp = tl.arange(0, BLOCK_G)
    d = grp[None, :, None] * G + tl.arange(0, G)[None, None, :]
    mask = (h < KV_HEADS)[:, None, None] & (d < HEAD_DIM)
    x = tl.load(x_ptr + t64 * stride_xt + h[:, None, None] * stride_xh + d, mask=mask,
                other=0.0).to(tl.float32)
    # min/max over each group's own elements (a last, shorter group: the reference's edge padding)
    lo = tl.min(tl.where(mask, x, float("inf")), axis=2)
    hi = tl.max(tl.where(mask, x, float("-inf")), axis=2)
    gmask = (h < KV_HEADS)[:, None] & (grp < NG)[None, :]
    lo = tl.where(gmask, lo, 0.0)  # padded heads/groups: no inf - inf
    hi = tl.where(gmask, hi, 0.0)
    mn = lo.to(tl.float16)  # round-to-nearest-even, as torch .half()
    # div_rn: plain `/` on fp32 is div.full.f32 (approximate) on NVIDIA; torch divides exactly
    scale = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
    s32 = scale.to(tl.float32)
    safe = tl.where(s32 == 0.0, 1.0, s32)
    y = tl.math.div_rn(x - mn.to(tl.float32)[:, :, None], safe[:, :, None])
    # clamp, then round half to even (torch.round; clamp-then-round == round-then-clamp since the
    # bounds are integers). floor + exact fraction instead of libdevice.rint: runs interpreted too
    y = tl.minimum(tl.maximum(y, 0.0), 15.0)
    r = tl.math.floor(y)
    f = y - r  # exact
    ri = r.to(tl.int32)
    q = ri + ((f > 0.5) | ((f == 0.5) & ((ri & 1) == 1))).to(tl.int32)
    q = tl.where(s32[:, :, None] == 0.0, 0, q)
    # element 2i -> low nibble, 2i + 1 -> high nibble of byte i
    even, odd = tl.split(tl.reshape(q, [BLOCK_H, BLOCK_G, G // 2, 2]))
    byte = (even | (odd << 4)).to(tl.uint8)
    b = grp[None, :, None] * (G // 2) + tl.arange(0, G // 2)[None, None, :]
    tl.store(p_ptr + slot * stride_ps + h[:, None, None] * stride_ph + b, byte,
             mask=(h < KV_HEADS)[:, None, None] & (b < HEAD_DIM // 2))
    so = slot * stride_ss + h[:, None] * stride_sh + grp[None, :]
    tl.store(s_ptr + so, scale, mask=gmask)
    tl.store(z_ptr + so, mn, mask=gmask)
    if ECHO:
        deq = q.to(tl.float32) * s32[:, :, None] + mn.to(tl.float32)[:, :, None]
        tl.store(e_ptr + t64 * stride_et + h[:, None, None] * stride_eh + d,
                 deq.to(e_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_int4_kernel(k_ptr, v_ptr, kp_ptr, ks_ptr, kz_ptr, vp_ptr, vs_ptr, vz_ptr, slot_ptr,
                          ek_ptr, ev_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_ps, stride_ph, stride_ss, stride_sh, stride_et, stride_eh,
                          KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NG: tl.constexpr,
                          G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                          ECHO: tl.constexpr):
    t = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_ptr + t).to(tl.int64)
    t64 = t.to(tl.int64)
    _quant_store(k_ptr, stride_kt, stride_kh, kp_ptr, ks_ptr, kz_ptr, t64, slot, h0, stride_ps,
                 stride_ph, stride_ss, stride_sh, ek_ptr, stride_et, stride_eh,
                 KV_HEADS, HEAD_DIM, NG, G, BLOCK_H, BLOCK_G, ECHO)
    _quant_store(v_ptr, stride_vt, stride_vh, vp_ptr, vs_ptr, vz_ptr, t64, slot, h0, stride_ps,
                 stride_ph, stride_ss, stride_sh, ev_ptr, stride_et, stride_eh,
                 KV_HEADS, HEAD_DIM, NG, G, BLOCK_H, BLOCK_G, ECHO)


def write_kv_int4(k_cache: QuantizedKV, v_cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor,
                  dequantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` (bf16/fp16/fp32, any strides
    with a unit last dim) to the 4-bit group format (FlexGen §5: per group of ``g =
    cache.group_size`` elements along head_dim, fp16 min and ``scale = (max - min) / 15``, codes
    ``round((x - min) / scale)`` in [0, 15]) and store them at flat slots ``slot_mapping``
    ``[num_tokens]`` (``block * block_size + offset``) of contiguous caches: ``packed``
    ``[num_blocks, block_size, num_kv_heads, head_dim // 2]`` uint8, ``scale``/``min`` ``[...,
    ceil(head_dim / g)]`` fp16. One launch for K and V; bit-identical to
    ``quant_ref.write_kv_int4``. ``dequantized``: two contiguous ``[num_tokens, num_kv_heads,
    head_dim]`` tensors that also receive the written values dequantized (``code * scale +
    min``): a prefill that attends over its own 4-bit K/V reads them there instead of gathering
    them back from the cache. Raises ValueError on mismatched shapes or dtypes, a group size
    that is not a power of two >= 2 or differs between K and V, or a non-contiguous cache or
    ``dequantized`` tensor."""
    n, kv_heads, head_dim = k.shape
    g = k_cache.group_size
    if g < 2 or g & (g - 1) or v_cache.group_size != g:
        raise ValueError(f"write_kv_int4: group sizes {g}/{v_cache.group_size} must be one "
                         "power of two >= 2")
    ng = -(-head_dim // g)
    pshape = k_cache.packed.shape
    if v.shape != k.shape or pshape[-2:] != (kv_heads, head_dim // 2) or head_dim % 2 or \
            slot_mapping.shape != (n,) or any(
                c.packed.shape != pshape or c.scale.shape != (*pshape[:-1], ng) or
                c.min.shape != c.scale.shape for c in (k_cache, v_cache)):
        raise ValueError(f"write_kv_int4: k {tuple(k.shape)}, v {tuple(v.shape)}, packed cache "
                         f"{tuple(pshape)}, slots {tuple(slot_mapping.shape)} do not match")
    caches = (k_cache.packed, k_cache.scale, k_cache.min,
              v_cache.packed, v_cache.scale, v_cache.min)
    if [c.dtype for c in caches] != [torch.uint8, torch.float16, torch.float16] * 2 or \
            k.dtype != v.dtype or k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"write_kv_int4 needs bf16/fp16/fp32 k/v (got {k.dtype}/{v.dtype}), "
                         "uint8 packed and float16 scale/min caches")
    if not all(c.is_contiguous() for c in caches):  # checked, never copied: pinned caches stay put
        raise ValueError("write_kv_int4 needs contiguous caches")
    if dequantized is not None and any(e.shape != k.shape or not e.is_contiguous()
                                       for e in dequantized):
        raise ValueError(f"write_kv_int4: dequantized outputs must be contiguous {tuple(k.shape)}")
    if n == 0:
        return
    k, v = _unit_last(k), _unit_last(v)
    kp = k_cache.packed
    ek, ev = dequantized if dequantized is not None else (k, v)  # unused without ECHO
    block_h = _heads_per_program(n, kv_heads)
    _write_kv_int4_kernel[(n, -(-kv_heads // block_h))](
        k, v, *caches, slot_mapping, ek, ev, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kp.stride(1), kp.stride(2), k_cache.scale.stride(1), k_cache.scale.stride(2),
        ek.stride(0), ek.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, NG=ng, G=g, BLOCK_H=block_h,
        BLOCK_G=triton.next_power_of_2(ng), ECHO=dequantized is not None,
        num_warps=1 if block_h * head_dim <= 512 else 4)


def _heads_per_program(num_tokens: int, kv_heads: int, programs: int = 1024) -> int:
    """KV heads one program quantizes: all of a token's when there are tokens enough to fill the
    GPU (prefill), fewer when there are not (a decode step's 16 tokens of 32 heads each would be
    16 programs for a GPU of over a hundred SMs; at one head each, 512)."""
    per = triton.next_power_of_2(kv_heads)
    while per > 1 and num_tokens * -(-kv_heads // per) < programs:
        per //= 2
    return per


__all__ = ["write_kv", "write_kv_int4"]
