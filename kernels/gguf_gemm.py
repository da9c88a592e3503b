"""Triton matmul with GGUF quantized weights kept in the file's own block layout (no repack).

``y[m, n] = x[m, k] · W[n, k]ᵀ`` where row ``n`` of W is ``k / QK`` consecutive GGUF blocks of
the type (ggml-common.h: ``block_q4_K``, ``block_q5_K``, ``block_q6_K``, ``block_q8_0``,
``block_q4_0``), raw bytes ``[N, row_bytes]`` as read from the file.

* Decode (``M <= DECODE_MAX_M``): Q4_K, Q5_K and Q6_K go by default to the kernel that
  ``gguf_gemv.DECODE_CONFIGS`` names per type and M: ``gguf_gemv``'s, which apply the scales
  once per group, ``gguf_mma``'s tensor-core kernel (2 <= M <= 64), this module's, or the
  prefill path. This module's kernel (M <= 16), the reference and the path of the other types,
  is one fused kernel as follows. Each program owns ``BLOCK_N`` output rows and
  a slice of K, walked one 256-weight tile at a time; each 32-weight group of the tile is loaded
  as contiguous bytes of every row (``_group``), dequantized in registers with that row's scales
  and multiplied into the ``[BLOCK_M, BLOCK_N]`` accumulator with ``tl.dot`` (for M = 1, products
  accumulated elementwise and summed once at the end). Every weight
  byte is read from memory once per call: decode is bound by reading W, so K is split across
  programs until the grid fills the GPU, their float32 partial sums added atomically.
* Prefill (larger M): by default the same ``_group`` dequantization writes W once to a
  bf16/fp16 buffer and cuBLAS does the GEMM, which is compute-bound at that M;
  ``gguf_gemv.PREFILL_CONFIGS`` (or a sweep's winners) may name ``gguf_i8mma``'s kernel.

The value order inside each block follows ``gguf.quants`` (the reference these kernels are tested
against): e.g. Q4_K's 128 bytes of nibbles hold, per 32-byte chunk ``c``, sub-block ``2c`` in the
low nibbles and ``2c + 1`` in the high ones, with 6-bit scales and mins packed in 12 bytes.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from triton.errors import TritonError

from . import gguf_gemv, gguf_i8mma, gguf_mma, gguf_q8

# The types these kernels read; ``_group`` dispatches on their GGMLQuantizationType values.
KERNEL_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# weights per block and bytes per block, per type (ggml-common.h, as gguf.constants states them)
BLOCK_WEIGHTS = {int(t): GGML_QUANT_SIZES[t][0] for t in KERNEL_TYPES}
BLOCK_BYTES = {int(t): GGML_QUANT_SIZES[t][1] for t in KERNEL_TYPES}
TILE_K = 256  # weights dequantized per loop step: one K-quant super-block, eight 32-blocks
DECODE_MAX_M = gguf_gemv.MMA_MAX_M  # past it, the prefill configs (gguf_gemv.PREFILL_CONFIGS)


@triton.jit
def _f16_rows(blk, off):
    """fp16 field at byte ``off`` of each row's block (``blk``: ``[BLOCK_N]`` byte pointers)."""
    return tl.load((blk + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _bytes(blk, off):
    """``[BLOCK_N, 32]`` int32 of each row's bytes ``off .. off + 32`` (contiguous loads)."""
    return tl.load(blk[:, None] + off + tl.arange(0, 32)[None, :]).to(tl.int32)


@triton.jit
def _i8_rows(blk, off):
    return tl.load(blk + off).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(blk, S: tl.constexpr):
    """``[BLOCK_N]`` 6-bit scale and min of sub-block ``S`` (Q4_K/Q5_K bytes 4..15)."""
    if S < 4:
        sc = tl.load(blk + 4 + S).to(tl.int32) & 63
        mn = tl.load(blk + 8 + S).to(tl.int32) & 63
    else:
        packed = tl.load(blk + 12 + (S - 4)).to(tl.int32)
        sc = (packed & 15) | ((tl.load(blk + 4 + (S - 4)).to(tl.int32) >> 6) << 4)
        mn = (packed >> 4) | ((tl.load(blk + 8 + (S - 4)).to(tl.int32) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _group(rows, kt, G: tl.constexpr, QTYPE: tl.constexpr):
    """float32 weights ``[BLOCK_N, 32]``: values ``kt*256 + 32*G ..`` of every row (``rows``:
    ``[BLOCK_N]`` byte pointers to the rows' first block). Block layouts as in gguf.quants."""
    t = tl.arange(0, 32)[None, :]
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, [32 qh], nibbles
        if QTYPE == 12:
            blk = rows + kt * 144
            q = (_bytes(blk, 16 + 32 * (G // 2)) >> (4 * (G % 2))) & 15
        else:
            blk = rows + kt * 176
            q = (_bytes(blk, 48 + 32 * (G // 2)) >> (4 * (G % 2))) & 15
            q = q | (((_bytes(blk, 16) >> G) & 1) << 4)
        sc, mn = _k4_scale_min(blk, G)
        w = (_f16_rows(blk, 0) * sc)[:, None] * q.to(tl.float32) - (_f16_rows(blk, 2) * mn)[:, None]
    elif QTYPE == 14:  # Q6_K: 128 low-nibble bytes, 64 two-bit bytes, 16 int8 scales, d
        blk = rows + kt * 210
        h = G // 4
        quarter = G % 4
        lo = (_bytes(blk, 64 * h + 32 * (quarter % 2)) >> (4 * (quarter // 2))) & 15
        hi = (_bytes(blk, 128 + 32 * h) >> (2 * quarter)) & 3
        d = _f16_rows(blk, 208)
        sa = d * _i8_rows(blk, 192 + 2 * G)  # a scale per 16 weights
        sb = d * _i8_rows(blk, 193 + 2 * G)
        w = tl.where(t < 16, sa[:, None], sb[:, None]) * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif QTYPE == 8:  # Q8_0: d, 32 int8
        blk = rows + (kt * 8 + G) * 34
        q = tl.load(blk[:, None] + 2 + t).to(tl.int8, bitcast=True)
        w = _f16_rows(blk, 0)[:, None] * q.to(tl.float32)
    else:  # Q4_0: d, 16 bytes: weight j in the low nibble of byte j, j + 16 in the high one
        blk = rows + (kt * 8 + G) * 18
        q = (tl.load(blk[:, None] + 2 + t % 16).to(tl.int32) >> (4 * (t // 16))) & 15
        w = _f16_rows(blk, 0)[:, None] * (q - 8).to(tl.float32)
    return w


@triton.jit
def _dot_group(acc, x_cols, w, m_mask, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
               GEMV: tl.constexpr):
    """``acc += x[:, cols] · wᵀ`` for the 32 columns starting at ``x_cols``.
    GEMV (one activation row): ``acc`` is ``[BLOCK_N, 32]`` of products summed at the end, so
    the weights never change register layout (a ``tl.dot`` operand goes through shared memory)."""
    if GEMV:
        out = acc + w * tl.load(x_cols + tl.arange(0, 32)[None, :]).to(tl.float32)
    else:
        x = tl.load(x_cols + tl.arange(0, 32)[None, :], mask=m_mask, other=0.0)
        if IEEE:  # float32 activations: no TF32 rounding of the operands
            out = acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            out = acc + tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)))
    return out


@triton.jit
def _gemm_decode(x_ptr, w_ptr, y_ptr, M, N, num_tiles, tiles_per_split, stride_xm, stride_wn,
                 stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_K: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
                 GEMV: tl.constexpr):
    """Program (n, s): output rows ``n*BLOCK_N ..`` over K tiles ``s*tiles_per_split ..``; split
    programs add their float32 partial sums into ``y`` atomically. GEMV: M == 1 (BLOCK_M 1)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # rows past N read row N - 1 (always valid) and are masked at the store
    rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    m_mask = (offs_m < M)[:, None]
    if GEMV:
        acc = tl.zeros([BLOCK_N, 32], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    kt0 = pid_k * tiles_per_split
    for kt in range(kt0, tl.minimum(kt0 + tiles_per_split, num_tiles)):
        for g in tl.static_range(8):
            acc = _dot_group(acc, x_rows + kt * 256 + 32 * g, _group(rows, kt, g, QTYPE), m_mask,
                             DOT_DTYPE, IEEE, GEMV)
    if GEMV:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = acc
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y, out, mask=mask)


@triton.jit
def _dequant_rows(w_ptr, out_ptr, N, stride_wn, stride_on, QTYPE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Program (n, kt): the 256 weights of tile ``kt`` of rows ``n*BLOCK_N ..`` to ``out``."""
    pid_n = tl.program_id(0)
    kt = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
    out = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + kt * 256 + tl.arange(0, 32)[None, :]
    mask = (offs_n < N)[:, None]
    for g in tl.static_range(8):
        w = _group(rows, kt, g, QTYPE)
        tl.store(out + 32 * g, w.to(out_ptr.dtype.element_ty), mask=mask)


def supported(qtype: int) -> bool:
    return int(qtype) in BLOCK_BYTES


def _check(raw: torch.Tensor, qtype: int, k: int) -> int:
    qtype = int(qtype)
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} has no Triton kernel (have {sorted(BLOCK_BYTES)})")
    if k % TILE_K:
        raise ValueError(f"k={k} must be a multiple of {TILE_K}")
    row_bytes = k // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]
    if (raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes
            or raw.stride(1) != 1):
        raise ValueError(f"raw must be uint8 [N, {row_bytes}] with contiguous rows for k={k}, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return qtype


def dequantize(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype = torch.bfloat16,
               block_n: int = 64) -> torch.Tensor:
    """``[N, k]`` weights in ``dtype`` from GGUF blocks ``raw`` (uint8 ``[N, row_bytes]``).
    Raises ValueError for a type without a kernel, ``k`` not a multiple of 256, or a shape that
    does not match."""
    qtype = _check(raw, qtype, k)
    n = raw.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    grid = (triton.cdiv(n, block_n), k // TILE_K)
    _dequant_rows[grid](raw, out, n, raw.stride(0), out.stride(0), QTYPE=qtype, BLOCK_N=block_n)
    return out


def _new_kernel_serves(raw: torch.Tensor, qtype: int, cfg: gguf_gemv.DecodeConfig) -> bool:
    """Whether ``gguf_gemv`` runs ``cfg``: its types, raw data 16-byte aligned and rows 16 bytes
    apart (2 for Q6_K): its gemv loads 32-bit words of Q4_K/Q5_K, 16-bit words of Q6_K."""
    step = 2 if qtype == gguf_gemv.Q6_K else 16
    return (cfg.kernel != "file" and qtype in gguf_gemv.TYPES and raw.data_ptr() % 16 == 0
            and raw.stride(0) % step == 0)


def _dequant_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The prefill path: W dequantized once to x's dtype, then cuBLAS."""
    return x @ dequantize(raw, qtype, k, x.dtype).t()


def _run_config(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
                cfg: gguf_gemv.DecodeConfig, x8=None) -> torch.Tensor | None:
    """The product under ``cfg``'s kernel (``dequant``, ``mma``, ``i8mma`` or ``gguf_gemv``'s;
    the last two take ``x8``), or None where that kernel does not take the type, M or raw's
    layout, or ``cfg`` is ``file``."""
    m = x.shape[0]
    if cfg.kernel == "dequant":
        return _dequant_matmul(x, raw, qtype, k)
    if cfg.kernel == "i8mma":
        return (gguf_i8mma.matmul(x, raw, qtype, k, cfg, x8)
                if gguf_i8mma.serves(raw, qtype, m) else None)
    if cfg.kernel == "mma":
        return gguf_mma.matmul(x, raw, qtype, k, cfg) if gguf_mma.serves(raw, qtype, m) else None
    if m <= gguf_gemv.MAX_M and _new_kernel_serves(raw, qtype, cfg):
        return gguf_gemv.matmul(x, raw, qtype, k, cfg, x8=x8)
    return None


# (qtype, gguf_gemv.decode_class(M)) -> the error of a default config that failed in this process
FAILED_DEFAULTS: dict[tuple[int, int], str] = {}


def _default_decode(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int, x8=None):
    """The product under ``gguf_gemv.default_config``, or None where that config does not serve
    the call or has failed to compile or run in this process: a model's decode then keeps
    running, on the file kernel (the prefill path past ``gguf_gemv.MAX_M`` rows), after one
    RuntimeWarning that names the config and the error."""
    key = (qtype, gguf_gemv.decode_class(x.shape[0]))
    cfg = gguf_gemv.default_config(qtype, x.shape[0])
    if key in FAILED_DEFAULTS:
        return None
    try:
        return _run_config(x, raw, qtype, k, cfg, x8)
    except (TritonError, RuntimeError) as exc:
        FAILED_DEFAULTS[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"the default decode config {cfg} for GGUF type {qtype} at M={x.shape[0]} "
                      f"failed ({FAILED_DEFAULTS[key][:300]}); the file-layout kernel or the "
                      "prefill path serves it in this process", RuntimeWarning, stacklevel=3)
        return None


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
           cfg: gguf_gemv.DecodeConfig | None = None, x8=None) -> torch.Tensor:
    """``x [M, k] · Wᵀ`` -> ``[M, N]`` in x's dtype (fp16/bf16/fp32), W the GGUF blocks ``raw``.
    Runs the kernel that ``cfg`` (None: ``gguf_gemv.default_config``, past DECODE_MAX_M rows
    its ``PREFILL_CONFIGS``) names: ``gguf_gemv``'s per-group kernels (Q4_K, Q5_K, Q6_K;
    M <= 16), ``gguf_mma``'s tensor-core kernel (Q4_K, Q6_K; 2 <= M <= 64), ``gguf_i8mma``'s
    int8 tensor-core kernel (Q4_K, Q5_K, Q6_K; M >= 2), the prefill path (``dequant``: W dequantized
    once, then cuBLAS) or this module's file-layout kernel (``file``: every type here, M <= 16;
    also where the named kernel does not take the type, M or raw's layout, the prefill path
    past 16 rows).
    A default config that fails to compile or run falls back to the file kernel with a warning
    (``FAILED_DEFAULTS``); a given config's errors propagate.
    ``x8``: ``gguf_q8.quantize(x)`` made once for several matrices (:func:`matmuls_same_x`).
    Raises ValueError as :func:`dequantize`, or when x is not ``[M, k]``."""
    qtype = _check(raw, qtype, k)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    m, n = x.shape[0], raw.shape[0]
    x = x.contiguous()
    y = (_default_decode(x, raw, qtype, k, x8) if cfg is None
         else _run_config(x, raw, qtype, k, cfg, x8))
    if y is not None:
        return y
    if m > gguf_gemv.MAX_M:
        return _dequant_matmul(x, raw, qtype, k)
    if cfg is None or cfg.kernel != "file":  # a type, M or layout the named kernel does not take
        cfg = gguf_gemv.FILE_CONFIG
    block_n = cfg.block_n
    tiles, n_programs = k // TILE_K, triton.cdiv(n, block_n)
    splits, per_split, y = gguf_gemv.split_output(cfg, x, n, n_programs, tiles)
    dot = tl.float32 if x.dtype == torch.float32 else (
        tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    _gemm_decode[(n_programs, splits)](
        x, raw, y, m, n, tiles, per_split, x.stride(0), raw.stride(0), y.stride(0), QTYPE=qtype,
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=block_n, SPLIT_K=splits, DOT_DTYPE=dot,
        IEEE=x.dtype == torch.float32, GEMV=m == 1, num_warps=cfg.num_warps)
    return y.to(x.dtype)


def matmuls_same_x(x: torch.Tensor, mats, k: int) -> list[torch.Tensor]:
    """:func:`matmul` (default configs) of one ``x`` ``[M, k]`` by each ``(raw, qtype)`` of
    ``mats`` (q, k and v), the same values as apart; where two or more of them round x to 8 bits
    (``gguf_gemv.rounds_x``), x is rounded once for them: a launch fewer each."""
    x, m = x.contiguous(), x.shape[0]
    share = [(qt, gguf_gemv.decode_class(m)) not in FAILED_DEFAULTS and gguf_gemv.rounds_x(qt, m)
             and _new_kernel_serves(raw, qt, gguf_gemv.default_config(qt, m)) for raw, qt in mats]
    x8 = gguf_q8.quantize(x) if sum(share) > 1 else None
    return [matmul(x, raw, qt, k, x8=x8 if s else None) for (raw, qt), s in zip(mats, share)]
