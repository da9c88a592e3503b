"""GGUF files of the dense families (llama.cpp archs qwen3, phi3, granite, olmo2, smollm3, gemma2,
gemma3) as the Hugging Face config keys and tensor names ``dense_options`` and ``dense`` read.

Where a GGUF leaves a setting out, llama.cpp's loader fixes it per arch, and so does this module:
Gemma's sliding-window pattern (every 2nd layer full for gemma2, every 6th for gemma3, unless
``attention.sliding_window_pattern`` says), Gemma's softcaps (50 and 30 when absent), Gemma's
query scale (``head_dim``; hidden / heads for the 27B layer counts), SmolLM3's layers without
RoPE (every 4th), the sliding layers' RoPE base (10000 when absent). Gemma's converter stores the
RMSNorm gains as ``1 + w``, so its files run with no offset. Sources: llama.cpp's
``src/models/{gemma2,gemma3,smollm3,granite,phi3}.cpp`` and ``conversion/*.py``; key names:
gguf-py's constants.py.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from localgen.models.gguf_reader import gguf_field
from localgen.models.gguf_tensors import dequantize_tensor

ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE
# per arch: llama.cpp layer tensor part -> HF parameter path (over gguf_names.LAYER_NAMES)
ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "olmo2": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
}
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
ARCH_LAYER_NAMES["gemma2"] = _GEMMA_NAMES
ARCH_LAYER_NAMES["qwen3moe"] = ARCH_LAYER_NAMES["qwen3"]  # Qwen3-MoE's attention is Qwen3's
ARCH_LAYER_NAMES["gemma3"] = {**_GEMMA_NAMES, "attn_q_norm": "self_attn.q_norm",
                              "attn_k_norm": "self_attn.k_norm"}
# `{arch}.` keys each arch's config reads here (gguf_config accepts them for that arch only)
ARCH_KEYS: dict[str, frozenset[str]] = {
    "phi3": frozenset({"rope.scaling.attn_factor", "attention.sliding_window"}),
    "granite": frozenset({"attention.scale", "embedding_scale", "residual_scale", "logit_scale"}),
    "gemma2": frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                         "attn_logit_softcapping", "final_logit_softcapping", "rope.freq_base_swa"}),
    "gemma3": frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                         "final_logit_softcapping", "rope.freq_base_swa"}),
}
PARTIAL_ROTARY_ARCHS = frozenset({"phi3"})  # rope.dimension_count may be below head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B


def dense_hf_config(reader, arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The HF config keys of a dense-family file of GGUF arch ``arch``, given the common keys
    ``d`` (hidden_size, head_dim, num_hidden_layers…); {} for other archs."""
    g = lambda key, default=None: gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    n = d["num_hidden_layers"]
    if arch == "granite":
        return {"attention_multiplier": float(g("attention.scale", d["head_dim"] ** -0.5)),
                "embedding_multiplier": float(g("embedding_scale", 1.0)),
                "residual_multiplier": float(g("residual_scale", 1.0)),
                "logits_scaling": float(g("logit_scale", 1.0))}
    if arch == "smollm3":
        return {"no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(n)]}
    if arch == "phi3":
        return _phi3(reader, g, d)
    if arch in _GEMMA_27B_LAYERS:
        return _gemma(reader, arch, g, d)
    return {}


def _phi3(reader, g, d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"partial_rotary_factor": int(g("rope.dimension_count", d["head_dim"]))
                           / d["head_dim"]}
    if g("attention.sliding_window", 0):
        out["sliding_window"] = int(g("attention.sliding_window"))
    tensors = {t.name: t for t in reader.tensors}
    if ROPE_FACTORS[0] in tensors:
        long, short = (dequantize_tensor(tensors[n]).float().flatten().tolist() for n in ROPE_FACTORS)
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                               "original_max_position_embeddings":
                                   int(g("rope.scaling.original_context_length")),
                               "attention_factor": float(g("rope.scaling.attn_factor", 1.0))}
    return out


def _gemma(reader, arch: str, g, d: dict[str, Any]) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    scalar = d["hidden_size"] / d["num_attention_heads"] if n == _GEMMA_27B_LAYERS[arch] \
        else d["head_dim"]
    out: dict[str, Any] = {"query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
                           "localgen": {"norm_offset": 0.0}}
    window = g("attention.sliding_window", 4096 if arch == "gemma2" else 0)
    if window:
        out["sliding_window"] = int(window)
        out["layer_types"] = _layer_types(g("attention.sliding_window_pattern"), n,
                                          2 if arch == "gemma2" else 6)
    if arch == "gemma2":
        out["attn_logit_softcapping"] = float(g("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(g("final_logit_softcapping", 30.0))
    else:
        out["final_logit_softcapping"] = float(g("final_logit_softcapping", 0.0)) or None
        out["rope_local_base_freq"] = float(g("rope.freq_base_swa", 10000.0))
    return out


def _layer_types(pattern: Any, n: int, default: int) -> list[str]:
    """llama.cpp's ``load_swa_pattern``: a per-layer bool list (True = sliding), else every
    ``pattern``-th layer full (the last of each group)."""
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    every = int(pattern or default)
    return ["sliding_attention" if every == 0 or i % every < every - 1 else "full_attention"
            for i in range(n)]


@contextlib.contextmanager
def transformers_reads_arch(arch: str) -> Iterator[None]:
    """Within the block, transformers' GGUF loader accepts a dense arch it has no model for,
    reading its keys as llama's: the tokenizer it converts depends on ``tokenizer.ggml.*`` only.
    Restored on exit; the caller serializes (``gguf_reader.stock_reader_replaced``)."""
    import transformers.modeling_gguf_pytorch_utils as tg

    known = tg.GGUF_SUPPORTED_ARCHITECTURES
    if arch in known or arch not in _DENSE_ARCHS:
        yield
        return
    known.append(arch)
    tg.GGUF_TO_TRANSFORMERS_MAPPING["config"][arch] = tg.GGUF_TO_TRANSFORMERS_MAPPING["config"]["llama"]
    try:
        yield
    finally:
        known.remove(arch)
        del tg.GGUF_TO_TRANSFORMERS_MAPPING["config"][arch]


_DENSE_ARCHS = frozenset({"qwen3", "phi3", "granite", "olmo2", "smollm3", "gemma2", "gemma3"})
