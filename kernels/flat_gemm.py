"""Flat GEMM for decode (FlashDecoding++ §4): ``y = x @ W.T`` for small ``M`` (a decode batch)
with the weight in an int4 group format, dequantized in registers. Two layouts:

* FlexGen §5 (``quant_ref.QuantizedWeight``, or an ``Int4Tensor`` with ``dim == 0``): grouped
  along the output channels N (g = 64), packed two codes a byte along N: packed ``[N/2, K]``,
  scale/min ``[ceil(N/g), K]``;
* GGUF Q4_1 as imported by ``localgen.quant.gguf_import`` (an ``Int4Tensor`` with ``dim == 1``):
  grouped along the input channels K (g = 32), packed two codes a byte along K: packed
  ``[N, K/2]``, scale/min ``[N, ceil(K/g)]``.

Decode GEMMs are flat: ``M`` is a few tokens while ``N``/``K`` are thousands, so the work is bound
by reading W. The M tile is padded only to the smallest tensor-core tile (16, as ``tl.dot``
needs), the grid runs over N (and optionally splits K so small N still fills the GPU), and each
weight byte is read once per M tile: 4-bit weights read 1/4 of the fp16 bytes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .paged_decode import _dot, _dot_dtype, _pow2
from .quant_ref import QuantizedWeight


@triton.jit
def _flat_gemm_int4(x_ptr, wp_ptr, ws_ptr, wz_ptr, y_ptr, M, N, K,
                    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk,
                    stride_ym, stride_yn, k_per_split,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    IEEE: tl.constexpr, GROUP_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)
    if GROUP_K:  # GGUF: codes paired and grouped along K, one row per output channel
        p_rows = offs_n64 * stride_pn
        s_rows = offs_n64 * stride_sn
    else:  # FlexGen: codes paired and grouped along N
        p_rows = (offs_n64 // 2) * stride_pn  # byte row of each output channel
        s_rows = (offs_n64 // GROUP) * stride_sn
        shift_n = ((offs_n % 2) * 4)[:, None]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        offs_k64 = offs_k.to(tl.int64)
        x = tl.load(x_ptr + offs_m64[:, None] * stride_xm + offs_k64[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        nk_mask = n_mask[:, None] & k_mask[None, :]
        if GROUP_K:
            byte = tl.load(wp_ptr + p_rows[:, None] + (offs_k64 // 2)[None, :] * stride_pk,
                           mask=nk_mask, other=0).to(tl.int32)
            code = (byte >> ((offs_k % 2) * 4)[None, :]) & 15
            s_off = s_rows[:, None] + (offs_k64 // GROUP)[None, :] * stride_sk
        else:
            byte = tl.load(wp_ptr + p_rows[:, None] + offs_k64[None, :] * stride_pk,
                           mask=nk_mask, other=0).to(tl.int32)
            code = (byte >> shift_n) & 15
            s_off = s_rows[:, None] + offs_k64[None, :] * stride_sk
        sc = tl.load(ws_ptr + s_off, mask=nk_mask, other=0.0).to(tl.float32)
        mn = tl.load(wz_ptr + s_off, mask=nk_mask, other=0.0).to(tl.float32)
        w = code.to(tl.float32) * sc + mn  # [BLOCK_N, BLOCK_K]
        acc += _dot(x, tl.trans(w), DOT_DTYPE, IEEE)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n64[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


@triton.jit
def _dequant(code, sc, mn, DEQ: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """4-bit codes [R, BLOCK_K] (int) times the broadcast [1, BLOCK_K] scale plus min."""
    if DEQ == 1:  # fp16 magic: 0x6400 | c is the fp16 1024 + c; all fp16 math
        h = (code.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        w = h * sc + mn
    elif DEQ == 2:  # fp32 magic: 0x4B000000 | c is 2^23 + c (no int->float convert)
        h = (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        w = h * sc.to(tl.float32) + mn.to(tl.float32)
    else:
        w = code.to(tl.float32) * sc.to(tl.float32) + mn.to(tl.float32)
    return w.to(DOT_DTYPE)


@triton.jit
def _flat_gemm_int4_n(x_ptr, wp_ptr, ws_ptr, wz_ptr, y_ptr, M, N, K,
                      stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk,
                      stride_ym, stride_yn, k_per_split,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      IEEE: tl.constexpr, DEQ: tl.constexpr, SWAP: tl.constexpr):
    HALF: tl.constexpr = BLOCK_N // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_n * HALF + tl.arange(0, HALF)
    m_mask = offs_m < M
    p_mask = offs_p < N // 2
    offs_m64 = offs_m.to(tl.int64)
    offs_p64 = offs_p.to(tl.int64)
    s_row = ((pid_n * BLOCK_N) // GROUP).to(tl.int64) * stride_sn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if SWAP:
        acc_e = tl.zeros([HALF, BLOCK_M], tl.float32)
        acc_o = tl.zeros([HALF, BLOCK_M], tl.float32)
    else:
        acc_e = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_o = tl.zeros([BLOCK_M, HALF], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        offs_k64 = offs_k.to(tl.int64)
        x = tl.load(x_ptr + offs_m64[:, None] * stride_xm + offs_k64[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        byte = tl.load(wp_ptr + offs_p64[:, None] * stride_pn + offs_k64[None, :] * stride_pk,
                       mask=p_mask[:, None] & k_mask[None, :], other=0)
        sc = tl.load(ws_ptr + s_row + offs_k64 * stride_sk, mask=k_mask, other=0.0)[None, :]
        mn = tl.load(wz_ptr + s_row + offs_k64 * stride_sk, mask=k_mask, other=0.0)[None, :]
        w_e = _dequant(byte & 15, sc, mn, DEQ, DOT_DTYPE)
        w_o = _dequant(byte >> 4, sc, mn, DEQ, DOT_DTYPE)
        if SWAP:
            xt = tl.trans(x)
            acc_e += _dot(w_e, xt, DOT_DTYPE, IEEE)
            acc_o += _dot(w_o, xt, DOT_DTYPE, IEEE)
        else:
            acc_e += _dot(x, tl.trans(w_e), DOT_DTYPE, IEEE)
            acc_o += _dot(x, tl.trans(w_o), DOT_DTYPE, IEEE)
    if SWAP:
        acc_e = tl.trans(acc_e)
        acc_o = tl.trans(acc_o)
    y_e = y_ptr + offs_m64[:, None] * stride_ym + (2 * offs_p64)[None, :] * stride_yn
    y_mask = m_mask[:, None] & p_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_e, acc_e.to(y_ptr.dtype.element_ty), mask=y_mask)
        tl.store(y_e + stride_yn, acc_o.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_e, acc_e, mask=y_mask)
        tl.atomic_add(y_e + stride_yn, acc_o, mask=y_mask)


def flat_gemm_int4(x: torch.Tensor, w: QuantizedWeight, *, block_m: int = 16, block_n: int = 64,
                   block_k: int = 64, split_k: int = 1, num_warps: int = 4,
                   num_stages: int = 3, out: torch.Tensor | None = None, deq: int | None = None,
                   swap: bool = False) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (bf16/fp16/fp32) and ``W`` ``[N, K]`` int4: a
    ``QuantizedWeight`` or anything with ``packed``/``scale``/``min``/``group_size``/``shape`` and
    ``dim`` (0: grouped along N, FlexGen; 1: grouped along K, GGUF Q4_1).
    Returns ``[M, N]`` in x's dtype. ``split_k > 1`` accumulates K slices with float32 atomics
    (for small N). ``block_m`` 16 is the flat configuration; 64+ the tiled one. ``out``: an
    ``[M, N]`` tensor of x's dtype to write into (returned)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"K mismatch: x has {K}, W has {Kw}")
    group_k = w.dim == 1
    if group_k and K % 2:
        raise ValueError(f"K-packed weights need an even K, got {K}")
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    block_m = max(16, min(block_m, _pow2(M)))
    pair = not group_k and block_n >= 32 and w.group_size % block_n == 0
    split_k = max(1, int(split_k))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != x.dtype):
        raise ValueError(f"out must be [{M}, {N}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if split_k == 1:
        y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    ieee = x.dtype == torch.float32 or (interp and x.dtype == torch.bfloat16)
    args = (x, w.packed, w.scale, w.min, y, M, N, K,
            x.stride(0), x.stride(1), w.packed.stride(0), w.packed.stride(1),
            w.scale.stride(0), w.scale.stride(1), y.stride(0), y.stride(1), k_per_split)
    if pair:
        if deq is None:
            deq = 1 if x.dtype == torch.float16 else 2
        _flat_gemm_int4_n[grid](
            *args, GROUP=w.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=split_k, DOT_DTYPE=_dot_dtype(x.dtype), IEEE=ieee, DEQ=deq, SWAP=swap,
            num_warps=num_warps, num_stages=num_stages)
    else:
        _flat_gemm_int4[grid](
            *args, GROUP=w.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=split_k, DOT_DTYPE=_dot_dtype(x.dtype), IEEE=ieee, GROUP_K=group_k,
            num_warps=num_warps, num_stages=num_stages)
    if split_k == 1:
        return y
    return out.copy_(y) if out is not None else y.to(x.dtype)


def choose_split_k(m: int, n: int, k: int, num_sms: int, block_m: int = 16, block_n: int = 64,
                   block_k: int = 64, min_k_per_split: int = 512) -> int:
    """K slices so a flat GEMM fills the GPU: the ``[N/block_n, M/block_m]`` tiles alone leave SMs
    idle when N is small (Llama-2-7B's q/o at M=1: 64 tiles on 132 SMs), so K is cut until there
    are about two programs per SM, keeping at least ``min_k_per_split`` of K per slice (each slice
    adds an fp32 atomic pass over ``[M, N]``)."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    want = triton.cdiv(2 * num_sms, tiles)
    most = max(1, k // max(min_k_per_split, block_k))
    return max(1, min(want, most))


__all__ = ["flat_gemm_int4", "choose_split_k"]
