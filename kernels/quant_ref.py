"""Group-wise asymmetric 4-bit quantization (FlexGen §5), pure torch: the reference twin of the
Triton kernels that read int4 KV caches and int4 weights.

A tensor is cut into groups of ``group_size`` (g = 64) consecutive elements along one axis; each
group keeps its min and ``scale = (max - min) / 15`` in fp16 and codes
``q = round((x - min) / scale)`` in ``[0, 15]``; ``x ~ q * scale + min``. Two codes share a byte
along the same axis: element ``2i`` in the low nibble, ``2i + 1`` in the high nibble.
A last, shorter group (head_dim 80 with g = 64) is allowed; its min/max cover its own elements.

KV cache (FlexGen: grouped along the hidden dim): ``[num_blocks, block_size, num_kv_heads,
head_dim]`` -> packed ``[..., head_dim // 2]`` uint8 + scale/min ``[..., ceil(head_dim / g)]``.
Weights (FlexGen: grouped along output channels): ``[N, K]`` grouped and packed along dim 0 ->
packed ``[N // 2, K]`` + scale/min ``[ceil(N / g), K]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 64


def quantize_int4(x: torch.Tensor, group_size: int = GROUP_SIZE, dim: int = -1
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (packed uint8, scale fp16, min fp16); ``x.shape[dim]`` must be even. Works on a
    ``[.., ngroups, group_size, ..]`` view of ``x`` along ``dim`` (no move to the last axis, which
    would copy the whole weight)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % 2:
        raise ValueError(f"size {n} along dim {dim} must be even to pack two 4-bit codes a byte")
    xf = x.float()
    ngroups = -(-n // group_size)
    pad = ngroups * group_size - n
    if pad:  # edge padding keeps the last group's min/max its own
        last = xf.narrow(dim, n - 1, 1)
        xf = torch.cat([xf, last.expand(*xf.shape[:dim], pad, *xf.shape[dim + 1:])], dim)
    g = xf.unflatten(dim, (ngroups, group_size))
    lo, hi = g.amin(dim + 1, keepdim=True), g.amax(dim + 1, keepdim=True)
    mn = lo.half()
    # divided by a tensor on x's device: torch on CUDA turns division by a Python scalar into a
    # multiply by its reciprocal, which rounds differently from the CPU (and the Triton kernels)
    scale = ((hi - lo) / torch.full((), 15.0, device=hi.device)).half()
    s32 = scale.float()
    safe = torch.where(s32 == 0, torch.ones_like(s32), s32)
    codes = torch.round((g - mn.float()) / safe).clamp_(0, 15)
    codes = torch.where(s32 == 0, torch.zeros_like(codes), codes)
    codes = codes.flatten(dim, dim + 1).narrow(dim, 0, n).to(torch.uint8).unflatten(dim, (n // 2, 2))
    packed = codes.select(dim + 1, 0) | (codes.select(dim + 1, 1) << 4)
    return packed.contiguous(), scale.squeeze(dim + 1).contiguous(), mn.squeeze(dim + 1).contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                    group_size: int = GROUP_SIZE, dim: int = -1,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_int4`` (up to the quantization error): ``q * scale + min`` in float32,
    then ``dtype``. The nibbles are interleaved in place along ``dim`` and the groups viewed as
    ``[..., ngroups, group_size, ...]``, so scale/min broadcast without being repeated and nothing
    is moved to the last axis (no copy of the whole weight)."""
    dim = dim % packed.dim()
    codes = torch.stack([packed & 15, packed >> 4], dim=dim + 1).flatten(dim, dim + 1)
    n, ng = codes.shape[dim], scale.shape[dim]
    pad = ng * group_size - n
    if pad:  # a last, shorter group (head_dim 80, g = 64): zero codes, cut below
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:dim], pad, *codes.shape[dim + 1:])], dim)
    grouped = codes.view(*codes.shape[:dim], ng, group_size, *codes.shape[dim + 1:]).float()
    w = grouped.mul_(scale.float().unsqueeze(dim + 1)).add_(mn.float().unsqueeze(dim + 1))
    w = w.flatten(dim, dim + 1)
    return (w.narrow(dim, 0, n) if pad else w).to(dtype)


@dataclass
class QuantizedKV:
    """One layer's K or V cache in the int4 group format: ``packed`` ``[num_blocks, block_size,
    num_kv_heads, head_dim // 2]`` uint8, ``scale``/``min`` ``[..., ceil(head_dim / g)]`` fp16."""

    packed: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int = GROUP_SIZE

    @property
    def head_dim(self) -> int:
        return self.packed.shape[-1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.min))


def quantize_kv(cache: torch.Tensor, group_size: int = GROUP_SIZE) -> QuantizedKV:
    """Quantize a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache along head_dim."""
    packed, scale, mn = quantize_int4(cache, group_size, dim=-1)
    return QuantizedKV(packed, scale, mn, group_size)


def dequantize_kv(q: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int4(q.packed, q.scale, q.min, q.group_size, dim=-1, dtype=dtype)


def write_kv_int4(k_cache: QuantizedKV, v_cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Quantize and store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at flat slots
    (the int4 twin of ``paged_attention_ref.write_kv``)."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        p, s, z = quantize_int4(x, cache.group_size, dim=-1)
        for dst, src in ((cache.packed, p), (cache.scale, s), (cache.min, z)):
            dst.view(-1, *dst.shape[2:]).index_copy_(0, slot_mapping, src)


@dataclass
class QuantizedWeight:
    """A linear weight ``[N, K]`` (``y = x @ W.T``) in the int4 group format. ``dim`` 0 (FlexGen
    §5): grouped and packed along the output channels N, ``packed`` ``[N // 2, K]`` uint8,
    ``scale``/``min`` ``[ceil(N / g), K]`` fp16; ``dim`` 1 (GGUF Q4_1 as imported): along the input
    channels K, ``packed`` ``[N, K // 2]``, ``scale``/``min`` ``[N, ceil(K / g)]``."""

    packed: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int = GROUP_SIZE
    dim: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.packed.shape
        return (n * 2, k) if self.dim == 0 else (n, k * 2)


def quantize_weight(w: torch.Tensor, group_size: int = GROUP_SIZE, dim: int = 0) -> QuantizedWeight:
    packed, scale, mn = quantize_int4(w, group_size, dim=dim)
    return QuantizedWeight(packed, scale, mn, group_size, dim)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int4(qw.packed, qw.scale, qw.min, qw.group_size, dim=qw.dim, dtype=dtype)
