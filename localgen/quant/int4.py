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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.kernels.quant_ref import GROUP_SIZE, dequantize_int4, quantize_int4

__all__ = ["GROUP_SIZE", "Int4Tensor", "quantize", "dequantize", "max_abs_error"]


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


def max_abs_error(t: Int4Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(quantize(x))|`` (same shape as the tensor):
    half a quantization step plus the fp16 rounding of min and of the top code's ``15*scale``."""
    n = t.shape[t.dim]
    s = t.scale.float().movedim(t.dim, -1).repeat_interleave(t.group_size, -1)[..., :n]
    z = t.min.float().movedim(t.dim, -1).repeat_interleave(t.group_size, -1)[..., :n]
    eps = 2.0 ** -11
    bound = s / 2 + eps * (z.abs() + 15 * s) + 1e-7
    return bound.movedim(-1, t.dim)
