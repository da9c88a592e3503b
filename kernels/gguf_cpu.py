"""Matmul with GGUF quantized weights on the CPU, the weights kept in GGUF's own block layout
(``csrc/gguf_matmul.c``; block layouts from ggml's ggml-common.h, decoded the same way as the
``gguf`` package's ``gguf/quants.py``).

``matmul`` quantizes the activation rows once per call to 8 bits, as llama.cpp does (per 32
values for the 32-value block types, per 256 for the K-quants and IQ4_XS: float scale
``amax / 127``, codes rounded to nearest even), then takes integer dot products against the
weight codes (AVX2 maddubs, VNNI dpbusd where present) scaled in float once per block. Output
rows are split over torch's OpenMP threads; each weight row is read once per call whatever m.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (``SUPPORTED``),
and ``Q4_K_X8`` / ``Q6_K_X8``: Q4_K / Q6_K rows that ``repack`` rearranged 8 at a time (the same
bytes per weight, the idea of llama.cpp's repacked CPU layouts), so that one activation row meets
8 weight rows per instruction, one row a 32-bit lane, with no horizontal sums.

Reference twin: ``reference`` (``gguf.quants.dequantize`` + float64 matmul, the activations
optionally quantized as the kernel does).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import cpu_build

Q = GGMLQuantizationType
SUPPORTED = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                       Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS})
# Activation block (values per scale) by weight type: ggml's Q8_K for the 256-value types.
_ACT_BLOCK = {t: 256 if GGML_QUANT_SIZES[t][0] == 256 else 32 for t in SUPPORTED}
# Q4_K and Q6_K rows repacked 8 at a time (``repack``; the C's gguf_x8.h): not GGUF types, ids
# of this module's own that the entry points, ``RowSegments`` and ``dequantize`` take like one.
Q4_K_X8 = 1012
Q6_K_X8 = 1014
X8_ROWS = 8
# file type -> its repacked type, and back
REPACKED = {Q.Q4_K: Q4_K_X8, Q.Q6_K: Q6_K_X8}
_FILE_OF = {x8: t for t, x8 in REPACKED.items()}


def _file_type(qtype: int) -> Q:
    """The GGUF type whose blocks (sizes, values) qtype holds: Q4_K for ``Q4_K_X8``."""
    return _FILE_OF.get(int(qtype)) or Q(qtype)


def _name(qtype: int) -> str:
    t = int(qtype)
    return f"{_FILE_OF[t].name}_X8" if t in _FILE_OF else Q(t).name


def _served(qtype: int) -> bool:
    return int(qtype) in _FILE_OF or int(qtype) in SUPPORTED

# What the kernel does with the activations: round them to 8 bits per block ("q8", llama.cpp's
# way: integer dot products) or keep them float32 ("f32": the float product of the file's values).
ACTIVATIONS = ("q8", "f32")

# Bytes of quantized activation rows one thread keeps in L2 while it sweeps a chunk of weights
# (a tile of m), and bytes of weight rows per chunk of work: small enough that a 2-thread decode
# step gets many chunks to balance, large enough that a chunk's rows stream sequentially.
X_TILE_BYTES = 160 * 1024
W_CHUNK_BYTES = 48 * 1024
CHUNKS_PER_THREAD = 4  # the schedule's slack for a thread that starts late
# Weight bytes x rows below which one thread beats entering a parallel region.
MIN_PARALLEL_WORK = 64 * 1024

_i64, _int, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "lg_gguf_matmul": [_p, _i64, _i64, _p, _i64, _i64, _int, _p, _int, _i64, _i64, _int],
    "lg_gguf_matmul_f32": [_p, _i64, _i64, _p, _i64, _i64, _int, _p, _int, _i64, _i64, _int],
    "lg_gguf_dequant": [_p, _i64, _i64, _int, _i64, _p, _int],
    "lg_gguf_supported": [_int],
    "lg_gguf_simd": [],
    "lg_gguf_repack": [_int, _p, _i64, _i64, _p, _int, _int],
}


def _lib():
    lib = cpu_build.library("gguf_matmul", _SIGNATURES)
    if lib is not None and not getattr(lib, "_lg_xrow", False):
        lib.lg_gguf_xrow_bytes.argtypes = [_int, _i64]
        lib.lg_gguf_xrow_bytes.restype = _i64
        lib._lg_xrow = True
    return lib


def available() -> bool:
    """True when the C library could be built and loaded on this machine."""
    return _lib() is not None


def simd() -> bool:
    """True when the library was compiled with its AVX2 kernels (else it runs scalar C)."""
    lib = _lib()
    return lib is not None and bool(lib.lg_gguf_simd())


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k values of qtype. Raises ValueError if k is not a multiple of the
    type's block."""
    block, size = GGML_QUANT_SIZES[_file_type(qtype)]
    if k <= 0 or k % block:
        raise ValueError(f"gguf_cpu: k={k} is not a positive multiple of {_name(qtype)}'s "
                         f"block of {block} values")
    return k // block * size


