"""Matrices of one layer stacked into one GEMM (vLLM's QKVParallelLinear and
MergedColumnParallelLinear): decode is memory-bound and, offloaded, host-bound, so one longer
GEMM per group reads the same bytes in fewer kernels and fewer launches. GGUF q/k/v of mixed
types (Q4_K_M's Q4_K q/k beside a Q6_K v) on CUDA stack q and k alone (``qk``), and the
matrices left apart share one 8-bit rounding of their input
(``gguf_blocks.products_same_x``)."""

from __future__ import annotations

import torch

from localgen.models.config import ModelConfig
from localgen.quant import linear
from localgen.quant.gguf_blocks import PackedGGUFWeight, products_same_x
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
    elif _stacks_qk(w):
        fuse_rows(w, "qk", ("q", "k"))


def _stacks_qk(w: dict) -> bool:
    """Whether q and k, left apart from v, stack as one ``qk`` matrix: GGUF blocks of one type
    on CUDA (where one launch of both rows fills the GPU better) without biases. The CPU decode
    paths read q, k and v by name, so CPU weights stay as they are."""
    q, k = w.get("q"), w.get("k")
    return (type(q) is PackedGGUFWeight and type(k) is PackedGGUFWeight and q.raw.is_cuda
            and q.qtype == k.qtype and "q_bias" not in w and "k_bias" not in w)


def project_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor):
    """q ``[n, heads, head_dim]``, k and v ``[n, kv_heads, head_dim]`` from ``x`` ``[n,
    hidden]``, through the fused ``qkv`` matrix (views of one GEMM's output), the stacked
    ``qk`` beside ``v``, or the three apart."""
    n = x.shape[0]
    if "qkv" in w:
        q, k, v = linear(x, w["qkv"], w.get("qkv_bias")).split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    elif "qk" in w:
        qk, v = _products_apart(w, x, ("qk", "v"))
        q, k = qk.split([cfg.q_size, cfg.kv_size], dim=-1)
    else:
        q, k, v = _products_apart(w, x, ("q", "k", "v"))
    return (q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(n, cfg.num_kv_heads, cfg.head_dim))


def _products_apart(w: dict, x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
    """``linear(x, w[p], w[p_bias])`` for each name: GGUF blocks on CUDA through one call that
    rounds x once for them (``products_same_x``), anything else one by one."""
    ys = products_same_x(x, [w[p] for p in names])
    if ys is None:
        return [linear(x, w[p], w.get(f"{p}_bias")) for p in names]
    return [y if w.get(f"{p}_bias") is None else y + w[f"{p}_bias"] for y, p in zip(ys, names)]
