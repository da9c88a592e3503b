"""GGUF quantized matrices kept as the file stores them: block facts, a pure-torch dequantizer
and a packed weight that multiplies from its blocks.

Layouts are llama.cpp's (``ggml-common.h``: ``block_q4_0`` … ``block_iq4_xs``) as ``gguf.quants``
reads them; block sizes and bytes come from ``gguf.constants.GGML_QUANT_SIZES``. A 2-D GGUF tensor
of ``ne0 = in_features``, ``ne1 = out_features`` is row-major with its blocks along ``ne0``: row
``r`` (output feature ``r``) is ``in_features / block_size`` consecutive blocks, so a matrix is a
uint8 tensor ``[out_features, bytes_per_row]`` whose rows are whole blocks. Rows are therefore
independent: gathering, permuting (llama.cpp's Q/K permutation) or stacking rows (fused q/k/v)
moves raw bytes and changes no value.

``dequantize`` follows ``gguf.quants``' arithmetic op for op (float32, same order), so it equals
``gguf.quants.dequantize`` bit for bit; it runs on CPU and CUDA tensors, vectorized over blocks.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import IQ4_NL

# Types `PackedGGUFWeight` keeps compressed (F32/F16/BF16 stay plain tensors).
PACKED_TYPES: frozenset[Q] = frozenset({
    Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS})
FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})

# Weights dequantized at once by the reference matmul: 32 MiB of float32 a chunk, so a large
# matrix (an lm_head) never expands whole; the dequantization's temporaries are ~3x a chunk.
CHUNK_WEIGHTS = 1 << 23


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation along rows (dim 0) of a ``[rows, ...]`` tensor.

    llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) views each head's
    rows as ``[2, head_dim/2]`` and transposes to ``[head_dim/2, 2]`` (pairs interleaved); the
    inverse views ``[head_dim/2, 2]`` and transposes back. `n_head` is the number of heads the
    rows hold (num_kv_heads for K). Rows move whole, so it applies to float rows and to rows of
    blocks alike.
    """
    return unpermuted_heads(w, n_head).reshape(w.shape)


def unpermuted_heads(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``w``'s rows as ``[n_head, 2, head_dim/2, ...]`` in HF order: a view (no copy) whose rows,
    read in order, are ``unpermute_qk(w, n_head)``'s."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2)


def block_size(qtype: int) -> int:
    """Weights per block of ``qtype`` (32, or 256 for K-quants and IQ4_XS). KeyError if unknown."""
    return GGML_QUANT_SIZES[Q(qtype)][0]


def type_size(qtype: int) -> int:
    """Bytes per block of ``qtype`` (e.g. Q4_K: 144). KeyError if unknown."""
    return GGML_QUANT_SIZES[Q(qtype)][1]


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights. ValueError unless it is whole blocks."""
    bs = block_size(qtype)
    if in_features % bs:
        raise ValueError(f"{Q(qtype).name} rows hold whole {bs}-weight blocks; "
                         f"{in_features} weights a row is not a multiple")
    return in_features // bs * type_size(qtype)


def bits_per_weight(qtype: int) -> float:
    """Stored bits per weight, scales included (Q4_K: 4.5)."""
    return 8 * type_size(qtype) / block_size(qtype)


# ---- the dequantizer: one function per type, blocks [N, type_size] uint8 -> [N, block] f32 ----

def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of each block as float32 ``[N, 1]``."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: Iterable[int], mask: int, dim: int = -2) -> torch.Tensor:
    """``(b >> s) & mask`` for each shift, stacked at ``dim`` (a loop over shifts, not blocks)."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=dim)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[N, 16]`` bytes -> ``[N, 32]`` codes: the low nibbles, then the high ones."""
    return _bits(qs, (0, 4), 15).reshape(qs.shape[0], -1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[N, 4]`` bytes read as a little-endian uint32 -> ``[N, 32]`` bits, bit 0 first."""
    return _bits(qh, range(8), 1, dim=-1).reshape(qh.shape[0], 32)


def _q4_0(b):
    return (_nibbles(b[:, 2:]).view(torch.int8) - 8).float().mul_(_f16(b, 0))


def _q4_1(b):
    return _nibbles(b[:, 4:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_qh_bits(b[:, 2:6]) << 4)
    return (q.view(torch.int8) - 16).float().mul_(_f16(b, 0))


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_qh_bits(b[:, 4:8]) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b):
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q2_k(b):  # scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin
    n, sc = b.shape[0], b[:, :16]
    dl = (_f16(b, 80) * (sc & 15).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    return q.float().mul_(dl).sub_(ml).reshape(n, 256)


def _q3_k(b):  # hmask[32], qs[64], scales[12] (6-bit, split 4 + 2), d
    n, sc = b.shape[0], b[:, 96:108]
    low = _bits(sc[:, :8], (0, 4), 15).reshape(n, 16)
    high = _bits(sc[:, 8:12], (0, 2, 4, 6), 3).reshape(n, 16)
    dl = (_f16(b, 108) * ((low | (high << 4)).float() - 32)).reshape(n, 16, 1)
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    hm = _bits(b[:, :32].reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16)
    q = ql.view(torch.int8) - ((hm ^ 1) << 2).view(torch.int8)  # a clear hmask bit subtracts 4
    return q.float().mul_(dl).reshape(n, 256)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K ``scales[12]`` -> eight 6-bit scales and eight 6-bit mins, float32 ``[N, 8]``."""
    s = sc.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scale.float(), mn.float()


def _q4_k(b):  # d, dmin, scales[12], qs[128]
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    q = _bits(b[:, 16:144].reshape(n, 4, 32), (0, 4), 15).reshape(n, 8, 32)
    return q.float().mul_(d).sub_(dm).reshape(n, 256)


def _q5_k(b):  # d, dmin, scales[12], qh[32], qs[128]
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)
    ql = _bits(b[:, 48:176].reshape(n, 4, 32), (0, 4), 15).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)
    return (ql | (qh << 4)).float().mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(b):  # ql[128], qh[64], int8 scales[16], d
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    ql = _bits(b[:, :128].reshape(n, 2, 64), (0, 4), 15).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    return q.reshape(n, 16, 16).float().mul_(d).reshape(n, 256)


