"""4-bit group-wise compression (FlexGen §5) and GGUF Q4_1 import."""

from localgen.quant.int4 import GROUP_SIZE, Int4Tensor, dequantize, max_abs_error, quantize

__all__ = ["GROUP_SIZE", "Int4Tensor", "quantize", "dequantize", "max_abs_error"]
