"""Attention backends: one interface (``base.AttentionBackend``), one class per way of computing
paged attention, chosen once per runner (``select``). See docs/ARCHITECTURE.md, "Attention
backends"."""

from localgen.attention.base import AttentionBackend, UnsupportedAttention
from localgen.attention.metadata import AttentionMetadata, LayerKV
from localgen.attention.spec import AttentionSpec

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "LayerKV", "UnsupportedAttention"]
