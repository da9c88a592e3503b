"""Dequantization of an int4 group-format weight to a dense matrix in one Triton launch: the first
half of the "torch" path of the GEMM dispatch (``dispatch``, FlashDecoding++ §5: above M2 a
prefill's GEMM runs as dequantize + cuBLAS). The pure-torch ``quant_ref.dequantize_weight`` makes
six passes over a float32 copy, which can take longer than cuBLAS needs for the GEMM itself; this
kernel reads the codes and scales once and writes the dense weight once.

Both layouts of ``quant_ref.QuantizedWeight``: ``dim`` 0 (FlexGen, groups and nibble pairs along
N) and ``dim`` 1 (GGUF Q4_1 as imported, along K). Element ``(n, k)``: code ``c`` from byte
``packed[n // 2, k]`` (dim 0) or ``packed[n, k // 2]`` (dim 1), low nibble for even, high for odd;
``w = c * scale + min`` in float32 with the scale/min of its group, then cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_ref import QuantizedWeight


@triton.jit
def _dequant_int4(p_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_pn, stride_pk, stride_sn, stride_sk,
                  stride_wn, stride_wk, GROUP: tl.constexpr, DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    if DIM == 0:
        pn, pk, odd = offs_n // 2, offs_k, offs_n % 2
        sn, sk = offs_n // GROUP, offs_k
        shift = (odd * 4)[:, None]
    else:
        pn, pk, odd = offs_n, offs_k // 2, offs_k % 2
        sn, sk = offs_n, offs_k // GROUP
        shift = (odd * 4)[None, :]
    byte = tl.load(p_ptr + pn[:, None] * stride_pn + pk[None, :] * stride_pk, mask=mask, other=0)
    code = ((byte.to(tl.int32) >> shift) & 15).to(tl.float32)
    s_off = sn[:, None] * stride_sn + sk[None, :] * stride_sk
    scale = tl.load(s_ptr + s_off, mask=mask, other=0).to(tl.float32)
    mn = tl.load(z_ptr + s_off, mask=mask, other=0).to(tl.float32)
    w = code * scale + mn
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
             w.to(w_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float16,
                      block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """The dense ``[N, K]`` weight of ``qw`` (any object with packed/scale/min/group_size/dim) in
    ``dtype``; equals ``quant_ref.dequantize_weight`` up to the last bit of ``dtype`` (the kernel
    may fuse the multiply-add). Raises ValueError for a layout other than dim 0 or 1."""
    if qw.dim not in (0, 1):
        raise ValueError(f"int4 weight layout dim must be 0 or 1, got {qw.dim}")
    p, s, z = qw.packed, qw.scale, qw.min
    n, k = (p.shape[0] * 2, p.shape[1]) if qw.dim == 0 else (p.shape[0], p.shape[1] * 2)
    w = torch.empty(n, k, dtype=dtype, device=p.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_int4[grid](p, s, z, w, n, k, p.stride(0), p.stride(1), s.stride(0), s.stride(1),
                        w.stride(0), w.stride(1), GROUP=qw.group_size, DIM=qw.dim,
                        BLOCK_N=block_n, BLOCK_K=block_k)
    return w
