"""Rotary position embeddings (RoFormer), Hugging Face's rotate-half layout, with the
``linear``, ``llama3`` (Llama 3.1 report, §3: "RoPE scaling"), LongRoPE and YaRN scalings and
per-frequency divisors (a GGUF's ``rope_freqs`` tensor: llama.cpp's ``ggml_rope_ext``
``freq_factors``, where pair i turns by ``pos * theta**(-2i/d) / factors[i]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localgen.models.config import ModelConfig, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


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


def rotary_dim(cfg: ModelConfig) -> int:
    """Dimensions of a head that RoPE turns: the first ``head_dim * partial_rotary_factor``."""
    return int(cfg.head_dim * cfg.dense.partial_rotary_factor)


def _base(cfg: ModelConfig, theta: float) -> torch.Tensor:
    d = rotary_dim(cfg)
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _scaled(cfg: ModelConfig) -> torch.Tensor:
    inv = _base(cfg, cfg.rope_theta)
    scaling = cfg.rope_scaling or {}
    rtype = scaling.get("rope_type", "default")
    if rtype == "default":
        return inv
    if rtype == "longrope":
        return inv / _longrope_factors(cfg, "short_factor")
    if rtype == "linear":
        return inv / float(scaling["factor"])
    if rtype == "llama3":
        return _llama3_scaling(inv, scaling)
    if rtype == "yarn":
        return _yarn_scaling(cfg, inv, scaling)
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


def step_rope(inv_freq: "torch.Tensor | LayerRopes | None", positions: torch.Tensor, dtype: torch.dtype, fused: bool):
    """A step's rope in the form its layers take: ``RotaryPositions`` where the fused kernels run
    (``fused``; they form cos/sin in-kernel), else cos/sin tables; None without rotary (OPT);
    ``StepRopes`` for a model whose layers differ (``inv_freq`` a ``LayerRopes``)."""
    if inv_freq is None:
        return None
    if isinstance(inv_freq, LayerRopes):
        return StepRopes(inv_freq, positions, dtype)
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


# ---- LongRoPE (Ding et al., "LongRoPE", 2024 §3; Phi-3 report) -------------------------------


def _longrope_factors(cfg: ModelConfig, key: str) -> torch.Tensor:
    """LongRoPE's per-frequency divisors ``short_factor`` or ``long_factor`` (rotary_dim / 2
    values). Raises UnsupportedModelError when the count is wrong."""
    f = torch.tensor([float(x) for x in cfg.rope_scaling[key]], dtype=torch.float32)
    if f.numel() != rotary_dim(cfg) // 2:
        raise UnsupportedModelError(f"rope_scaling.{key} holds {f.numel()} factors; the rotary "
                                    f"dimension {rotary_dim(cfg)} has {rotary_dim(cfg) // 2}")
    return f


def original_max_positions(cfg: ModelConfig) -> int:
    """The pretraining context LongRoPE extends (``original_max_position_embeddings``)."""
    s = cfg.rope_scaling or {}
    return int(s.get("original_max_position_embeddings")
               or cfg.extra.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def attention_factor(cfg: ModelConfig) -> float:
    """LongRoPE's multiplier of cos and sin: the config's ``attention_factor``, else
    ``sqrt(1 + ln(s) / ln(L0))`` with ``s = max_position_embeddings / L0`` (1 when s <= 1)."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "yarn":
        return _yarn_attention_factor(s)
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    orig = original_max_positions(cfg)
    factor = float(s.get("factor") or cfg.max_position_embeddings / orig)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


# ---- YaRN (Peng et al., "YaRN: Efficient Context Window Extension of LLMs", ICLR 2024, §3.2-3.4)


