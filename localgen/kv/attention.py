"""The paged cache's view types, defined beside the attention backends that read them
(``localgen.attention.metadata``) and named here for the cache's own modules."""

from localgen.attention.metadata import AttentionMetadata, LayerKV, pool_slot

__all__ = ["AttentionMetadata", "LayerKV", "pool_slot"]
