"""Rotary position embeddings (RoFormer), Hugging Face's rotate-half layout, with the
``linear`` and ``llama3`` frequency scalings (Llama 3.1 report, §3: "RoPE scaling") and
per-frequency divisors (a GGUF's ``rope_freqs`` tensor: llama.cpp's ``ggml_rope_ext``
``freq_factors``, where pair i turns by ``pos * theta**(-2i/d) / factors[i]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localgen.models.config import ModelConfig, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies (radians per position) after the configured
    scaling, divided by ``cfg.rope_freq_factors`` when set.

    Raises UnsupportedModelError for an unknown rope_type, ValueError when the factors are not
    head_dim // 2 values."""
    inv = _scaled(cfg)
    if cfg.rope_freq_factors is None:
        return inv
    factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    if factors.shape != inv.shape:
        raise ValueError(f"rope_freq_factors holds {factors.numel()} values; head_dim "
                         f"{cfg.head_dim} needs {inv.numel()}")
    return inv / factors


def _scaled(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    rtype = scaling.get("rope_type", "default")
    if rtype == "default":
        return inv
    if rtype == "linear":
        return inv / float(scaling["factor"])
    if rtype == "llama3":
        return _llama3_scaling(inv, scaling)
    raise UnsupportedModelError(
        f"rope_type {rtype!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scaling(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Low frequencies are divided by `factor`, high ones kept, the band between interpolated.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class RotaryPositions:
    """The fused-kernel form of a step's rope: int ``positions`` ``[num_tokens]`` and float32
    ``inv_freq`` ``[head_dim // 2]``, both on the compute device; the Triton rope kernel forms
    cos/sin itself (``localgen.kernels.fused_rope``). Not a tuple, so it cannot be unpacked as
    ``cos, sin`` by mistake; ``cos_sin(dtype)`` gives the tables for the torch path."""

    positions: torch.Tensor
    inv_freq: torch.Tensor

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, self.positions, dtype)


def step_rope(inv_freq: torch.Tensor | None, positions: torch.Tensor, dtype: torch.dtype, fused: bool):
    """A step's rope in the form its layers take: ``RotaryPositions`` where the fused kernels run
    (``fused``; they form cos/sin in-kernel), else cos/sin tables; None without rotary (OPT)."""
    if inv_freq is None:
        return None
    return RotaryPositions(positions, inv_freq) if fused else rope_cos_sin(inv_freq, positions, dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin ``[num_tokens, head_dim]`` for int positions ``[num_tokens]``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_signed = (None, None)  # (sin table, its sign-folded twin): the last step's, reused by every layer


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, ``[num_tokens, 1, head_dim]``: rotate-half's minus
    sign folded into the table, so a rotation is ``x cos + roll(x, d/2) sin_signed``."""
    global _signed
    cached = _signed  # one read: another thread may replace it meanwhile
    if cached[0] is sin:
        return cached[1]
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]
    _signed = (sin, signed)
    return signed


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[num_tokens, heads, head_dim]`` rotated by position (rotate-half layout):
    ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = cat(-x2, x1) = roll(x, d/2) * sign``,
    three kernels (roll, mul, addcmul) instead of six."""
    return torch.addcmul(x * cos[:, None, :], x.roll(x.shape[-1] // 2, -1), _signed_sin(sin))