_KVALUES: dict[torch.device, torch.Tensor] = {}


def _kvalues(codes: torch.Tensor) -> torch.Tensor:
    """IQ4_NL's non-linear code book (``gguf.quants.IQ4_NL.kvalues``) looked up for 4-bit
    ``codes``: float32 of their shape. The 16-entry table is made once per device (a
    host-to-device copy inside a CUDA graph capture would fail)."""
    t = _KVALUES.get(codes.device)
    if t is None:
        t = _KVALUES[codes.device] = torch.tensor(IQ4_NL.kvalues, dtype=torch.float32,
                                                  device=codes.device)
    return t.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _iq4_nl(b):  # d, qs[16]
    return _kvalues(_nibbles(b[:, 2:])).mul_(_f16(b, 0))


def _iq4_xs(b):  # d, scales_h (uint16, 2 bits a sub-block), scales_l[4] (4 bits), qs[128]
    n = b.shape[0]
    low = _bits(b[:, 4:8], (0, 4), 15, dim=-1).reshape(n, 8)
    h16 = b[:, 2].int() | (b[:, 3].int() << 8)
    high = _bits(h16[:, None], range(0, 16, 2), 3, dim=-1).reshape(n, 8)
    dl = (_f16(b, 0) * ((low | (high << 4)).float() - 32)).reshape(n, 8, 1)
    q = _bits(b[:, 8:136].reshape(n, 8, 16), (0, 4), 15).reshape(n, 8, 32)
    return _kvalues(q).mul_(dl).reshape(n, 256)


