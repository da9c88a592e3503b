"""Group-wise asymmetric 4-bit quantization (FlexGen §5) as one packed tensor type.

The math (codes, nibble order, fp16 scale/min, a shorter last group) is the kernels package's
reference twin ``localgen.kernels.quant_ref`` (``quantize_int4``/``dequantize_int4``); this module
only wraps it in a container that remembers its grouping axis, so weights (grouped along the output
channels, dim 0 of an ``[N, K]`` matrix), KV caches (grouped along head_dim, the hidden dim) and
GGUF Q4_1 imports (grouped along the input channels, g=32) share one type and one dequantizer.

Error bound: each element of a group is coded as ``q*scale + min`` with ``q = round((x-min)/scale)``
in [0, 15], ``scale = (max-min)/15`` stored in fp16, so ``|x - deq(x)| <= scale/2`` plus the fp16
rounding of ``min`` and ``scale`` (relative 2^-11 of |min| and of 15*|scale|):
``max_abs_error`` returns that bound per element.

Linear layers on CUDA (``as_linear``): a weight ``Int4Tensor`` (either layout) becomes a
``localgen.kernels.dispatch.Int4Linear``, which picks by M the Triton flat GEMM (``flat``/``tiled``)
or dequantize + cuBLAS (FlashDecoding++ §5), with the inflection points of the GPU's
``profiles/gemm_*.json`` (``gemm_table``). Elsewhere weights are dequantized before use, as before
(``keeps_packed``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from localgen.kernels.dispatch import GemmDispatchTable, Int4Linear
from localgen.kernels.quant_ref import GROUP_SIZE, dequantize_int4, quantize_int4
from localgen.profile_files import GEMM_TABLE_ENV, gemm_profile_dicts

__all__ = ["GROUP_SIZE", "Int4Tensor", "quantize", "dequantize", "cat_rows", "max_abs_error",
           "keeps_packed", "gemm_table", "as_linear", "GEMM_TABLE_ENV"]


@dataclass
class Int4Tensor:
    """A tensor of ``shape`` stored as 4-bit codes, two a byte along ``dim`` (element 2i in the
    low nibble), with one fp16 ``scale`` and ``min`` per ``group_size`` consecutive elements along
    ``dim``: ``packed`` has ``shape[dim] // 2`` along dim, ``scale``/``min`` ``ceil(shape[dim]/g)``."""

    packed: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int
    dim: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.min))

    def to(self, device, non_blocking: bool = False) -> "Int4Tensor":
        return Int4Tensor(*(t.to(device, non_blocking=non_blocking) for t in (self.packed, self.scale, self.min)),
                          self.group_size, self.dim, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def quantize(x: torch.Tensor, group_size: int = GROUP_SIZE, dim: int = 0) -> Int4Tensor:
    """Quantize ``x`` group-wise along ``dim`` (weights: dim 0, the output channels; KV: -1)."""
    dim = dim % x.dim()
    packed, scale, mn = quantize_int4(x, group_size, dim=dim)
    return Int4Tensor(packed, scale, mn, group_size, dim, tuple(x.shape))


def dequantize(t: Int4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale + min`` in ``dtype`` (computed in float32), shape ``t.shape``."""
    return dequantize_int4(t.packed, t.scale, t.min, t.group_size, dim=t.dim, dtype=dtype)


def cat_rows(ts: list[Int4Tensor]) -> Int4Tensor | None:
    """The 2-D matrices ``ts`` stacked along their rows (dim 0, the output channels) without
    touching a code: the result dequantizes to ``torch.cat`` of theirs. Possible when all share
    ``group_size`` and ``dim`` and no group straddles two matrices (``dim`` 1: groups lie within a
    row; ``dim`` 0: every row count a multiple of ``group_size``); otherwise None."""
    g, dim = ts[0].group_size, ts[0].dim
    if any(len(t.shape) != 2 or t.group_size != g or t.dim != dim or t.shape[1] != ts[0].shape[1]
           for t in ts):
        return None
    if dim == 0 and any(t.shape[0] % g for t in ts):
        return None
    parts = [torch.cat([getattr(t, f) for t in ts]) for f in ("packed", "scale", "min")]
    return Int4Tensor(*parts, g, dim, (sum(t.shape[0] for t in ts), ts[0].shape[1]))


def max_abs_error(t: Int4Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(quantize(x))|`` (same shape as the tensor):
    half a quantization step plus the fp16 rounding of min and of the top code's ``15*scale``."""
    n = t.shape[t.dim]
    s = t.scale.float().movedim(t.dim, -1).repeat_interleave(t.group_size, -1)[..., :n]
    z = t.min.float().movedim(t.dim, -1).repeat_interleave(t.group_size, -1)[..., :n]
    eps = 2.0 ** -11
    bound = s / 2 + eps * (z.abs() + 15 * s) + 1e-7
    return bound.movedim(-1, t.dim)


# -- linears on CUDA (FlashDecoding++ §5 heuristic dataflow) ------------------------------------

def keeps_packed(device_type: str, triton_ok: bool | None = None) -> bool:
    """Whether a linear weight stays 4-bit up to its GEMM on ``device_type`` (CUDA with triton: the
    call goes through ``as_linear``'s dispatcher) instead of being dequantized before use.
    ``LOCALGEN_INT4_GEMM=0`` turns it off (dequantize first everywhere: the ablation baseline)."""
    if os.environ.get("LOCALGEN_INT4_GEMM", "1") == "0":
        return False
    if triton_ok is None:
        triton_ok = importlib.util.find_spec("triton") is not None
    return device_type == "cuda" and triton_ok


@functools.lru_cache(maxsize=None)
def gemm_table(device_name: str, dtype: str = "bfloat16") -> GemmDispatchTable:
    """The M1/M2 table for one GPU and compute dtype: the file ``$LOCALGEN_GEMM_TABLE`` if set,
    else every ``profiles/gemm_*.json`` whose ``device_name`` and ``dtype`` match (entries
    merged); shapes no file holds use ``dispatch.DEFAULT_POINTS`` (M1=16, M2=2048)."""
    table = GemmDispatchTable(device_name=device_name, dtype=dtype)
    for d in gemm_profile_dicts(device_name, dtype):
        t = GemmDispatchTable.from_json(d)
        table.entries.update(t.entries)
        table.default = t.default
    return table


def as_linear(t: Int4Tensor, dtype: torch.dtype, table: GemmDispatchTable | None = None
              ) -> Int4Linear:
    """A callable ``(x, bias=None) -> x @ W.T + bias`` for a 2-D weight ``t`` on CUDA, dispatched
    by M (``dispatch.route``); both layouts (``dim`` 0: FlexGen g=64 along N; ``dim`` 1: GGUF Q4_1
    g=32 along K) run in the Triton kernel. The dense weight is never kept (the "torch" path
    dequantizes per call), so the layer stays 4-bit in memory."""
    if len(t.shape) != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {t.shape}")
    if table is None:
        dev = t.packed.device
        name = _cuda_device_name(dev.index) if dev.type == "cuda" else ""
        table = gemm_table(name, str(dtype).removeprefix("torch."))
    return Int4Linear(t, table, dtype=dtype, cache_dense=False)


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)
