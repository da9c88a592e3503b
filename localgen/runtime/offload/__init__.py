"""FlexGen's offloading runtime for localgen: a Policy-driven executor.

``build_offload`` turns a model config + weight store + ``Policy`` (``policy``) into an
``OffloadedLM`` and a runner factory that ``Engine`` uses instead of its plain ``ModelRunner``;
``LLM.load(policy=...)`` is the usual way in. See ``runner`` (the zig-zag block schedule, FlexGen
§4.1), ``weights`` (tiers, streaming), ``kv`` (tiered / 4-bit KV cache, CPU attention), ``memory``
(pinned buffers, placement), ``timed_run`` (an engine built and timed for the bench and the
profiler).
"""

__all__ = ["OffloadedLM", "OffloadRunner", "build_offload"]


def __getattr__(name: str):
    # the runner imports torch: loaded on first use, so reading a Policy (``policy``, this
    # package's light module, which the policy search imports) does not import torch
    if name in __all__:
        from localgen.runtime.offload import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