_DEQUANTIZE: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}
assert _DEQUANTIZE.keys() == PACKED_TYPES


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw GGUF rows ``[rows, row_bytes]`` uint8 (CPU or CUDA) -> ``[rows, row_bytes /
    type_size * block_size]`` in ``dtype``, computed in float32 exactly as
    ``gguf.quants.dequantize`` does (bit-equal in float32), then rounded once to ``dtype``.

    Raises ValueError for a type outside ``PACKED_TYPES``, a non-uint8 or non-2-D ``raw``, or
    rows that are not whole blocks."""
    qtype = Q(qtype)
    fn = _DEQUANTIZE.get(qtype)
    if fn is None:
        raise ValueError(f"no reference dequantizer for GGUF type {qtype.name}")
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"raw blocks must be a 2-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    rows, nbytes = raw.shape
    if nbytes % type_size(qtype):
        raise ValueError(f"{qtype.name} rows of {nbytes} bytes are not whole "
                         f"{type_size(qtype)}-byte blocks")
    w = fn(raw.reshape(-1, type_size(qtype)))
    return w.reshape(rows, -1).to(dtype)


def reference_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[m, k]`` and ``W`` given as raw rows ``[n, row_bytes]`` (same
    device): W dequantized to ``x.dtype`` ``CHUNK_WEIGHTS`` weights at a time, each chunk one
    ``F.linear``. Returns ``[m, n]`` in ``x.dtype``."""
    n, k = raw.shape[0], x.shape[1]
    step = max(1, CHUNK_WEIGHTS // k)
    if step >= n:
        return F.linear(x, dequantize(raw, qtype, x.dtype))
    out = x.new_empty(x.shape[0], n)
    for s in range(0, n, step):
        out[:, s:s + step] = F.linear(x, dequantize(raw[s:s + step], qtype, x.dtype))
    return out


# "0": never the C kernel (it quantizes activations to 8 bits): the exact float reference
CPU_KERNEL_ENV = "LOCALGEN_GGUF_CPU_KERNEL"
_cpu_kernels = None  # localgen.kernels.gguf_cpu once looked up; False where it does not import


def _cpu_kernel_module_any():
    """localgen.kernels.gguf_cpu whatever ``LOCALGEN_GGUF_CPU_KERNEL`` says (a repacked matrix
    needs it to unpack)."""
    from localgen.kernels import gguf_cpu

    return gguf_cpu


def _cpu_kernel_module():
    global _cpu_kernels
    if os.environ.get(CPU_KERNEL_ENV, "1") == "0":
        return None
    if _cpu_kernels is None:
        try:
            from localgen.kernels import gguf_cpu
        except ImportError:
            gguf_cpu = False
        _cpu_kernels = gguf_cpu
    return _cpu_kernels or None


# "f32" keeps the CPU kernel's activations in float32 (the product of the file's values, as the
# expanded float32 matrices give it); the default "q8" rounds them to 8 bits per block as
# llama.cpp does, for integer dot products at several times the speed
CPU_ACTIVATIONS_ENV = "LOCALGEN_GGUF_ACTIVATIONS"


def cpu_activations() -> str:
    """The CPU kernel's activation precision, ``LOCALGEN_GGUF_ACTIVATIONS`` (``q8``, the
    default, or ``f32``). Raises ValueError naming the variable for any other value."""
    mode = os.environ.get(CPU_ACTIVATIONS_ENV, "q8").lower()
    if mode not in ("q8", "f32"):
        raise ValueError(f"{CPU_ACTIVATIONS_ENV}={mode!r}: use q8 (8-bit activations, fastest) "
                         "or f32 (float32 activations, the dequantized product)")
    return mode


def _cpu_kernel_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """``localgen.kernels.gguf_cpu.matmul`` (float32 ``[m, n]``) where it imports and serves
    ``qtype``; None where the reference must run."""
    mod = _cpu_kernel_module()
    if mod is None:
        return None
    return mod.matmul(x.float().contiguous(), raw, int(qtype), x.shape[1],
                      activations=cpu_activations())


def cpu_kernel_serves(qtype: int) -> bool:
    """Whether the compiled CPU kernel is built on this machine and reads ``qtype``: without it a
    packed matrix is dequantized at every call, so a CPU model loads expanded instead."""
    mod = _cpu_kernel_module()
    return mod is not None and mod.available() and Q(qtype) in mod.SUPPORTED


# "0": keep every CPU decode matrix in the file's block layout (no repack)
CPU_REPACK_ENV = "LOCALGEN_GGUF_REPACK"


def repack_for_cpu(w: "PackedGGUFWeight", mod) -> None:
    """Rearrange w's rows in place into the C kernel's layout for quantized-activation products
    (``gguf_cpu.repack``: Q4_K or Q6_K rows 8 at a time, the same bytes) where it applies, the
    activations are ``q8`` (float32 activations would unpack each row a product) and
    ``LOCALGEN_GGUF_REPACK`` is not 0; w then multiplies, dequantizes and moves as before
    (``kernel_qtype``, ``file_raw``). Only a raw that is its whole storage is rearranged: a
    view into a larger buffer (the offload runtime wraps its layer buffers anew each step) may
    be read as the file's blocks through another wrapper. Raises MemoryError as
    ``gguf_cpu.repack``."""
    # every product of a CPU matrix passes here: the type test (done, or never repacked) first,
    # before the environment and storage look-ups
    if w.kernel_qtype != int(w.qtype) or int(w.qtype) not in getattr(mod, "REPACKED", ()):
        return
    raw = w.raw
    if (os.environ.get(CPU_REPACK_ENV, "1") == "0" or cpu_activations() != "q8"
            or raw.storage_offset() or raw.untyped_storage().nbytes() != raw.numel()
            or not mod.repackable(raw, int(w.qtype), w.shape[1])):
        return
    mod.repack(w.raw, int(w.qtype), w.shape[1], out=w.raw)
    w._kernel_qtype = mod.REPACKED[int(w.qtype)]


def _cuda_kernel_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """``localgen.kernels.gguf_gemm.matmul`` (Triton) where it serves ``qtype`` and the shape;
    None where the reference must run."""
    try:
        from localgen.kernels import gguf_gemm
    except ImportError:  # no triton
        return None
    k = x.shape[1]
    if not gguf_gemm.supported(int(qtype)) or k % gguf_gemm.TILE_K:
        return None
    return gguf_gemm.matmul(x.contiguous(), raw, int(qtype), k)


def products_same_x(x: torch.Tensor, weights: Sequence["PackedGGUFWeight"]):
    """``[w(x) for w in weights]`` (no bias) for 2-D ``x`` on CUDA through
    ``gguf_gemm.matmuls_same_x``, which rounds x to 8 bits once for the matrices whose decode
    kernels take it so (q, k and v read one x); None unless every weight is a
    ``PackedGGUFWeight`` the Triton kernels serve on x's device."""
    if x.dim() != 2 or not x.is_cuda or not all(type(w) is PackedGGUFWeight for w in weights):
        return None
    try:
        from localgen.kernels import gguf_gemm
    except ImportError:  # no triton
        return None
    k = x.shape[1]
    if k % gguf_gemm.TILE_K or any(not gguf_gemm.supported(int(w.qtype)) or w.shape[1] != k
                                   or w.raw.device != x.device for w in weights):
        return None
    ys = gguf_gemm.matmuls_same_x(x, [(w.raw, int(w.qtype)) for w in weights], k)
    return [y.to(x.dtype) for y in ys]


class PackedGGUFWeight:
    """A 2-D GGUF matrix ``[out_features, in_features]`` held as the file's blocks.

    ``raw``: uint8 ``[out_features, row_bytes(qtype, in_features)]``, the file's bytes of each
    row (bits per weight are the file's; on the CPU a Q4_K or Q6_K matrix is rearranged in
    place at its first product, ``repack_for_cpu``, and ``file_raw`` gives the file's bytes
    back);
    ``qtype``: a ``PACKED_TYPES`` member.
    Callable as ``w(x, bias)`` -> ``x @ W.T (+ bias)`` in x's dtype (``quant.linear``'s
    contract): on the CPU through ``localgen.kernels.gguf_cpu`` and on CUDA through
    ``localgen.kernels.gguf_gemm`` where they serve the type, else by ``reference_matmul``. Raises ValueError on a type or shape mismatch.
    """

    def __init__(self, raw: torch.Tensor, qtype: int, shape: Sequence[int]):
        self.qtype = Q(qtype)
        if self.qtype not in PACKED_TYPES:
            raise ValueError(f"GGUF type {self.qtype.name} is not one PackedGGUFWeight holds")
        out_features, in_features = (int(s) for s in shape)
        want = (out_features, row_bytes(self.qtype, in_features))
        if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
            raise ValueError(f"{self.qtype.name} {out_features}x{in_features} needs uint8 rows "
                             f"{want}, got {raw.dtype} {tuple(raw.shape)}")
        self.raw, self.shape = raw, (out_features, in_features)
        self._cpu_products: dict = {}  # activations -> gguf_cpu.product bound to raw
        self._kernel_qtype = int(self.qtype)  # a gguf_cpu.REPACKED type once repack_for_cpu ran

    @property
    def kernel_qtype(self) -> int:
        """The layout raw holds, as the CPU kernel's type id: ``int(qtype)`` (the file's
        blocks), or ``gguf_cpu.REPACKED[qtype]`` after ``repack_for_cpu``."""
        return self.__dict__.get("_kernel_qtype", int(self.qtype))

    def file_raw(self) -> torch.Tensor:
        """raw as the file's blocks: raw itself, or an unpacked copy of a repacked raw."""
        if self.kernel_qtype == int(self.qtype):
            return self.raw
        return _cpu_kernel_module_any().repack(self.raw, self.kernel_qtype, self.shape[1],
                                               unpack=True)

    def __repr__(self) -> str:
        return f"PackedGGUFWeight({self.qtype.name}, shape={self.shape}, device={self.device})"

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the file's bytes for this tensor."""
        return self.raw.numel()

    decode_nbytes = nbytes  # what a matmul reads (``CausalLM.weight_bytes``' name for it)

    def _file_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of raw as the file's blocks; of a repacked raw only the 8-row groups
        that hold them are unpacked (a tied embedding's lookup reads a few rows a step)."""
        if self.kernel_qtype == int(self.qtype):
            return self.raw.index_select(0, ids)
        mod = _cpu_kernel_module_any()
        groups = torch.unique(ids // mod.X8_ROWS)
        rows = (groups[:, None] * mod.X8_ROWS + torch.arange(mod.X8_ROWS)).reshape(-1)
        part = mod.repack(self.raw.index_select(0, rows), self.kernel_qtype, self.shape[1],
                          unpack=True)
        at = torch.searchsorted(groups, ids // mod.X8_ROWS) * mod.X8_ROWS + ids % mod.X8_ROWS
        return part.index_select(0, at)

    def to(self, device: torch.device | str) -> "PackedGGUFWeight":
        if torch.device(device).type == "cpu" and self.raw.is_cpu:  # the same bytes, layout kept
            out = PackedGGUFWeight(self.raw, self.qtype, self.shape)
            out._kernel_qtype = self.kernel_qtype
            return out
        return PackedGGUFWeight(self.file_raw().to(device), self.qtype, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix ``[out_features, in_features]`` in ``dtype``."""
        return dequantize(self.file_raw(), self.qtype, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (any shape, int) dequantized: ``[*ids.shape, in_features]`` — an
        embedding lookup that expands only the rows it reads."""
        rows = self._file_rows(ids.reshape(-1))
        mod = _cpu_kernel_module() if rows.is_cpu else None
        # the C decoding gives dequantize's floats (both equal gguf's) in one call, not ~30 ops
        w = mod.dequantize(rows, int(self.qtype), self.shape[1]) if mod else None
        w = dequantize(rows, self.qtype) if w is None else w
        return w.to(dtype).reshape(*ids.shape, self.shape[1])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.shape[1])
        if flat.device.type == "cpu":
            mod = _cpu_kernel_module()
            if mod is not None:  # the repacked layout is faster at every M: take it at once
                repack_for_cpu(self, mod)
            y = _cpu_kernel_matmul(flat, self.raw, self.kernel_qtype)
        else:
            y = _cuda_kernel_matmul(flat, self.raw, self.qtype)
        if y is None:
            y = reference_matmul(flat, self.file_raw(), self.qtype)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.shape[0])

    @staticmethod
    def cat_rows(parts: Sequence["PackedGGUFWeight"]) -> "PackedGGUFWeight | None":
        """The parts stacked along output features (fused q/k/v, gate/up): their raw rows
        concatenated. None when types or in_features differ (such parts stay apart)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        raw = torch.cat([p.file_raw() for p in parts])
        return PackedGGUFWeight(raw, first.qtype, (raw.shape[0], first.shape[1]))


def _cpu_product(w: PackedGGUFWeight, mod, activations: str):
    """``x -> w(x)`` through the C kernel for a CPU decode step (x float32 or bf16, no bias),
    made once per weight and activation mode; None where the kernel does not serve w."""
    cache = w.__dict__.setdefault("_cpu_products", {})  # also for a copy made without __init__
    fn = cache.get(activations)
    if fn is None:
        out = mod.product(w.raw, w.kernel_qtype, w.shape[1], activations)
        if out is None:
            return None

        def fn(x: torch.Tensor) -> torch.Tensor:
            return out(x).to(x.dtype)

        cache[activations] = fn
    return fn


class DecodeProducts(tuple):
    """The products ``gguf_decode_products`` returns, each ``x -> w(x)``, with ``drivers``: the
    layer's ``GGUFDecodeDrivers`` where its four matrices can run through
    ``layer_ops_cpu``'s float32 decode drivers, else None."""

    drivers: "GGUFDecodeDrivers | None" = None


class GGUFDecodeDrivers:
    """A decode layer's fused q/k/v, o, gate/up and down GGUF matrices bound for
    ``localgen.kernels.layer_ops_cpu``'s float32 drivers (``decode_qkv``, ``decode_o_gate_up``,
    ``decode_down``): the C matmul's address and each matrix's ``MatArgs``, made once per
    (rows, threads). It holds the weights, so the addresses stay valid while it lives."""

    def __init__(self, mats: Sequence[PackedGGUFWeight], matmul: int, activations: str, mod):
        self.mats, self.matmul, self._act, self._mod = tuple(mats), matmul, activations, mod
        self._args: dict[tuple[int, int], tuple] = {}

    def args(self, rows: int) -> tuple:
        """``MatArgs`` of (qkv, o, gate_up, down) for a step of ``rows`` activation rows, with
        ``gguf_cpu.matmul``'s work split (so the products equal its results bit for bit); a
        qkv of mixed types is the kernel's ``RowSegments``."""
        key = (rows, torch.get_num_threads())
        got = self._args.get(key)
        if got is None:
            got = self._args[key] = tuple(self._mat_args(m, rows) for m in self.mats)
        return got

    def _mat_args(self, m, rows: int):
        from localgen.kernels.layer_ops_cpu import MatArgs

        if isinstance(m, PackedGGUFWeight):
            threads, m_tile, n_chunk = self._mod.work_split(rows, m.raw, m.kernel_qtype,
                                                            m.shape[1], self._act)
            return MatArgs(m.raw.data_ptr(), m.shape[0], m.shape[1], m.raw.stride(0), m_tile,
                           n_chunk, m.kernel_qtype, threads)
        threads, m_tile, n_chunk = m.work_split(rows, self._act)
        return MatArgs(m.address, m.n, m.k, 0, m_tile, n_chunk, m.qtype, threads)


def _decode_drivers(mats: tuple, mod, activations: str) -> GGUFDecodeDrivers | None:
    """The drivers for (qkv, o, gate_up, down) where the C layer ops are built and every row of
    raw bytes is contiguous, else None."""
    from localgen.kernels import layer_ops_cpu

    matmul = mod.entry_address(activations)
    if (len(mats) != 4 or matmul is None or not layer_ops_cpu.available()
            or any(r.stride(1) != 1 for m in mats for r in getattr(m, "raws", None) or (m.raw,))):
        return None
    return GGUFDecodeDrivers(mats, matmul, activations, mod)


def gguf_decode_products(qkv, rest: Sequence) -> DecodeProducts | None:
    """The matrix products of a CPU decode layer, each ``x -> w(x)`` (the same values as
    calling the weight), for ``qkv``: one fused ``PackedGGUFWeight`` or a (q, k, v) tuple of them
    (their outputs concatenated along features), and each weight of ``rest``; with
    ``drivers`` set for one fused qkv and three more matrices (``DecodeProducts``). None unless
    every weight is a ``PackedGGUFWeight`` on the CPU that the compiled kernel serves
    (``LOCALGEN_GGUF_CPU_KERNEL`` not 0). Made once per set of weights and activation mode
    (kept on the first weight). Raises ValueError for a bad ``LOCALGEN_GGUF_ACTIVATIONS``."""
    parts = qkv if isinstance(qkv, tuple) else (qkv,)
    mats = (*parts, *rest)
    if not all(type(m) is PackedGGUFWeight and m.raw.is_cpu for m in mats):
        return None
    mod = _cpu_kernel_module()
    if mod is None:
        return None
    act = cpu_activations()
    key = (act, mats)
    cached = mats[0].__dict__.get("_decode_products")
    if cached is not None and cached[0] == key:
        return cached[1]
    for m in mats:
        repack_for_cpu(m, mod)
    prods = [_cpu_product(m, mod, act) for m in mats]
    if any(p is None for p in prods):
        return None
    if len(parts) == 1:
        out = DecodeProducts(prods)
        out.drivers = _decode_drivers(mats, mod, act)
    else:
        q, k, v = prods[:3]
        out = DecodeProducts((lambda x: torch.cat((q(x), k(x), v(x)), dim=1), *prods[3:]))
        if all(p.shape[1] == parts[0].shape[1] for p in parts):  # q/k/v of mixed types: one call
            segs = mod.RowSegments([p.raw for p in parts], [p.kernel_qtype for p in parts],
                                   parts[0].shape[1])
            out.drivers = _decode_drivers((segs, *rest), mod, act)
    mats[0].__dict__["_decode_products"] = (key, out)
    return out
