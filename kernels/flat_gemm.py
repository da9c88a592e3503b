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

The FlexGen layout has its own kernel (``_flat_gemm_int4_pairs``): a tile of output rows inside
one scale group loads each packed byte once and splits it into the even-row (low nibble) and
odd-row (high nibble) code tiles, with one ``[BLOCK_K]`` scale/min vector for the whole tile;
on the GPU the nibbles become 16-bit floats by bit tricks (no int->float conversions), the K
tile is cut into slices that the warps share, and K slices across programs (``split_k``) are
summed in the kernel. The kernel is bound by each SM's instruction issue (dequantization,
operand moves) rather than by bytes in flight, so these cut instructions per byte of weight. The
GGUF layout (and FlexGen tiles that do not fit one scale group) take the general kernel
``_flat_gemm_int4``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_common import dot, dot_dtype, ieee_dots, interpreting, num_sms, pow2, tickets
from .quant_ref import QuantizedWeight

PAIRS_BLOCK_N = 32  # the FlexGen kernel's default output rows a tile (and its smallest)
# SMs modelled off CUDA (the interpreter): a large GPU's count, so the tile choice there is the
# one a large GPU makes
INTERPRETER_SMS = 132


# The FlexGen kernel adds a bias in its store; LOCALGEN_INT4_BIAS_EPILOGUE=0 keeps the separate
# add (to compare the two on a model), read once at import.
BIAS_IN_STORE = os.environ.get("LOCALGEN_INT4_BIAS_EPILOGUE", "1") != "0"


