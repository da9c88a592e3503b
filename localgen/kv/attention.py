"""The one attention call site of every model: write new K/V into the paged cache, then attend.

On CUDA, when triton imports, the Triton kernels run (``localgen.kernels.paged_decode`` /
``paged_prefill``); elsewhere the pure-torch reference twin runs, unchanged. Layout and names follow
PagedAttention (block tables, slot mapping).

Decode uses the synchronized split-KV kernel unless ``set_async_softmax(phi, (a, b))`` configured
the unified max value of FlashDecoding++ §3 (from ``profiles/softmax_<model>.json``, written by
``python -m localgen.bench.calibrate_softmax``).

``set_score_observer(fn)`` installs a hook called as ``fn(q, kv, meta, scale)`` after the new K/V
are written (calibration reads pre-softmax scores through it); off by default, one ``is None``
test per call when off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from localgen.kernels import paged_attention_ref as ref

ScoreObserver = Callable[[torch.Tensor, "LayerKV", "AttentionMetadata", float], None]
_score_observer: ScoreObserver | None = None
_async_softmax: tuple[float, tuple[float, float] | None] | None = None
_triton_mods = None  # (paged_decode, paged_prefill) once imported; False when triton is missing


def set_score_observer(fn: ScoreObserver | None) -> ScoreObserver | None:
    """Install (or with None remove) the score observer; returns the previous one."""
    global _score_observer
    prev, _score_observer = _score_observer, fn
    return prev


def set_async_softmax(phi: float | None, bounds: tuple[float, float] | None = None) -> None:
    """Use the asynchronized softmax with unified max ``phi`` and safe range ``bounds`` of
    ``x - phi`` for CUDA decode (FlashDecoding++ §3); ``phi=None`` returns to synchronized."""
    global _async_softmax
    _async_softmax = None if phi is None else (float(phi), bounds)


def _triton():
    global _triton_mods
    if _triton_mods is None:
        try:
            from localgen.kernels import paged_decode, paged_prefill
            _triton_mods = (paged_decode, paged_prefill)
        except Exception:  # triton missing or unusable: the reference twins serve
            _triton_mods = False
    return _triton_mods


@dataclass
class AttentionMetadata:
    """Per-step description of the packed batch, shared by all layers.

    slot_mapping: ``[num_tokens]`` int64 flat cache slot of each new token.
    block_tables: ``[num_seqs, max_blocks]`` int64 (padded with 0).
    context_lens: ``[num_seqs]`` cached tokens per sequence after this step's writes.
    query_lens: new tokens per sequence (all 1 in decode).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int]
    context_lens_list: list[int]


@dataclass
class LayerKV:
    """The KV view of one layer: two ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``.

    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    attend = getattr(kv, "attend", None)  # an offloaded / 4-bit layer cache (runtime.offload.kv)
    if attend is not None:
        return attend(q, k, v, meta, scale)
    ref.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)
    if _score_observer is not None:
        _score_observer(q, kv, meta, scale)
    if q.is_cuda and _triton():
        decode, prefill = _triton_mods
        if meta.is_prefill:
            return prefill.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                                   meta.context_lens_list, meta.query_lens, scale)
        phi, bounds = _async_softmax if _async_softmax is not None else (None, None)
        return decode.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                             meta.context_lens, scale, phi=phi, bounds=bounds,
                                             max_context_len=max(meta.context_lens_list))
    if meta.is_prefill:
        return ref.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                           meta.context_lens_list, meta.query_lens, scale)
    return ref.paged_decode_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                      meta.context_lens, scale)
