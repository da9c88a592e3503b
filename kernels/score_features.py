"""The attention features beyond scaled causal attention that the paged Triton kernels compute
(``paged_decode``, ``paged_prefill``), as compile-time switches: a sliding window (Mistral,
Jiang et al. 2023 §2), a logit soft-cap (Gemma 2, Team Gemma 2024 §2) and per-head sink logits
(gpt-oss; Xiao et al., StreamingLLM, ICLR 2024). Each is a constexpr whose off value (0, 0.0,
False) compiles the guarded code away, so a launch without them is the plain kernel.

Conventions match ``localgen.attention.spec.AttentionSpec`` and its reference,
``paged_attention_ref.feature_attention``: a query at position p sees keys ``p - window + 1 ..
p``; scores become ``cap * tanh(s / cap)`` before the causal and window masks; head h's softmax
denominator gains ``exp(sinks[h])``. The kernels score in log2 units (``qk_scale`` includes
log2(e)), so the cap is passed as ``cap * log2(e)`` (``SOFTCAP2``) and sink logits are scaled
by log2(e) where they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E


@dataclass(frozen=True)
class ScoreFeatures:
    """One launch's feature switches. ``window``: keys a query sees, itself included (0: the
    whole context); ``softcap``: the cap c in natural-log units (0.0: off); ``sinks``: whether a
    ``[num_heads]`` sink logit tensor is passed."""

    window: int = 0
    softcap: float = 0.0
    sinks: bool = False

    @classmethod
    def of(cls, sliding_window: int | None, logit_softcap: float | None,
           sinks: torch.Tensor | None) -> ScoreFeatures:
        """From ``AttentionSpec``-style arguments (None: off). Raises ValueError for a window
        below 1 or a cap that is not positive."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0, got {logit_softcap}")
        if sliding_window is None and logit_softcap is None and sinks is None:
            return _PLAIN
        return cls(int(sliding_window or 0), float(logit_softcap or 0.0), sinks is not None)

    def constexprs(self) -> dict:
        """The kernels' switches: WINDOW, SOFTCAP2 (the cap in log2 units), SINKS."""
        return dict(WINDOW=self.window, SOFTCAP2=self.softcap * LOG2E, SINKS=self.sinks)


_PLAIN = ScoreFeatures()


def sinks_arg(sinks: torch.Tensor | None, num_heads: int, device: torch.device):
    """The sink logits a kernel reads (``[num_heads]``, any float dtype, on ``device``,
    contiguous), or None when there are none (Triton takes a None argument as a constant: the
    plain kernel gains no parameter). Raises ValueError for another shape."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float [{num_heads}] tensor (one logit per query "
                         f"head), got {sinks.dtype} {tuple(sinks.shape)}")
    return sinks.to(device).contiguous()


@triton.jit
def window_start(pos, WINDOW: tl.constexpr):
    """The first key position a query at ``pos`` sees: ``pos - WINDOW + 1``, at least 0; 0
    without a window."""
    if WINDOW > 0:
        first = tl.maximum(pos - (WINDOW - 1), 0)
    else:
        first = 0  # a constant: the plain kernel's loops start where they always did
    return first


@triton.jit
def soft_capped(s, SOFTCAP2: tl.constexpr):
    """``SOFTCAP2 * tanh(s / SOFTCAP2)`` of scores ``s`` (finite, log2 units; the ratio, and so
    the tanh, is the same in natural units), written through one exp: ``tanh(y) = 1 - 2 /
    (e^(2y) + 1)``, which saturates to +-1 without overflow. ``s`` unchanged when off."""
    if SOFTCAP2 > 0:
        e = tl.exp(s * (2.0 / SOFTCAP2))
        s = SOFTCAP2 - (2.0 * SOFTCAP2) / (e + 1.0)
    return s


@triton.jit
def sink_logits(sinks_ptr, heads, h_mask):
    """The sink logits of query heads ``heads`` in log2 units (float32; 0 on masked rows)."""
    return tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634


@triton.jit
def with_sink(l, ref_m, sinks_ptr, heads, h_mask, SINKS: tl.constexpr):
    """A softmax denominator ``l`` (relative to ``exp2(ref_m)``) with each head's sink term
    ``exp2(sink - ref_m)`` added; ``l`` unchanged without sinks."""
    if SINKS:
        l = l + tl.exp2(sink_logits(sinks_ptr, heads, h_mask) - ref_m)
    return l


@triton.jit
def with_sink_max(row_max, sinks_ptr, heads, h_mask, SINKS: tl.constexpr):
    """A row's largest logit (log2 units) counting its sink: the asynchronized softmax's safety
    check covers the sink term too."""
    if SINKS:
        row_max = tl.maximum(row_max, sink_logits(sinks_ptr, heads, h_mask))
    return row_max


__all__ = ["ScoreFeatures", "sinks_arg", "window_start", "soft_capped", "with_sink",
           "with_sink_max"]
