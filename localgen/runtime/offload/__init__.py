"""FlexGen's offloading runtime for localgen (issue 6): a Policy-driven executor.

``build_offload`` turns a model config + weight store + ``Policy`` into an ``OffloadedLM`` and a
runner factory that ``Engine`` uses instead of its plain ``ModelRunner``; ``LLM.load(policy=...)``
is the usual way in. See ``runner`` (block schedule), ``weights`` (tiers, streaming), ``kv``
(tiered / 4-bit KV cache, CPU attention), ``memory`` (pinned buffers, placement).
"""

from localgen.runtime.offload.runner import OffloadedLM, OffloadRunner, build_offload

__all__ = ["OffloadedLM", "OffloadRunner", "build_offload"]
