"""FlexGen's offloading runtime for localgen (issue 6): a Policy-driven executor.

``build_offload`` turns a model config + weight store + ``Policy`` into an ``OffloadedLM`` and a
runner factory that ``Engine`` uses instead of its plain ``ModelRunner``; ``LLM.load(policy=...)``
is the usual way in. See ``runner`` (block schedule), ``weights`` (tiers, streaming), ``kv``
(tiered / 4-bit KV cache, CPU attention), ``memory`` (pinned buffers, placement).
"""

__all__ = ["OffloadedLM", "OffloadRunner", "build_offload"]


def __getattr__(name: str):
    # the runner imports torch: loaded on first use, so the CLI's policy lookup (plan.py, this
    # package's light module) does not import torch before a model is even found
    if name in __all__:
        from localgen.runtime.offload import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
