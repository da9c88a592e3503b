"""The paged Triton backend (CUDA): ``localgen.kernels.kv_write``, ``paged_prefill`` and
``paged_decode``.

Decode uses the synchronized split-KV kernel unless the backend is given the unified max value of
FlashDecoding++ §3 (``async_softmax=(phi, bounds)``, from ``profiles/softmax_<model>.json``,
written by ``python -m localgen.bench.calibrate_softmax``). Every ``AttentionSpec`` feature
(sliding window, logit soft-cap, sinks) is a compile-time switch of the same kernels
(``localgen.kernels.score_features``), so this backend computes every spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localgen.attention.base import AttentionBackend, ScoreObserver
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.spec import AttentionSpec

_mods = None  # (paged_decode, paged_prefill, kv_write) once imported; False when triton is missing


def triton_kernels():
    """(paged_decode, paged_prefill, kv_write) when the Triton kernels import, else None."""
    global _mods
    if _mods is None:
        try:
            from localgen.kernels import kv_write, paged_decode, paged_prefill
            _mods = (paged_decode, paged_prefill, kv_write)
        except Exception:  # triton missing or unusable: the reference twins serve
            _mods = False
    return _mods or None


@dataclass
class FreshRows:
    """A ``fresh_prefill`` step's block table over its packed k/v (``paged_prefill.fresh_rows``),
    built by its first layer."""

    rows: torch.Tensor


class TritonPagedBackend(AttentionBackend):
    """CUDA tensors in the plain paged layout (``LayerKV``).

    ``async_softmax``: ``(phi, bounds)``, the asynchronized softmax's unified max ``phi`` and the
    safe range ``bounds`` of ``x - phi`` (FlashDecoding++ §3), or None (synchronized). Raises
    RuntimeError when the Triton kernels do not import."""

    name = "paged Triton"
    graphs_prefill = True

    def __init__(self, observer: ScoreObserver | None = None,
                 async_softmax: tuple[float, tuple[float, float] | None] | None = None):
        super().__init__(observer)
        mods = triton_kernels()
        if mods is None:
            raise RuntimeError("the paged Triton backend needs triton, which does not import here")
        self.decode_mod, self.prefill_mod, self.write_mod = mods
        self.set_async_softmax(*(async_softmax or (None, None)))

    def set_async_softmax(self, phi: float | None, bounds: tuple[float, float] | None = None) -> None:
        """Decode with the asynchronized softmax (``phi``, ``bounds``); ``phi=None``:
        synchronized."""
        self.phi = None if phi is None else float(phi)
        self.bounds = None if phi is None else bounds

    def supports(self, spec: AttentionSpec) -> bool:
        return True

    def write_kv(self, kv: LayerKV, k, v, meta: AttentionMetadata) -> None:
        self.write_mod.write_kv(kv.k_cache, kv.v_cache, k, v, meta.slot_mapping)  # K and V, one launch

    def prefill(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        # the lengths reach the GPU once a step, not once a layer (and so a captured prefill
        # replays them: the plan is built by its eager warm-up)
        mod = self.prefill_mod
        lens = meta.plan(mod.PrefillLens, lambda: mod.prefill_lens(
            meta.context_lens_list, meta.query_lens, q.device))
        return mod.paged_prefill_attention(q, kv.k_cache, kv.v_cache, meta.block_tables,
                                           meta.context_lens_list, meta.query_lens, spec.scale,
                                           lens=lens, **_features(spec))

    def fresh_prefill(self, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        rows = meta.plan(FreshRows, lambda: FreshRows(
            self.prefill_mod.fresh_rows(meta.query_lens, q.device))).rows
        return self.prefill_mod.fresh_prefill_attention(q, k, v, meta.query_lens, spec.scale,
                                                        rows, **_features(spec))

    def decode(self, kv: LayerKV, q, k, v, meta: AttentionMetadata, spec: AttentionSpec):
        return self.decode_mod.paged_decode_attention(
            q, kv.k_cache, kv.v_cache, meta.block_tables, meta.context_lens, spec.scale,
            phi=self.phi, bounds=self.bounds, max_context_len=max(meta.context_lens_list),
            **_features(spec))


def _features(spec: AttentionSpec) -> dict:
    """The kernels' keyword arguments for ``spec``'s window, soft-cap and sinks (None: off)."""
    return dict(sliding_window=spec.sliding_window, logit_softcap=spec.logit_softcap,
                sinks=spec.sinks)
