"""Matrices of one layer stacked into one GEMM (vLLM's QKVParallelLinear and
MergedColumnParallelLinear): decode is memory-bound and, offloaded, host-bound, so one longer
GEMM per group reads the same bytes in fewer kernels and fewer launches."""

from __future__ import annotations

import torch

from localgen.quant.int4 import Int4Tensor, cat_rows


def fuse_rows(w: dict, name: str, parts: tuple[str, ...]) -> None:
    """``w[name]`` = the ``parts`` stacked along rows (output features), in place, when all are
    present: dense tensors by ``torch.cat``, 4-bit ones code for code (``int4.cat_rows``; left
    apart when their groups would straddle the seam)."""
    if not all(k in w for k in parts):
        return
    ts = [w[k] for k in parts]
    if all(isinstance(t, torch.Tensor) for t in ts):
        fused = torch.cat(ts)
    elif all(isinstance(t, Int4Tensor) for t in ts):
        fused = cat_rows(ts)
    else:
        fused = None
    if fused is not None:
        for k in parts:
            del w[k]
        w[name] = fused