def _check(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> None:
    """Raise ValueError unless x is [m, k] and raw [n, row_bytes(qtype, k)] uint8 with unit
    stride along its bytes, both on the CPU."""
    want = row_bytes(qtype, k)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"gguf_cpu: x has shape {tuple(x.shape)}, expected [m, {k}]")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
        raise ValueError(f"gguf_cpu: raw has shape {tuple(raw.shape)} {raw.dtype}, expected "
                         f"[n, {want}] uint8 for {_name(qtype)} with k={k}")
    if raw.shape[0] and raw.stride(1) != 1:
        raise ValueError(f"gguf_cpu: raw's bytes must be contiguous within a row (strides "
                         f"{raw.stride()})")
    if x.device.type != "cpu" or raw.device.type != "cpu":
        raise ValueError(f"gguf_cpu: tensors must be on the CPU (x on {x.device}, raw on "
                         f"{raw.device})")


@functools.lru_cache(maxsize=1024)
def _layout(qtype: int, k: int) -> tuple[int, int]:
    """(bytes of a weight row, bytes of a quantized activation row) for k values of qtype.
    Raises ValueError as ``row_bytes``."""
    return row_bytes(qtype, k), int(_lib().lg_gguf_xrow_bytes(qtype, k))


def _plan(m: int, n: int, k: int, qtype: int, wrow: int, xrow: int) -> tuple[int, int, int]:
    """(threads, m_tile, n_chunk) for one call: tiles of m in multiples of 4 (the kernel's
    rows per weight unpack) of ``xrow``-byte activation rows, chunks of n of at most
    W_CHUNK_BYTES (a chunk stays in cache while each tile reads it), at least
    CHUNKS_PER_THREAD a thread. The C hands the chunks out guided (OpenMP's ``schedule(guided)``):
    a thread's first take is a long run of consecutive chunks, which the hardware prefetcher
    streams, and the last takes are single chunks, so the threads finish together."""
    threads = torch.get_num_threads() if n * wrow * m >= MIN_PARALLEL_WORK else 1
    m_tile = max(4, X_TILE_BYTES // xrow // 4 * 4)
    n_chunk = max(1, min(W_CHUNK_BYTES // wrow, -(-n // (CHUNKS_PER_THREAD * threads))))
    return threads, m_tile, n_chunk


def entry_address(activations: str = "q8") -> int | None:
    """The address of the C entry that ``matmul`` calls for ``activations`` (``lg_gguf_matmul``
    or ``lg_gguf_matmul_f32``, one signature), for C code that multiplies without returning to
    Python (``layer_ops_cpu``'s decode drivers); None where the library cannot be built. Raises
    ValueError for another ``activations``."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    lib = _lib()
    if lib is None:
        return None
    entry = lib.lg_gguf_matmul_f32 if activations == "f32" else lib.lg_gguf_matmul
    return ctypes.cast(entry, ctypes.c_void_p).value


def work_split(m: int, raw: torch.Tensor, qtype: int, k: int,
               activations: str = "q8") -> tuple[int, int, int]:
    """(threads, m_tile, n_chunk): the work split ``matmul`` gives m activation rows against
    raw ``[n, row_bytes]`` of qtype, for callers of ``entry_address``. Raises ValueError as
    ``row_bytes``."""
    wrow, xrow = _layout(int(qtype), k)
    return _plan(m, raw.shape[0], k, int(qtype), wrow, 4 * k if activations == "f32" else xrow)


def _matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int, scalar: bool = False,
            activations: str = "q8") -> torch.Tensor | None:
    """``matmul`` with the choice of the scalar C path (``scalar=True``, for tests)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    qtype = int(qtype)
    if not _served(qtype):
        return None
    lib = _lib()
    if lib is None:
        return None
    wrow = _layout(qtype, k)[0]
    # one expression for the common case (a decode step calls this per linear layer); _check
    # says what is wrong otherwise
    if not (x.dim() == 2 and x.shape[1] == k and raw.dtype == torch.uint8 and raw.dim() == 2
            and raw.shape[1] == wrow and raw.stride(1) == 1 and x.is_cpu and raw.is_cpu):
        _check(x, raw, qtype, k)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m, n = x.shape[0], raw.shape[0]
    y = x.new_empty((m, n))
    if m == 0 or n == 0:
        return y.zero_()
    f32 = activations == "f32"
    threads, m_tile, n_chunk = _plan(m, n, k, qtype, wrow, 4 * k if f32 else _layout(qtype, k)[1])
    entry = lib.lg_gguf_matmul_f32 if f32 else lib.lg_gguf_matmul
    rc = entry(x.data_ptr(), m, k, raw.data_ptr(), n, raw.stride(0), qtype, y.data_ptr(),
               threads, m_tile, n_chunk, int(scalar))
    if rc:
        _raise(rc, x, raw, qtype)
    return y


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
           activations: str = "q8") -> torch.Tensor | None:
    """``y = x @ W.T`` with W stored as GGUF blocks.

    x: ``[m, k]`` float32 (bf16/fp16 are converted); raw: ``[n, row_bytes]`` uint8, row r
    holding W's row r as k / block_size blocks of ``qtype`` (a ``gguf.GGMLQuantizationType``
    value), bytes contiguous within a row; k: the values per row. Returns ``[m, n]`` float32,
    or None when the type is not in ``SUPPORTED`` or the C library cannot be built.
    ``activations="q8"``: the activations are quantized to 8 bits per block on the way (see the
    module docstring): the result differs from the float product by at most
    ``sum |w| * amax_block / 254`` per element. ``"f32"``: x stays float32 and each block's codes
    are converted to float in registers, so the result equals x times the dequantized matrix up
    to float32 rounding (more instructions a weight; the same weight bytes read).

    Raises ValueError when k is not a multiple of the type's block or the shapes disagree
    (naming them), MemoryError when the activation buffer cannot be allocated.
    """
    return _matmul(x, raw, qtype, k, activations=activations)


def product(raw: torch.Tensor, qtype: int, k: int,
            activations: str = "q8") -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``matmul`` bound to one weight: a function ``x -> x @ W.T`` (``[m, k]`` -> float32
    ``[m, n]``, the same values as ``matmul``) that checks, looks up and plans what it can once,
    for callers that multiply the same matrix many times (a decode step's matrices). x must be on
    the CPU; other dtypes and strides are converted. None where ``matmul`` would return None.
    Raises ValueError as ``matmul`` (here for raw's shape; at a call for x's)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    qtype = int(qtype)
    lib = _lib() if _served(qtype) else None
    if lib is None:
        return None
    _check(torch.empty((0, k)), raw, qtype, k)
    f32 = activations == "f32"
    wrow = _layout(qtype, k)[0]
    xrow = 4 * k if f32 else _layout(qtype, k)[1]
    entry = lib.lg_gguf_matmul_f32 if f32 else lib.lg_gguf_matmul
    n = raw.shape[0]

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu or x.shape[0] == 0 or n == 0:
            return _matmul(x, raw, qtype, k, activations=activations)  # says what is wrong
        m = x.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        threads, m_tile, n_chunk = _plan(m, n, k, qtype, wrow, xrow)
        rc = entry(x.data_ptr(), m, k, raw.data_ptr(), n, raw.stride(0), qtype, y.data_ptr(),
                   threads, m_tile, n_chunk, 0)
        if rc:
            _raise(rc, x, raw, qtype)
        return y

    return run


# The C's T_SEGMENTS and MAX_SEGMENTS: a matrix given as a table of row segments.
SEGMENTS = 1000
MAX_SEGMENTS = 4


class _Segment(ctypes.Structure):
    _fields_ = [("w", _p), ("n", _i64), ("w_stride", _i64), ("qtype", _int)]


class _Segments(ctypes.Structure):
    _fields_ = [("count", _int), ("seg", _Segment * MAX_SEGMENTS)]


class RowSegments:
    """Matrices of k values a row, each in its own GGUF type, stacked along rows without a copy
    (Q4_K_M's q, k and v, whose types differ), for the C entry points as one matrix: pass
    ``address`` as the weight, ``n`` rows, ``qtype`` ``SEGMENTS``. A call quantizes x once per
    activation block size and sweeps every segment in one parallel region; each output equals
    ``matmul`` of its own segment bit for bit. Holds the raw tensors, so the addresses stay valid
    while it lives.

    raws: up to ``MAX_SEGMENTS`` ``[n_j, row_bytes]`` uint8 CPU tensors; qtypes: their types (in
    ``SUPPORTED``). Raises ValueError as ``matmul`` for a bad raw, or for no, too many or an
    unsupported segment."""

    def __init__(self, raws: Sequence[torch.Tensor], qtypes: Sequence[int], k: int):
        if not 1 <= len(raws) <= MAX_SEGMENTS or len(raws) != len(qtypes):
            raise ValueError(f"gguf_cpu: {len(raws)} segments with {len(qtypes)} types; 1 to "
                             f"{MAX_SEGMENTS} segments, one type each")
        for raw, qtype in zip(raws, qtypes):
            if not _served(qtype):
                raise ValueError(f"gguf_cpu: segment type {_name(qtype)} is not in SUPPORTED")
            _check(torch.empty((0, k)), raw, int(qtype), k)
        self.raws, self.qtypes, self.k = tuple(raws), tuple(int(t) for t in qtypes), k
        self.n = sum(r.shape[0] for r in raws)
        self.qtype = SEGMENTS
        self._table = _Segments(len(raws))
        for j, (raw, qtype) in enumerate(zip(raws, self.qtypes)):
            self._table.seg[j] = _Segment(raw.data_ptr(), raw.shape[0], raw.stride(0), qtype)
        self.address = ctypes.addressof(self._table)

    def work_split(self, m: int, activations: str = "q8") -> tuple[int, int, int]:
        """(threads, m_tile, n_chunk) for m activation rows: ``work_split``'s for the widest
        rows of any segment over all n rows."""
        layouts = [_layout(t, self.k) for t in self.qtypes]
        wrow = max(w for w, _ in layouts)
        xrow = 4 * self.k if activations == "f32" else max(x for _, x in layouts)
        return _plan(m, self.n, self.k, SEGMENTS, wrow, xrow)

    def matmul(self, x: torch.Tensor, activations: str = "q8") -> torch.Tensor:
        """``x @ W.T`` for x ``[m, k]`` (float32, or converted) -> ``[m, n]`` float32: the
        segments' products side by side. Raises ValueError for x's shape or ``activations``."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        if x.dim() != 2 or x.shape[1] != self.k or not x.is_cpu:
            raise ValueError(f"gguf_cpu: x has shape {tuple(x.shape)} on {x.device}, expected "
                             f"[m, {self.k}] on the CPU")
        x = x.to(torch.float32).contiguous()
        lib = _lib()
        entry = lib.lg_gguf_matmul_f32 if activations == "f32" else lib.lg_gguf_matmul
        y = torch.empty((x.shape[0], self.n), dtype=torch.float32)
        threads, m_tile, n_chunk = self.work_split(x.shape[0], activations)
        rc = entry(x.data_ptr(), x.shape[0], self.k, self.address, self.n, 0, SEGMENTS,
                   y.data_ptr(), threads, m_tile, n_chunk, 0)
        if rc:
            raise ValueError(f"gguf_cpu: the kernel rejected x {tuple(x.shape)} against "
                             f"segments {[_name(t) for t in self.qtypes]} (code {rc})")
        return y


def _raise(rc: int, x: torch.Tensor, raw: torch.Tensor, qtype: int) -> None:
    """The error for the kernel's return code ``rc`` (nonzero)."""
    if rc == -3:
        raise MemoryError(f"gguf_cpu: no memory for the quantized activations of x "
                          f"{tuple(x.shape)}")
    raise ValueError(f"gguf_cpu: the kernel rejected x {tuple(x.shape)}, raw "
                     f"{tuple(raw.shape)} {_name(qtype)} (code {rc})")


def dequantize(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """W as float32 ``[n, k]`` from raw ``[n, row_bytes]`` uint8 GGUF blocks (the scalar C
    decoding, threaded over rows; equal to ``gguf.quants.dequantize``), or None where the type
    is not in ``SUPPORTED`` or the library cannot be built. Raises ValueError as ``matmul``."""
    if not _served(qtype):
        return None
    _check(torch.empty((0, k)), raw, qtype, k)
    lib = _lib()
    if lib is None:
        return None
    out = torch.empty((raw.shape[0], k), dtype=torch.float32)
    rc = lib.lg_gguf_dequant(raw.data_ptr(), raw.shape[0], raw.stride(0), int(qtype), k,
                             out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"gguf_cpu: the kernel rejected raw {tuple(raw.shape)} {_name(qtype)}")
    return out


def quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x ``[m, k]`` as the kernel sees it after its 8-bit quantization, as float64 (exact): per
    ``block`` values, scale ``amax / 127`` and codes ``round(x * (127 / amax))`` (half to
    even), both computed in float32 as the C does."""
    xb = x.to(torch.float32).reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor divides; scalar / tensor takes a reciprocal
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).double() * (amax / c127).double()).reshape(x.shape)


def reference(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int,
              quantize_x: bool = False) -> torch.Tensor:
    """The pure-torch twin of ``matmul``: ``gguf.quants.dequantize`` of raw, then a float64
    matmul with x (quantized as the kernel does when ``quantize_x``). Returns ``[m, n]``
    float64. Raises ValueError as ``matmul``."""
    from gguf.quants import dequantize as gguf_dequantize

    _check(x, raw, qtype, k)
    if int(qtype) in _FILE_OF:
        raw = repack(raw, qtype, k, unpack=True)
    w = gguf_dequantize(np.ascontiguousarray(raw.numpy()), _file_type(qtype))
    xs = quantize_activations(x, _ACT_BLOCK[_file_type(qtype)]) if quantize_x else x
    return xs.to(torch.float64) @ torch.from_numpy(w).to(torch.float64).T


def repackable(raw: torch.Tensor, qtype: int, k: int) -> bool:
    """Whether ``repack`` applies: rows ``[n, row_bytes]`` of a type in ``REPACKED`` (Q4_K,
    Q6_K), n a multiple of 8, rows back to back, on the CPU, and the library built with its SIMD
    kernels (the repacked layout's fast path)."""
    return (int(qtype) in REPACKED and raw.dim() == 2 and raw.shape[0] % X8_ROWS == 0
            and raw.is_cpu and raw.is_contiguous() and raw.dtype == torch.uint8 and k % 256 == 0
            and raw.shape[1] == row_bytes(qtype, k) and simd())


def repack(raw: torch.Tensor, qtype: int, k: int, unpack: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``raw`` ``[n, row_bytes]`` (n a multiple of 8, contiguous, CPU) of a type in
    ``REPACKED`` rearranged 8 rows at a time into its repacked layout (``Q4_K_X8``, ``Q6_K_X8``;
    the C's gguf_q4k_x8.h and gguf_q6k_x8.h: per 8 rows and 256 values, the 8 rows' scales and
    codes side by side), or, with ``unpack``, a repacked matrix back to the file's blocks. The
    same bytes per weight, so the result has raw's shape; ``out`` (may be raw itself, for no
    second copy) receives it. qtype: the type raw holds (Q4_K or Q6_K; with ``unpack`` their
    repacked ids). Raises ValueError for another type or a bad shape, RuntimeError where the
    library cannot be built, MemoryError when a group's copy cannot be allocated (an in-place
    call then leaves raw part done)."""
    want = _FILE_OF if unpack else REPACKED
    if int(qtype) not in want:
        raise ValueError(f"gguf_cpu.repack: raw holds {_name(qtype)}, expected one of "
                         f"{[_name(t) for t in want]}")
    _check(torch.empty((0, k)), raw, qtype, k)
    if raw.shape[0] % X8_ROWS or not raw.is_contiguous():
        raise ValueError(f"gguf_cpu.repack: raw {tuple(raw.shape)} needs a multiple of "
                         f"{X8_ROWS} rows, back to back")
    lib = _lib()
    if lib is None:
        raise RuntimeError("gguf_cpu.repack: the C library cannot be built on this machine")
    out = torch.empty_like(raw) if out is None else out
    if out.shape != raw.shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"gguf_cpu.repack: out {tuple(out.shape)} {out.dtype} must be a "
                         f"contiguous uint8 {tuple(raw.shape)}")
    rc = lib.lg_gguf_repack(int(_file_type(qtype)), raw.data_ptr(), raw.shape[0], k,
                            out.data_ptr(), int(unpack), torch.get_num_threads())
    if rc == -3:
        raise MemoryError(f"gguf_cpu.repack: no memory for a group of {X8_ROWS} rows")
    if rc:
        raise ValueError(f"gguf_cpu.repack: the kernel rejected raw {tuple(raw.shape)} (code {rc})")
    return out
