"""4-bit group-wise compression (FlexGen §5) and GGUF Q4_1 import."""

import torch
import torch.nn.functional as F

from localgen.quant.int4 import GROUP_SIZE, Int4Tensor, dequantize, max_abs_error, quantize

__all__ = ["GROUP_SIZE", "Int4Tensor", "quantize", "dequantize", "max_abs_error", "linear"]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, or a packed weight's own call (``cpu_int4.Int4Linear`` on the CPU,
    ``int4.as_linear``'s dispatcher on CUDA): every model family's matrix call site."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)
