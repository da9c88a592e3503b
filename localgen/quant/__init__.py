"""4-bit group-wise compression (FlexGen §5), GGUF Q4_1 import and GGUF blocks kept packed
(``gguf_blocks``)."""

import torch
import torch.nn.functional as F

from localgen.quant.int4 import GROUP_SIZE, Int4Tensor, dequantize, max_abs_error, quantize

__all__ = ["GROUP_SIZE", "Int4Tensor", "quantize", "dequantize", "max_abs_error", "linear",
           "embedding"]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or a packed weight's own call (``cpu_int4.Int4Linear`` on the CPU,
    ``int4.as_linear``'s dispatcher on CUDA, ``gguf_blocks.PackedGGUFWeight`` anywhere): every
    model family's matrix call site."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)


def embedding(ids: torch.Tensor, w) -> torch.Tensor:
    """``F.embedding``, or a packed weight's row gather (``PackedGGUFWeight.embedding``: only the
    rows looked up are dequantized, to float32)."""
    if isinstance(w, torch.Tensor):
        return F.embedding(ids, w)
    return w.embedding(ids)
