"""The interface every attention backend implements (``AttentionBackend``).

A backend is chosen once, when a runner is built, from the device, the KV format and the placement
(``localgen.attention.select``), and bound to each layer's KV view; the models call the view's
``attend``, which writes the step's new K/V and attends. What a backend derives once per step (block
lists, kernel launch parameters) is its own typed plan, kept on the step's ``AttentionMetadata``
(``AttentionMetadata.plan``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from localgen.attention.metadata import AttentionMetadata
from localgen.attention.prefill import fresh_feature_attention
from localgen.attention.spec import AttentionSpec

# called as ``fn(q, kv, meta, scale)`` after the step's K/V are written (calibration reads the
# pre-softmax scores through it)
ScoreObserver = Callable[[torch.Tensor, object, AttentionMetadata, float], None]


class UnsupportedAttention(ValueError):
    """A layer's ``AttentionSpec`` uses a feature the chosen backend does not compute."""


class AttentionBackend(ABC):
    """Paged attention over one KV format on one device.

    ``kv`` arguments are the layer's KV view (``LayerKV`` for the paged cache); q
    ``[num_tokens, num_heads, head_dim]``, k/v ``[num_tokens, num_kv_heads, head_dim]``; outputs
    have q's shape and dtype. ``observer``: a ``ScoreObserver`` or None (off).
    """

    name = "abstract"
    # whether ``decode`` may follow a fused CPU layer that wrote K/V into ``LayerKV.pair`` itself
    decodes_fused_writes = False
    # whether a whole-prompt ``prefill`` may be captured in a CUDA graph: it reads the step's
    # host-side lengths only through ``AttentionMetadata.plan`` (built by the eager warm-up)
    graphs_prefill = False

    def __init__(self, observer: ScoreObserver | None = None):
        self.observer = observer

    def supports(self, spec: AttentionSpec) -> bool:
        """Whether this backend computes ``spec``; plain scaled causal attention always."""
        return spec.plain

    @property
    def takes_fused_writes(self) -> bool:
        """``decodes_fused_writes`` while no observer is installed (the observer runs between
        the write and the attention, a call the fused layer does not make)."""
        return self.decodes_fused_writes and self.observer is None

    @abstractmethod
    def write_kv(self, kv, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store k/v at ``meta.slot_mapping``."""

    @abstractmethod
    def prefill(self, kv, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """Causal attention of the step's packed queries over their cached contexts (their own
        k/v already written; passed too, for backends that attend over them in place)."""

    def fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """Causal attention of the step's whole prompts over their own k/v only, with every
        ``spec`` feature: the cache may lack their positions (``AttentionMetadata.fresh_prefill``).
        The torch twin here; a backend with a faster path overrides it."""
        return fresh_feature_attention(q, k, v, meta.query_lens, spec)

    @abstractmethod
    def decode(self, kv, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """One query per sequence over its whole context (its new K/V already written; passed
        too, or None when a fused layer wrote them itself: ``decodes_fused_writes``)."""

    def forward(self, kv, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, spec: AttentionSpec) -> torch.Tensor:
        """Write k/v, call the observer, then ``fresh_prefill`` (a ``fresh_prefill`` step),
        ``prefill`` or ``decode``. Raises ``UnsupportedAttention`` for a spec this backend does not
        compute."""
        if not spec.plain and not self.supports(spec):
            raise unsupported(self, spec, q.device)
        self.write_kv(kv, k, v, meta)
        if self.observer is not None:
            self.observer(q, kv, meta, spec.scale)
        if meta.is_prefill:
            if meta.fresh_prefill:
                return self.fresh_prefill(q, k, v, meta, spec)
            return self.prefill(kv, q, k, v, meta, spec)
        return self.decode(kv, q, k, v, meta, spec)


def unsupported(backend: AttentionBackend, spec: AttentionSpec,
                device: torch.device | str) -> UnsupportedAttention:
    """The one-sentence error naming the feature, the backend and the device."""
    missing = [f for f in spec.features()
               if not backend.supports(_only(spec, f))] or spec.features()
    return UnsupportedAttention(f"{' and '.join(missing)} is not supported by the {backend.name} "
                                f"attention backend on {torch.device(device).type}")


def _only(spec: AttentionSpec, feature: str) -> AttentionSpec:
    """``spec`` with only ``feature`` of its features kept."""
    return AttentionSpec(spec.scale,
                         spec.sliding_window if feature == "sliding-window attention" else None,
                         spec.logit_softcap if feature == "logit soft-capping" else None,
                         spec.sinks if feature == "attention sinks" else None)