def _yarn_scaling(cfg: ModelConfig, inv: torch.Tensor, s: dict) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies: dimensions that turn more than ``beta_fast`` times over
    the original context keep their frequency, those turning fewer than ``beta_slow`` times are
    divided by ``factor``, a linear ramp between (``truncate`` rounds the ramp's ends outward)."""
    factor, d, base = float(s["factor"]), rotary_dim(cfg), cfg.rope_theta
    orig = float(s.get("original_max_position_embeddings") or original_max_positions(cfg))

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over orig
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(float(s.get("beta_fast") or 32)), dim_of(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def _yarn_attention_factor(s: dict) -> float:
    """YaRN's multiplier of cos and sin: ``attention_factor``, else ``0.1 ln(factor) + 1``
    (with ``mscale`` / ``mscale_all_dim``: the ratio of two such terms)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


# ---- per-layer rotary tables (the dense families) ---------------------------------------------


@dataclass(frozen=True)
class LayerRopes:
    """The rotary frequencies of a model whose layers differ (``cfg.dense`` not plain): one
    ``[rotary_dim // 2]`` float32 inverse-frequency tensor per table kind ("global", "local";
    ``DenseOptions.rope_kind``), LongRoPE's long-context table, and each layer's kind."""

    inv_freqs: dict
    kinds: tuple
    long_inv_freq: torch.Tensor | None = None
    original_max: int = 0
    scale: float = 1.0  # LongRoPE's attention factor on cos and sin

    def to(self, device) -> "LayerRopes":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LayerRopes({k: move(v) for k, v in self.inv_freqs.items()}, self.kinds,
                          move(self.long_inv_freq), self.original_max, self.scale)


def layer_ropes(cfg: ModelConfig) -> LayerRopes:
    """``LayerRopes`` of ``cfg``; raises UnsupportedModelError as ``inv_frequencies``."""
    freqs = {"global": inv_frequencies(cfg)}
    if cfg.dense.rope_local_theta is not None:
        freqs["local"] = _base(cfg, cfg.dense.rope_local_theta)
    longrope = (cfg.rope_scaling or {}).get("rope_type") == "longrope"
    return LayerRopes(freqs, tuple(cfg.dense.rope_kind(i) for i in range(cfg.num_layers)),
                      _base(cfg, cfg.rope_theta) / _longrope_factors(cfg, "long_factor")
                      if longrope else None,
                      original_max_positions(cfg), attention_factor(cfg))


def model_rope(cfg: ModelConfig):
    """What a model keeps on its device for its rope: None without rotary (OPT), the inverse
    frequencies when every layer turns alike (the Llama path), else ``LayerRopes``."""
    if cfg.family != "llama":
        return None
    return inv_frequencies(cfg) if cfg.dense.plain and rotary_dim(cfg) == cfg.head_dim \
        and (cfg.rope_scaling or {}).get("rope_type") not in ("longrope", "yarn") else layer_ropes(cfg)


@dataclass(frozen=True)
class LayerRope:
    """What one layer of a dense-family model gets as its ``rope``: its index (its window and
    attention spec depend on it) and its cos/sin ``[num_tokens, rotary_dim]`` tables, None for a
    layer without RoPE."""

    index: int
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None


class StepRopes:
    """A step's tables of ``LayerRopes``, each kind computed once for all its layers.

    LongRoPE picks the long factors for a token whose position is at least the original context
    (``position + 1 > original_max``), per token: Hugging Face picks per forward call from the
    largest position, which agrees for a sequence decoded token by token and for prompts that
    stay within the original context."""

    def __init__(self, plan: LayerRopes, positions: torch.Tensor, dtype: torch.dtype):
        self.plan, self.positions, self.dtype = plan, positions, dtype
        self._tables: dict = {}

    def _table(self, kind: str):
        got = self._tables.get(kind)
        if got is None:
            inv = self.plan.inv_freqs[kind]
            if kind == "global" and self.plan.long_inv_freq is not None:
                long = (self.positions + 1 > self.plan.original_max)[:, None]
                freqs = self.positions.float()[:, None] * torch.where(
                    long, self.plan.long_inv_freq[None, :], inv[None, :])
            else:
                freqs = self.positions.float()[:, None] * inv.to(self.positions.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            got = self._tables[kind] = ((emb.cos() * self.plan.scale).to(self.dtype),
                                        (emb.sin() * self.plan.scale).to(self.dtype))
        return got

    def layer(self, i: int) -> LayerRope:
        kind = self.plan.kinds[i]
        return LayerRope(i, None if kind is None else self._table(kind))


def layer_rope(rope, i: int):
    """Layer ``i``'s rope from a step's rope: its ``LayerRope`` from ``StepRopes``, else the
    step's rope unchanged (every layer alike)."""
    return rope.layer(i) if isinstance(rope, StepRopes) else rope
