"""4-bit weights on the CPU: GGUF Q4_1 matrices run through torch's int4 weight-only GEMM.

Q4_1 stores each 32-element block of a row as ``w = d * q + m`` (q in 0..15). torch's CPU int4
kernel (``aten._weight_int4pack_mm_for_cpu``, the one gpt-fast/torchao use) computes
``w = (q - 8) * scale + zero`` per group along K, so ``scale = d`` and ``zero = m + 8 d`` express
the same weights (scales in bf16, the kernel's dtype). At small M (decode) the kernel reads a
quarter of bf16's bytes and is 2–3x faster on this project's CPUs; at large M (prefill) a dense bf16
GEMM is faster, so the layer dispatches by M like FlashDecoding++'s heuristic dataflow (§5).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

from localgen.quant.int4 import Int4Tensor

# Largest M that takes the int4 kernel: the kernel reads a quarter of bf16's bytes, which wins
# while the GEMM is bound by reading the weight; at larger M the dense bf16 GEMM's compute wins.
INT4_MAX_M = 8

# the kernel's one overload, bound once: ``torch.ops.aten.X`` resolves an attribute and an
# overload on every call, and a CPU decode step makes one call per matrix of every layer
_int4_mm = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated
    and slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_q4_1(store) -> bool:
    """Whether a weight store is a GGUF holding Q4_1 matrices (the int4 kernel's input)."""
    reader = getattr(store, "reader", None)
    return reader is not None and any(t.tensor_type.name == "Q4_1" for t in reader.tensors)


def fast_cpu_default(store) -> bool:
    """bf16 + int4 as the CPU default: a Q4_1 GGUF (its weights are 4-bit already, so float32
    buys no exactness) on a CPU with native bf16 and torch's int4 kernel."""
    return available() and has_q4_1(store) and native_bf16()


def unpack_codes(t: Int4Tensor) -> torch.Tensor:
    """``[N, K]`` int32 codes 0..15 of an Int4Tensor grouped along dim 1."""
    lo, hi = (t.packed & 15).to(torch.int32), (t.packed >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=-1).reshape(t.shape)


# a large-M matrix given, made when first needed (a function), or made from the codes (None)
DenseArg = Union[torch.Tensor, Callable[[], torch.Tensor], None]


class Int4Linear:
    """``y = x @ W.T (+ bias)`` for ``W`` ``[N, K]`` given as 4-bit codes with per-group
    ``(scale, min)`` along K (group 32 or a multiple); x ``[M, K]`` bf16 -> ``[M, N]`` bf16.

    ``codes``: a tensor, or a function giving it, which is then called (and the codes packed) at
    the first small-M call: a model's first step, a prefill, needs none of its small-M matrices.
    ``dense``: the bf16 matrix the large-M path multiplies (default: dequantized from the codes),
    or a function giving it at the first large-M call; one of the two is a tensor.
    ``max_m``: the largest M that takes the int4 kernel; ``repeat_input``: the codes hold
    ``repeat_input`` column blocks of a ``[N, K / repeat_input]`` matrix whose sum is ``W``, and
    the input is repeated along K to meet them (an 8-bit matrix as two 4-bit planes).
    Raises ValueError when neither ``codes`` nor ``dense`` is a tensor."""

    def __init__(self, codes: torch.Tensor | Callable[[], torch.Tensor], scale: torch.Tensor,
                 mn: torch.Tensor, group_size: int, dense: DenseArg = None,
                 max_m: int | None = None, repeat_input: int = 1):
        if isinstance(codes, torch.Tensor):
            n, k = codes.shape
        elif isinstance(dense, torch.Tensor):
            n, k = dense.shape[0], dense.shape[1] * repeat_input
        else:
            raise ValueError("Int4Linear needs its codes or its dense matrix as a tensor")
        self.shape, self.group_size = (n, k // repeat_input), group_size
        self.repeat_input = repeat_input
        self.max_m = INT4_MAX_M if max_m is None else max_m
        self._codes, self._packed = codes, None
        zero = mn.float() + 8 * scale.float()
        self.scales_and_zeros = torch.stack([scale.float(), zero], -1).transpose(0, 1).contiguous().to(
            torch.bfloat16)  # [K / group, N, 2]
        if dense is None:
            per_elem = lambda g: g.float().repeat_interleave(group_size, dim=1)  # noqa: E731
            full = codes.float() * per_elem(scale) + per_elem(mn)
            dense = sum(full.chunk(repeat_input, dim=1)).to(torch.bfloat16)
        self._dense = dense
        if isinstance(codes, torch.Tensor):
            self._pack()

    def _pack(self) -> torch.Tensor:
        if self._packed is None:
            codes = self._codes if isinstance(self._codes, torch.Tensor) else self._codes()
            self._packed, self._codes = _convert_rows(codes.contiguous()), None
        return self._packed

    @property
    def packed(self) -> torch.Tensor:
        """``[N, K / 2]`` uint8: the codes in the kernel's layout."""
        return self._packed if self._packed is not None else self._pack()

    @property
    def dense(self) -> torch.Tensor:
        """``[N, K / repeat_input]`` bf16: the matrix large-M calls multiply."""
        if not isinstance(self._dense, torch.Tensor):
            self._dense = self._dense()
        return self._dense

    @classmethod
    def from_int4(cls, parts: list[Int4Tensor]) -> "Int4Linear":
        """One matrix from row-stacked parts (q/k/v or gate/up), all with the same grouping."""
        codes = torch.cat([unpack_codes(p) for p in parts])
        return cls(codes, torch.cat([p.scale for p in parts]), torch.cat([p.min for p in parts]),
                   parts[0].group_size)

    @property
    def decode_nbytes(self) -> int:
        """Bytes a small-M call reads: the packed codes and the scales/zeros."""
        n, k = self.shape  # the packed codes: two a byte, for every column block
        return n * k * self.repeat_input // 2 + self.scales_and_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.shape[1])
        if flat.shape[0] <= self.max_m and flat.dtype == torch.bfloat16:
            flat = flat.repeat(1, self.repeat_input) if self.repeat_input > 1 else flat.contiguous()
            y = _int4_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
            y = y if bias is None else y + bias
        else:
            y = F.linear(flat.to(self.dense.dtype), self.dense, bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.shape[0])

    def small(self, x: torch.Tensor) -> torch.Tensor:
        """``__call__`` for what a CPU decode step passes: ``x`` ``[M, K]`` contiguous bf16 with
        ``M <= max_m`` and ``repeat_input == 1`` (the caller checks), no bias; the kernel alone."""
        return _int4_mm(x, self.packed, self.group_size, self.scales_and_zeros)


# Largest M for which the output matrix (vocab x hidden, twice the K of a 4-bit matrix when it is
# 8-bit) takes the int4 kernel: its doubled K narrows the range over which reading fewer bytes
# wins.
LM_HEAD_MAX_M = 4
Q8_0_BLOCK, Q8_0_BYTES = 32, 34  # fp16 d, then 32 int8 codes: value = d * q


def _convert_rows(codes: torch.Tensor) -> torch.Tensor:
    """``aten._convert_weight_to_int4pack_for_cpu`` of uint8 codes ``[N, K]`` (0..15), converted
    to the int32 it takes ``PACK_ROWS`` rows at a time, so a vocab-sized matrix never holds its
    int32 codes whole. The kernel packs rows in tiles of 64, so pieces of a multiple of 64 rows
    stack to the whole's result (``tests/test_cpu_int4_blocks.py``)."""
    return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 1)
                      for c in codes.split(PACK_ROWS)])


