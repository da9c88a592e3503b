"""What the dense decoder families add to the Llama layer (``DenseOptions``), read from a Hugging
Face ``config.json`` dict.

Sources per family: the ``transformers`` modeling code of each class (the reference the tests
compare against) and the papers named on each field. A setting that changes the math and that
the layer does not implement raises UnsupportedModelError naming it; nothing is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

FULL, SLIDING = "full_attention", "sliding_attention"

# HF class -> weight-name layout of its decoder layer (dense.layer_weight_names)
LAYOUTS = {
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj and gate_up_proj
    "Olmo2ForCausalLM": "olmo2",  # post-norms only
    "Gemma2ForCausalLM": "gemma",  # pre- and post-norms around attention and MLP
    "Gemma3ForCausalLM": "gemma",
}
QK_NORM = {  # "head": one [head_dim] gain shared by the heads; "proj": one gain per projection row
    "Qwen3ForCausalLM": "head", "Gemma3ForCausalLM": "head", "Olmo2ForCausalLM": "proj",
    "Qwen3MoeForCausalLM": "head",
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


class DenseConfigError(ValueError):
    """A config setting the dense layer has no math for (config.py turns it into
    UnsupportedModelError)."""


@dataclass(frozen=True)
class DenseOptions:
    """Per-family departures from the Llama decoder layer; the defaults are Llama's.

    layout: weight-name layout of a layer ("llama", "phi3", "olmo2", "gemma").
    qk_norm: RMSNorm of q and k before RoPE: "" off, "head" per head over head_dim (Qwen3,
        Gemma 3), "proj" over the whole projection (OLMo 2).
    norm_offset: RMSNorm gains applied as ``norm_offset + w`` (Gemma's ``(1 + w)``), in float32.
    embedding_multiplier: embeddings are multiplied by it (Granite; Gemma's sqrt(hidden), rounded
        to the compute dtype first when ``embedding_multiplier_in_dtype``, as HF's Gemma does).
    residual_multiplier: each sub-layer's output is scaled by it before the residual add (Granite).
    attention_scale: softmax scale of ``q . k``; None = ``head_dim ** -0.5``.
    logits_scaling: logits are divided by it (Granite).
    final_logit_softcap / attn_logit_softcap: ``c * tanh(x / c)`` of the logits / the attention
        scores (Gemma 2, Team Gemma 2024 §2); None = off.
    sliding_window: keys a sliding layer's query sees (itself included); None = no window.
    layer_types: per layer FULL or SLIDING; empty = every layer SLIDING when a window is set,
        else FULL.
    rope_local_theta: RoPE base of the sliding layers (Gemma 3's ``rope_local_base_freq``; the
        config's rope_scaling then applies to the full layers only); None = one base.
    rope_layers: per layer whether it applies RoPE (SmolLM3's ``no_rope_layers``); empty = all.
    partial_rotary_factor: share of head_dim that RoPE turns (the first dimensions; Phi).
    attention_sinks: each layer holds ``self_attn.sinks``, one learned logit per head added to
        its softmax denominator (gpt-oss).
    """

    layout: str = "llama"
    qk_norm: str = ""
    norm_offset: float = 0.0
    embedding_multiplier: float = 1.0
    embedding_multiplier_in_dtype: bool = False
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    rope_layers: tuple[bool, ...] = ()
    partial_rotary_factor: float = 1.0
    attention_sinks: bool = False

    @property
    def plain(self) -> bool:
        """True when this is the Llama layer unchanged (the fused and C fast paths serve it)."""
        return self == DenseOptions()

    def is_sliding(self, i: int) -> bool:
        """Whether layer ``i`` attends within ``sliding_window``."""
        if self.sliding_window is None:
            return False
        return self.layer_types[i] == SLIDING if self.layer_types else True

    def kv_window(self, num_layers: int) -> int | None:
        """The window when every one of ``num_layers`` layers slides (the KV blocks behind it can
        be given back), else None."""
        if self.sliding_window is None or not all(map(self.is_sliding, range(num_layers))):
            return None
        return self.sliding_window

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window in tokens, None for a full-attention layer."""
        return self.sliding_window if self.is_sliding(i) else None

    def rope_kind(self, i: int) -> str | None:
        """Which rotary table layer ``i`` uses: "global", "local" (Gemma 3's sliding layers) or
        None (a SmolLM3 layer without RoPE)."""
        if self.rope_layers and not self.rope_layers[i]:
            return None
        return "local" if self.rope_local_theta is not None and self.is_sliding(i) else "global"


def dense_options(arch: str, d: Mapping[str, Any], num_layers: int, head_dim: int) -> DenseOptions:
    """The ``DenseOptions`` of HF class ``arch`` from its ``config.json`` dict ``d``.

    Raises DenseConfigError naming a setting that changes the math and is not implemented."""
    if d.get("use_bidirectional_attention"):
        raise DenseConfigError("use_bidirectional_attention = true: localgen runs causal "
                               "decoders only")
    hidden = int(d["hidden_size"])
    opts: dict[str, Any] = dict(layout=LAYOUTS.get(arch, "llama"), qk_norm=QK_NORM.get(arch, ""))
    if arch == "GraniteForCausalLM":
        opts.update(embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
                    residual_multiplier=float(d.get("residual_multiplier", 1.0)),
                    attention_scale=float(d.get("attention_multiplier", head_dim ** -0.5)),
                    logits_scaling=float(d.get("logits_scaling", 1.0)))
    if arch in GEMMA:
        opts.update(norm_offset=1.0, embedding_multiplier=math.sqrt(hidden),
                    embedding_multiplier_in_dtype=True,
                    attention_scale=float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5,
                    final_logit_softcap=d.get("final_logit_softcapping") or None,
                    attn_logit_softcap=d.get("attn_logit_softcapping") or None)
    if "norm_offset" in d.get("localgen", {}):  # a GGUF whose converter folded the offset in
        opts["norm_offset"] = float(d["localgen"]["norm_offset"])
    if arch == "GptOssForCausalLM":
        opts["attention_sinks"] = True
    if arch == "SmolLM3ForCausalLM" and d.get("no_rope_layers"):
        opts["rope_layers"] = tuple(bool(x) for x in d["no_rope_layers"])
        _check_len("no_rope_layers", opts["rope_layers"], num_layers)
    opts.update(_windows(arch, d, num_layers))
    opts.update(_rope_extras(arch, d))
    return DenseOptions(**opts)


def _check_len(key: str, values: tuple, num_layers: int) -> None:
    if len(values) != num_layers:
        raise DenseConfigError(f"{key} lists {len(values)} layers; the model has {num_layers}")


def _windows(arch: str, d: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types as HF's classes apply them: Mistral and Phi-3 window every
    layer; Qwen2/Qwen3 only with ``use_sliding_window`` (the layers from ``max_window_layers``
    on); Gemma, SmolLM3 and configs that list ``layer_types`` per layer."""
    window = d.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM") \
            and not d.get("use_sliding_window", False):
        window = None
    if not window:
        return {}
    types = tuple(d.get("layer_types") or ())
    if not types and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        start = int(d.get("max_window_layers", num_layers))
        types = tuple(SLIDING if i >= start else FULL for i in range(num_layers))
    if not types and arch in GEMMA:
        every = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 2)
        types = tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))
    if types:
        _check_len("layer_types", types, num_layers)
        unknown = set(types) - {FULL, SLIDING}
        if unknown:
            raise DenseConfigError(f"layer_types holds {sorted(unknown)}; localgen runs "
                                   f"{FULL!r} and {SLIDING!r} layers")
    return dict(sliding_window=int(window), layer_types=types)


def _rope_extras(arch: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's local RoPE base and Phi's partial rotary factor, from the older top-level keys
    or transformers 5's ``rope_parameters`` (one dict, or one per layer type)."""
    out: dict[str, Any] = {}
    params = d.get("rope_parameters") or {}
    local = d.get("rope_local_base_freq")
    if isinstance(params.get(SLIDING), Mapping):
        local = params[SLIDING].get("rope_theta", local)
        if params[SLIDING].get("rope_type", "default") != "default":
            raise DenseConfigError(f"rope_parameters.{SLIDING}.rope_type = "
                                   f"{params[SLIDING]['rope_type']!r}: scaling of the sliding "
                                   "layers' RoPE is not implemented")
    if local is not None and arch == "Gemma3ForCausalLM":
        out["rope_local_theta"] = float(local)
    factor = d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if float(factor) != 1.0:
        out["partial_rotary_factor"] = float(factor)
    return out


def global_rope_parameters(d: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The full-attention layers' entry of a per-layer-type ``rope_parameters`` (Gemma 3 under
    transformers 5), else None."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(FULL), Mapping):
        return params[FULL]
    return None

