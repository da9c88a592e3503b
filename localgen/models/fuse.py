"""Matrices of one layer stacked into one GEMM (vLLM's QKVParallelLinear and
MergedColumnParallelLinear): decode is memory-bound and, offloaded, host-bound, so one longer
GEMM per group reads the same bytes in fewer kernels and fewer launches."""

from __future__ import annotations

import torch

from localgen.models.config import ModelConfig
from localgen.quant import linear
from localgen.quant.gguf_blocks import PackedGGUFWeight
from localgen.quant.int4 import Int4Tensor, cat_rows


def fuse_rows(w: dict, name: str, parts: tuple[str, ...]) -> None:
    """``w[name]`` = the ``parts`` stacked along rows (output features), in place, when all are
    present: dense tensors by ``torch.cat``, 4-bit ones code for code (``int4.cat_rows``; left
    apart when their groups would straddle the seam), GGUF blocks row for row
    (``PackedGGUFWeight.cat_rows``; left apart when their types differ, as Q4_K_M's q/k/v)."""
    if not all(k in w for k in parts):
        return
    ts = [w[k] for k in parts]
    if all(isinstance(t, torch.Tensor) for t in ts):
        fused = torch.cat(ts)
    elif all(isinstance(t, Int4Tensor) for t in ts):
        fused = cat_rows(ts)
    elif all(isinstance(t, PackedGGUFWeight) for t in ts):
        fused = PackedGGUFWeight.cat_rows(ts)
    else:
        fused = None
    if fused is not None:
        for k in parts:
            del w[k]
        w[name] = fused


def fuse_qkv(w: dict) -> None:
    """q/k/v as one matrix ``qkv``, in place; their biases as ``qkv_bias`` whenever q/k/v are
    no longer apart (fused here, or packed elsewhere, as the CPU int4 path's ``qkv``): 4-bit
    q/k/v left apart at a group seam keep their own biases."""
    fuse_rows(w, "qkv", ("q", "k", "v"))
    if not {"q", "k", "v"} & w.keys():
        fuse_rows(w, "qkv_bias", ("q_bias", "k_bias", "v_bias"))


def project_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor):
    """q ``[n, heads, head_dim]``, k and v ``[n, kv_heads, head_dim]`` from ``x`` ``[n,
    hidden]``, through the fused ``qkv`` matrix (views of one GEMM's output) or the three apart."""
    n = x.shape[0]
    if "qkv" in w:
        q, k, v = linear(x, w["qkv"], w.get("qkv_bias")).split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    else:
        q, k, v = (linear(x, w[p], w.get(f"{p}_bias")) for p in "qkv")
    return (q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(n, cfg.num_kv_heads, cfg.head_dim))