@triton.jit
def _tile_rows(pid_m, pid_n, M, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program's rows of x (tile ``pid_m`` of ``M``) and of W's output rows (tile ``pid_n`` of
    ``R``: output channels, or byte rows of the FlexGen layout): each as offsets, mask and int64
    offsets."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_n * BLOCK_R + tl.arange(0, BLOCK_R)
    return offs_m, offs_m < M, offs_m.to(tl.int64), offs_r, offs_r < R, offs_r.to(tl.int64)


@triton.jit
def _flat_gemm_int4(x_ptr, wp_ptr, ws_ptr, wz_ptr, y_ptr, M, N, K,
                    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk,
                    stride_ym, stride_yn, k_per_split,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    IEEE: tl.constexpr, GROUP_K: tl.constexpr):
    """The general kernel: both layouts, per-element scale/min (GGUF, and FlexGen tiles that do
    not fit one scale group), K slices summed with float32 atomics."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m, m_mask, offs_m64, offs_n, n_mask, offs_n64 = _tile_rows(pid_m, pid_n, M, N, BLOCK_M,
                                                                     BLOCK_N)
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
        acc += dot(x, tl.trans(w), DOT_DTYPE, IEEE)
    y_ptrs = y_ptr + offs_m64[:, None] * stride_ym + offs_n64[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


@triton.jit
def _codes(byte, DOT_DTYPE: tl.constexpr, FAST: tl.constexpr):
    """The low and high nibbles of ``byte`` (any shape) as exact float codes 0..15. FAST (fp16/bf16
    on the GPU): OR-ing a code into the mantissa of a 16-bit float B gives B + code exactly, so a
    few bit operations per four bytes replace the per-code int->float conversions (fp16 also
    leaves the high nibble in place: 1024 + 16 c, undone by one exact FMA); elsewhere (fp32, the
    interpreter) plain integer ops."""
    if not FAST:
        lo = (byte & 15).to(tl.float32)
        hi = (byte >> 4).to(tl.float32)
    elif DOT_DTYPE == tl.float16:
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .b32 a, b, k;
            mov.b32 k, 0x64646464;
            and.b32 a, $4, 0x0F0F0F0F;
            and.b32 b, $4, 0xF0F0F0F0;
            prmt.b32 $0, a, k, 0x5140;
            prmt.b32 $1, a, k, 0x5342;
            prmt.b32 $2, b, k, 0x5140;
            prmt.b32 $3, b, k, 0x5342;
            }""", "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        lo = lo - 1024.0
        hi = hi * 0.0625 - 64.0
    else:  # bf16 has 7 mantissa bits: both nibbles go to the low byte of 0x4300 (128 + c)
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2, t3;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            shr.u32 t2, t0, 4;
            shr.u32 t3, t1, 4;
            lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $2, t2, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $3, t3, 0x000F000F, 0x43004300, 0xEA;
            }""", "=r,=r,=r,=r,r", [byte], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        lo = lo - 128.0
        hi = hi - 128.0
    return lo, hi


@triton.jit
def _dequant(code, sc, mn, DOT_DTYPE: tl.constexpr, FAST: tl.constexpr, IEEE: tl.constexpr):
    """``code * scale + min`` as the dot operand. fp16 on the GPU: one fp16 FMA (one rounding, as
    the fp32 result cast to fp16); bf16: in fp32, then cast (a bf16 FMA on bf16-rounded scales
    would add their rounding to the error); IEEE (fp32 x, the bf16 interpreter path): fp32
    kept."""
    if FAST and DOT_DTYPE == tl.float16:
        w = code * sc + mn
    elif IEEE:
        w = code.to(tl.float32) * sc.to(tl.float32) + mn.to(tl.float32)
    else:
        w = (code.to(tl.float32) * sc.to(tl.float32) + mn.to(tl.float32)).to(DOT_DTYPE)
    return w


@triton.jit
def _flat_gemm_int4_pairs(x_ptr, wp_ptr, ws_ptr, wz_ptr, y_ptr, part_ptr, cnt_ptr, b_ptr,
                          M, N, K,
                          stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk,
                          stride_ym, stride_yn, k_per_split,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SLICES: tl.constexpr, SPLIT_K: tl.constexpr,
                          EVEN: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
                          FAST: tl.constexpr, HAS_BIAS: tl.constexpr):
    """FlexGen layout. A program owns ``BLOCK_N`` output rows = ``HALF`` packed byte rows inside
    one scale group (``GROUP % BLOCK_N == 0``), so each K column has one scale and one min for the
    whole tile. Each byte tile is loaded once and gives two code tiles: low nibbles (rows 2p) and
    high nibbles (rows 2p + 1), two dots. The K tile is cut into ``SLICES`` slices, the batch dim
    of the dots: Triton puts the warps on it, so a tile of 16 rows keeps every warp busy without
    duplicated dequantization, and the slices are summed once at the end. W is the dots' A
    operand, x^T the B (fewer register moves than x as A). EVEN: no tails in N or K (no masks).
    HAS_BIAS: ``b_ptr`` ``[N]`` added as the store rounds (``_store_pairs``)."""
    HALF: tl.constexpr = BLOCK_N // 2
    KS: tl.constexpr = BLOCK_K // SLICES
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m, m_mask, offs_m64, offs_p, p_mask, offs_p64 = _tile_rows(pid_m, pid_n, M, N // 2,
                                                                     BLOCK_M, HALF)
    s_off = ((pid_n * BLOCK_N) // GROUP).to(tl.int64) * stride_sn  # the tile's scale/min row
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # [SLICES, 1, KS]: slice s covers k0 + s * KS + [0, KS)
    offs_sk = (tl.arange(0, SLICES)[:, None] * KS + tl.arange(0, KS)[None, :])[:, None, :]
    x_rows = x_ptr + offs_m64[None, :, None] * stride_xm  # [1, BLOCK_M, 1]
    p_rows = wp_ptr + offs_p64[None, :, None] * stride_pn  # [1, HALF, 1]
    acc_e = tl.zeros([SLICES, HALF, BLOCK_M], tl.float32)  # rows 2p, transposed
    acc_o = tl.zeros([SLICES, HALF, BLOCK_M], tl.float32)  # rows 2p + 1
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = (k0 + offs_sk).to(tl.int64)
        if EVEN:
            x = tl.load(x_rows + offs_k * stride_xk, mask=m_mask[None, :, None], other=0.0)
            byte = tl.load(p_rows + offs_k * stride_pk)
            sc = tl.load(ws_ptr + s_off + offs_k * stride_sk)
            mn = tl.load(wz_ptr + s_off + offs_k * stride_sk)
        else:
            k_mask = offs_k < k_hi
            x = tl.load(x_rows + offs_k * stride_xk, mask=m_mask[None, :, None] & k_mask,
                        other=0.0)
            byte = tl.load(p_rows + offs_k * stride_pk, mask=p_mask[None, :, None] & k_mask,
                           other=0)
            sc = tl.load(ws_ptr + s_off + offs_k * stride_sk, mask=k_mask, other=0.0)
            mn = tl.load(wz_ptr + s_off + offs_k * stride_sk, mask=k_mask, other=0.0)
        c_e, c_o = _codes(byte, DOT_DTYPE, FAST)
        xt = tl.permute(x, (0, 2, 1))
        acc_e += dot(_dequant(c_e, sc, mn, DOT_DTYPE, FAST, IEEE), xt, DOT_DTYPE, IEEE)
        acc_o += dot(_dequant(c_o, sc, mn, DOT_DTYPE, FAST, IEEE), xt, DOT_DTYPE, IEEE)
    sum_e = tl.sum(acc_e, axis=0)  # [HALF, BLOCK_M]
    sum_o = tl.sum(acc_o, axis=0)
    col_m = offs_m64[None, :]
    row_n = (2 * offs_p64)[:, None]  # output row 2p; 2p + 1 is the next one
    y_mask = p_mask[:, None] & m_mask[None, :]
    if SPLIT_K > 1:
        # K slices: store this slice's partial, take a ticket; the tile's last slice sums the
        # partials (read through L2: other programs wrote them in this launch) and stores y, so
        # a split costs no zero-fill or cast launches (the paged_decode fused-combine pattern)
        part = part_ptr + (pid_k * M + col_m) * N + row_n
        tl.store(part, sum_e, mask=y_mask)
        tl.store(part + 1, sum_o, mask=y_mask)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            sum_e = tl.zeros([HALF, BLOCK_M], tl.float32)
            sum_o = tl.zeros([HALF, BLOCK_M], tl.float32)
            for s in range(SPLIT_K):
                part = part_ptr + (s * M + col_m) * N + row_n
                sum_e += tl.load(part, mask=y_mask, other=0.0, cache_modifier=".cg")
                sum_o += tl.load(part + 1, mask=y_mask, other=0.0, cache_modifier=".cg")
            _store_pairs(y_ptr + col_m * stride_ym + row_n * stride_yn, stride_yn, sum_e, sum_o,
                         y_mask, b_ptr + row_n, p_mask[:, None], HAS_BIAS)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero again for the next call
    else:
        _store_pairs(y_ptr + col_m * stride_ym + row_n * stride_yn, stride_yn, sum_e, sum_o,
                     y_mask, b_ptr + row_n, p_mask[:, None], HAS_BIAS)


@triton.jit
def _store_pairs(y, stride_yn, sum_e, sum_o, mask, b, b_mask, HAS_BIAS: tl.constexpr):
    """Rows 2p and 2p + 1 of ``y``; with a bias (``b`` at row 2p) the product is rounded to y's
    dtype, the bias added in float32 and the sum rounded again: the values of ``y + bias`` in
    torch, without its launch."""
    ty = y.dtype.element_ty
    e, o = sum_e.to(ty), sum_o.to(ty)
    if HAS_BIAS:
        e = (e.to(tl.float32) + tl.load(b, mask=b_mask, other=0.0).to(tl.float32)).to(ty)
        o = (o.to(tl.float32) + tl.load(b + 1, mask=b_mask, other=0.0).to(tl.float32)).to(ty)
    tl.store(y, e, mask=mask)
    tl.store(y + stride_yn, o, mask=mask)


def flat_gemm_int4(x: torch.Tensor, w: QuantizedWeight, *, block_m: int = 16,
                   block_n: int | None = None, block_k: int | None = None, split_k: int = 1,
                   num_warps: int = 4, num_stages: int | None = None,
                   out: torch.Tensor | None = None, slices: int = 4,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[M, K]`` (bf16/fp16/fp32) and ``W`` ``[N, K]`` int4: a
    ``QuantizedWeight`` or anything with ``packed``/``scale``/``min``/``group_size``/``shape`` and
    ``dim`` (0: grouped along N, FlexGen; 1: grouped along K, GGUF Q4_1).
    Returns ``[M, N]`` in x's dtype. ``split_k > 1`` cuts K into slices (for small N): FlexGen
    sums them in the kernel (the last slice of a tile combines fp32 partials), GGUF with float32
    atomics. ``block_m`` 16 is the flat configuration; 64+ the tiled one. ``out``: an ``[M, N]``
    tensor of x's dtype to write into (returned). ``block_n``/``block_k``/``num_stages`` default
    per layout and ``block_m`` (``_pairs_config``; GGUF: 16/64/3); ``slices``: K slices per tile
    shared by the warps (FlexGen kernel only). ``bias`` ``[N]`` of x's dtype: ``x @ W.T + bias``
    with torch's values for the add (in the FlexGen kernel's store, else one more op)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"K mismatch: x has {K}, W has {Kw}")
    group_k = w.dim == 1
    if group_k and K % 2:
        raise ValueError(f"K-packed weights need an even K, got {K}")
    if out is not None and (tuple(out.shape) != (M, N) or out.dtype != x.dtype):
        raise ValueError(f"out must be [{M}, {N}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    interp = interpreting()
    ieee = ieee_dots(x.dtype)
    block_m = max(16, min(block_m, pow2(M)))
    bn = block_n or PAIRS_BLOCK_N
    pairs = not group_k and w.group_size % bn == 0 and bn >= PAIRS_BLOCK_N
    if pairs:
        cfg = _pairs_config(N, block_m, w.group_size, x.dtype, x.device)
        block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
        num_stages = num_stages or cfg["num_stages"]
        slices = max(1, min(slices, block_k // 16))  # each slice a K >= 16 dot
    else:
        # 16-row tiles: twice the programs of 32, so a decode GEMM fills the GPU without K slices
        block_n, block_k, num_stages = block_n or 16, block_k or 64, num_stages or 3
    split_k = max(1, int(split_k))
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m), split_k)
    args = (M, N, K, x.stride(0), x.stride(1), w.packed.stride(0), w.packed.stride(1),
            w.scale.stride(0), w.scale.stride(1))
    common = dict(GROUP=w.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  SPLIT_K=split_k, DOT_DTYPE=dot_dtype(x.dtype), IEEE=ieee,
                  num_warps=num_warps, num_stages=num_stages)
    if pairs or split_k == 1:
        y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    if pairs:
        if split_k > 1:
            part = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
            cnt = tickets(x.device, grid[0] * grid[1])
        else:
            part = cnt = y  # unused
        has_bias = (BIAS_IN_STORE and bias is not None and bias.dtype == x.dtype
                    and bias.is_contiguous())
        _flat_gemm_int4_pairs[grid](
            x, w.packed, w.scale, w.min, y, part, cnt, bias if has_bias else y, *args,
            y.stride(0), y.stride(1), k_per_split, SLICES=slices,
            EVEN=K % block_k == 0 and N % block_n == 0, FAST=not (ieee or interp),
            HAS_BIAS=has_bias, **common)
        return y if has_bias or bias is None else y + bias
    _flat_gemm_int4[grid](x, w.packed, w.scale, w.min, y, *args, y.stride(0), y.stride(1),
                          k_per_split, GROUP_K=group_k, **common)
    if split_k > 1:
        y = out.copy_(y) if out is not None else y.to(x.dtype)
    return y if bias is None else y + bias


def _pairs_config(n: int, block_m: int, group: int, dtype: torch.dtype,
                  device: torch.device) -> dict:
    """FlexGen kernel defaults, from a GPU sweep over M = 1/16 and 64/128 (the kernel is bound by
    each SM's instruction issue once every SM has a tile): 32-row tiles (16 byte rows) over
    512 K columns in 4 slices, 3 stages; fp16: 64-row tiles once 32-row ones are more than about
    four per SM (bf16, with its fp32 dequantization, keeps 32); the 64-row M tile: 256 K
    columns, 2 stages (its x tile is 4x larger)."""
    block_n = PAIRS_BLOCK_N
    sms = num_sms(device, INTERPRETER_SMS)
    if dtype == torch.float16 and n > 4 * PAIRS_BLOCK_N * sms and group % 64 == 0:
        block_n = 64
    if block_m <= 16:
        return dict(block_n=block_n, block_k=512, num_stages=3)
    return dict(block_n=block_n, block_k=256, num_stages=2)


def choose_split_k(m: int, n: int, k: int, num_sms: int, block_m: int = 16, block_n: int = 32,
                   block_k: int = 512, min_k_per_split: int = 4096) -> int:
    """K slices so a flat GEMM fills the GPU: only while the ``[N/block_n, M/block_m]`` tiles
    leave SMs idle, up to about one program per SM, each slice keeping at least
    ``min_k_per_split`` of K. The FlexGen kernel is bound by each SM's instruction issue, not by
    programs in flight, so a split pays (partials, the combine) only where K is long: a short K
    of 4096 stays unsplit by default, a long one gains."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if tiles >= num_sms:
        return 1
    want = triton.cdiv(num_sms, tiles)
    most = max(1, k // max(min_k_per_split, block_k))
    return max(1, min(want, most))


__all__ = ["flat_gemm_int4", "choose_split_k"]