# rows converted at once (a multiple of the kernel's 64-row tile): 4096 rows of a 1152-wide
# matrix are 18 MiB of int32 codes
PACK_ROWS = 4096


def q8_0_as_int4(raw, rows: int, cols: int, dense: DenseArg = None,
                 max_m: int | None = None) -> Int4Linear:
    """A GGUF Q8_0 matrix (raw bytes ``[rows, cols // 32 * 34]``) as two 4-bit planes for the
    int4 kernel, with no change to its codes: ``q + 128 = 16 hi + lo`` (hi, lo in 0..15), so
    ``d q = 16 d (hi - 8) + d lo``, i.e. plane ``hi`` with scale ``16 d`` and zero 0 plus plane
    ``lo`` with scale ``d`` and zero ``8 d`` (the kernel's ``(code - 8) scale + zero``). The planes
    sit side by side along K and the input is repeated to meet them: one kernel call reading 4.25
    bits a weight (the bf16 matrix reads 16). Scales are bf16, as for the 4-bit layers."""
    if cols % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 rows hold whole 32-element blocks; got {cols} columns")
    nb = cols // Q8_0_BLOCK
    b = _raw_blocks(raw, rows, nb, Q8_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, nb).float()
    scale = torch.cat([16 * d, d], dim=1)
    mn = torch.cat([-128 * d, torch.zeros_like(d)], dim=1)  # zero = mn + 8 scale: 0 and 8 d
    if dense is None:
        q = b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        dense = (d.repeat_interleave(Q8_0_BLOCK, dim=1) * q).to(torch.bfloat16)
    return Int4Linear(_q8_0_planes(b), scale, mn, Q8_0_BLOCK, dense=dense, max_m=max_m,
                      repeat_input=2)


