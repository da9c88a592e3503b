"""What one layer's attention computes, beyond the paged layout: ``AttentionSpec``.

A backend says whether it computes a spec (``AttentionBackend.supports``); the engine checks every
layer's spec once when it picks its backend (``localgen.attention.select``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """One layer's attention math.

    scale: multiplier of ``q . k`` before the softmax (usually ``head_dim ** -0.5``).
    sliding_window: a query at position p sees keys at positions ``p - sliding_window + 1 .. p``
        (Mistral's sliding-window attention, Jiang et al. 2023 §2); None = the whole context.
    logit_softcap: scores become ``c * tanh(s / c)`` before the softmax (Gemma 2, Team Gemma 2024
        §2); None = off.
    sinks: ``[num_heads]`` float32 learned sink logits: each head's softmax denominator gains
        ``exp(sink)`` with no value attached (attention sinks as gpt-oss trains them; Xiao et al.,
        StreamingLLM, ICLR 2024, for the phenomenon); None = off.
    Raises ValueError for a non-positive window or softcap.
    """

    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self):
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"AttentionSpec.sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"AttentionSpec.logit_softcap must be > 0, got {self.logit_softcap}")

    def features(self) -> list[str]:
        """Names of the features this spec uses beyond scaled causal attention (empty: plain)."""
        return [name for name, on in (("sliding-window attention", self.sliding_window is not None),
                                      ("logit soft-capping", self.logit_softcap is not None),
                                      ("attention sinks", self.sinks is not None)) if on]

    @property
    def plain(self) -> bool:
        """Scaled causal attention and nothing else: what every backend computes."""
        return self.sliding_window is None and self.logit_softcap is None and self.sinks is None


def layer_window(cfg, i: int) -> int | None:
    """Layer ``i``'s sliding window in tokens (None: full attention) of a ``ModelConfig``: its
    ``dense.window(i)`` (a model interleaving sliding and global layers, Gemma 2/3, gives the
    window to its sliding layers only), else the config's ``sliding_window`` for every layer."""
    dense = getattr(cfg, "dense", None)
    if dense is not None:
        return dense.window(i)
    return getattr(cfg, "sliding_window", None) or None


def layer_specs(cfg) -> list[AttentionSpec]:
    """The spec of each of ``cfg.num_layers`` layers of a ``ModelConfig``: ``head_dim ** -0.5``
    scaling, the layer's own sliding window (``layer_window``) and the softcap the config states
    (``attn_logit_softcapping``: Hugging Face's name; absent on families without one)."""
    cap = getattr(cfg, "attn_logit_softcapping", None) or None
    scale = cfg.head_dim ** -0.5
    specs = {w: AttentionSpec(scale, w, cap) for w in {layer_window(cfg, i)
                                                       for i in range(cfg.num_layers)}}
    return [specs[layer_window(cfg, i)] for i in range(cfg.num_layers)]


@functools.lru_cache(maxsize=64)
def default_spec(head_dim: int) -> AttentionSpec:
    """Plain causal attention scaled by ``head_dim ** -0.5`` (one shared object per size)."""
    return AttentionSpec(head_dim ** -0.5)