def _q8_0_planes(b: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[rows, 2 cols]`` of Q8_0 blocks ``b`` ``[rows, nb, 34]``: the high nibbles
    of ``q + 128``, then the low ones, made ``PACK_ROWS`` rows at a time so a vocab-sized
    matrix's temporaries stay a chunk's size."""
    rows, cols = b.shape[0], b.shape[1] * Q8_0_BLOCK
    codes = torch.empty(rows, 2 * cols, dtype=torch.uint8)
    for start in range(0, rows, PACK_ROWS):
        u = (b[start:start + PACK_ROWS, :, 2:] ^ 128).reshape(-1, cols)  # q + 128: sign bit flipped
        torch.bitwise_right_shift(u, 4, out=codes[start:start + PACK_ROWS, :cols])
        torch.bitwise_and(u, 15, out=codes[start:start + PACK_ROWS, cols:])
    return codes


Q4_1_BLOCK, Q4_1_BYTES = 32, 20  # fp16 d, fp16 m, 16 bytes of codes: value = d * q + m


def q4_1_as_int4(raw, rows: int, cols: int, dense: DenseArg = None,
                 max_m: int | None = None) -> Int4Linear:
    """A GGUF Q4_1 matrix (raw bytes ``[rows, cols // 32 * 20]``, rows already in HF order) for
    the int4 kernel, read straight from its blocks: byte ``j`` of a block holds element ``j``
    (low nibble) and ``j + 16`` (high), value ``d q + m`` (llama.cpp's ``block_q4_1``), so
    scale ``d`` and min ``m`` carry over and the codes only change places. ``dense`` (the large-M
    matrix) defaults to ``d q + m`` in bf16, computed in float32 as ``Int4Linear`` does; the codes
    are packed from the blocks (kept until then) at the first small-M call."""
    if cols % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows hold whole 32-element blocks; got {cols} columns")
    nb = cols // Q4_1_BLOCK
    b = _raw_blocks(raw, rows, nb, Q4_1_BYTES)
    dm = b[..., 0:4].contiguous().view(torch.float16).reshape(rows, nb, 2)
    d, m = dm[..., 0], dm[..., 1]
    codes = lambda: _q4_1_codes(b).reshape(rows, cols)  # noqa: E731
    if dense is None:
        dense = (_q4_1_codes(b) * d.float()[..., None]).add_(m.float()[..., None])
        dense = dense.to(torch.bfloat16).reshape(rows, cols)
    elif not isinstance(dense, torch.Tensor):
        codes = codes()  # the dense matrix comes later: the codes are packed now
    return Int4Linear(codes, d, m, Q4_1_BLOCK, dense=dense, max_m=max_m)


def _q4_1_codes(b: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[rows, nb, 32]`` of Q4_1 blocks ``b`` ``[rows, nb, 20]``: each block's 16
    low nibbles, then its 16 high ones."""
    qs = b[..., 4:]
    codes = torch.empty(*qs.shape[:-1], Q4_1_BLOCK, dtype=torch.uint8)
    torch.bitwise_and(qs, 15, out=codes[..., :16])
    torch.bitwise_right_shift(qs, 4, out=codes[..., 16:])
    return codes


def _raw_blocks(raw, rows: int, nb: int, nbytes: int) -> torch.Tensor:
    """``raw`` (a uint8 tensor or a numpy view of the file) as uint8 ``[rows, nb, nbytes]``."""
    if not isinstance(raw, torch.Tensor):
        import numpy as np

        raw = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    if raw.numel() != rows * nb * nbytes:
        raise ValueError(f"{rows} rows of {nb} blocks of {nbytes} bytes need "
                         f"{rows * nb * nbytes} bytes, got {raw.numel()}")
    return raw.reshape(rows, nb, nbytes)


def int4_output_weight(store, name: str, dense: DenseArg = None) -> Int4Linear | None:
    """The output (lm_head) matrix ``name`` of a GGUF store for the int4 kernel when it is stored
    as Q4_1 or Q8_0 (else None); ``dense``: the bf16 matrix for large M (the tied embedding), or a
    function giving it at the first large-M call."""
    shape = store.shape(name)
    if len(shape) != 2 or shape[0] % 16:  # the kernel packs 16-row tiles
        return None
    if store.stored_type(name) == "Q8_0":
        return q8_0_as_int4(store.get_packed(name).raw, *shape, dense=dense, max_m=LM_HEAD_MAX_M)
    raw = _q4_1_rows(store, name)
    if raw is None:
        return None
    return q4_1_as_int4(raw, *shape, dense=dense, max_m=2 * LM_HEAD_MAX_M)


def _q4_1_rows(store, name: str) -> torch.Tensor | None:
    """The raw blocks of ``name`` (rows in HF order: llama.cpp's Q/K permutation undone) when it
    is a 2-D Q4_1 tensor, else None."""
    if store.stored_type(name) != "Q4_1" or len(store.shape(name)) != 2:
        return None
    return store.get_packed(name).raw


# short names in a fused llama layer -> the HF names they stack
_GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def int4_layer_weights(store, names: dict[str, str]) -> dict[str, Int4Linear]:
    """Int4Linear replacements for a llama layer's matrices stored as Q4_1 in a GGUF store
    (``names``: short -> HF name, as ``llama.layer_weight_names``); groups with any other storage
    type, or with biases of their own (only q/k/v biases are added after the packed GEMM), are left
    out (they stay dense). A group's parts are stacked as raw rows (whole blocks), then read once."""
    have = set(store.names())
    out = {}
    for fused, parts in _GROUPS.items():
        if any(p not in names for p in parts):  # an MoE layer has experts, not gate/up/down
            continue
        if fused != "qkv" and any(names.get(f"{p}_bias") in have for p in parts):
            continue
        raws = [_q4_1_rows(store, names[p]) for p in parts]
        if any(r is None for r in raws) or len({store.shape(names[p])[1] for p in parts}) != 1:
            continue
        raw = torch.cat(raws) if len(raws) > 1 else raws[0]
        out[fused] = q4_1_as_int4(raw, raw.shape[0], store.shape(names[parts[0]])[1])
    return out


def replaced_names(packed: dict[str, Int4Linear]) -> set[str]:
    """Short names of the separate matrices that ``packed``'s entries stand for."""
    return {p for fused in packed for p in _GROUPS[fused]}


# Largest M whose product reads a GGUF matrix's blocks (the C kernel, 8-bit activations) rather
# than its bf16 copy: the kernel reads a quarter of the bytes, which wins while a product is
# bound by the weight read; past it the bf16 GEMM's compute wins (``docs/benchmarks.md``, issue 30)
BLOCKS_MAX_M = 8
# Largest decode step (rows) that reads the blocks through the fused C decode layer
# (``llama._cpu_decode_layer``) rather than the bf16 copies op by op: fused, the blocks' step
# stays ahead past the single product's crossover
BLOCKS_DECODE_MAX_M = 16


class BlocksWithCopy:
    """A GGUF matrix ``W`` ``[N, K]`` held twice: the file's blocks (``PackedGGUFWeight``) for
    products of at most ``max_m`` rows, a bf16 copy for larger ones (prefill), dispatched by M as
    FlashDecoding++'s heuristic dataflow (§5) does. ``w(x, bias)`` -> ``x @ W.T (+ bias)`` in
    x's dtype (``quant.linear``'s contract); a large-M product rounds ``x`` to bf16 and
    accumulates in float32 inside torch's bf16 GEMM. The copy is the blocks' float32 expansion
    rounded once to bf16, made at the first large-M call (a decode-only model never holds it)."""

    def __init__(self, blocks, max_m: int = BLOCKS_MAX_M):
        self.blocks, self.shape, self.max_m = blocks, blocks.shape, max_m
        self._copy: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"BlocksWithCopy({self.blocks!r}, max_m={self.max_m})"

    @property
    def copy(self) -> torch.Tensor:
        """``[N, K]`` bf16: the matrix large-M calls multiply."""
        if self._copy is None:
            self._copy = self.blocks.dequantize(torch.float32).to(torch.bfloat16)
        return self._copy

    @property
    def decode_nbytes(self) -> int:
        """Bytes a small-M call reads: the blocks."""
        return self.blocks.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.shape[1])
        if flat.shape[0] <= self.max_m:
            return self.blocks(x, bias)
        y = F.linear(flat.to(torch.bfloat16), self.copy).to(x.dtype)
        y = y if bias is None else y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.shape[0])


# the matrices of a fused llama layer, and of one whose q/k/v stay apart (their types differ)
_COPIED = ("qkv", "q", "k", "v", "o", "gate_up", "down")


def with_copies(w: dict, max_m: int | None = None) -> dict:
    """A layer's weights ``w`` with each matrix held as GGUF blocks (``PackedGGUFWeight``) among
    ``qkv``/``q``/``k``/``v``/``o``/``gate_up``/``down`` wrapped in ``BlocksWithCopy`` (``max_m``
    None: ``BLOCKS_MAX_M``); every other entry as it is."""
    from localgen.quant.gguf_blocks import PackedGGUFWeight

    max_m = BLOCKS_MAX_M if max_m is None else max_m

    return {k: BlocksWithCopy(v, max_m) if k in _COPIED and type(v) is PackedGGUFWeight else v
            for k, v in w.items()}
