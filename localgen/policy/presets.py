"""Architecture shapes of well-known models, for the policy search without downloading anything.

Each entry is the subset of the model's Hugging Face ``config.json`` that ``ModelConfig.from_hf_dict``
reads, copied from the file named in ``PRESET_SOURCES``. OPT-175B was never published on the hub;
its shapes are the OPT paper's (Zhang et al. 2022, Table 1), as FlexGen's ``opt_config.py`` uses.
"""

from __future__ import annotations

import math
import os

from localgen.models.config import ModelConfig
from localgen.policy.cost_model import StoredWeights


def _opt(hidden: int, ffn: int, layers: int, heads: int) -> dict:
    return {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272,
            "hidden_size": hidden, "ffn_dim": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "max_position_embeddings": 2048, "word_embed_proj_dim": hidden,
            "do_layer_norm_before": True, "enable_bias": True, "activation_function": "relu",
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 2, "torch_dtype": "float16"}


def _llama2(hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}


HF_CONFIGS: dict[str, dict] = {
    "opt-6.7b": _opt(4096, 16384, 32, 32),
    "opt-30b": _opt(7168, 28672, 48, 56),
    "opt-175b": _opt(12288, 49152, 96, 96),
    "llama-2-7b": _llama2(4096, 11008, 32, 32, 32),
    "llama-2-70b": _llama2(8192, 28672, 80, 64, 8),
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
}

PRESET_SOURCES: dict[str, str] = {
    "opt-6.7b": "huggingface.co/facebook/opt-6.7b/config.json",
    "opt-30b": "huggingface.co/facebook/opt-30b/config.json",
    "opt-175b": "OPT paper (Zhang et al. 2022) Table 1; FlexGen flexgen/opt_config.py",
    "llama-2-7b": "huggingface.co/meta-llama/Llama-2-7b-hf/config.json",
    "llama-2-70b": "huggingface.co/meta-llama/Llama-2-70b-hf/config.json",
    "smollm2-135m": "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/config.json",
}

_ALIASES = {"facebook/opt-6.7b": "opt-6.7b", "facebook/opt-30b": "opt-30b", "facebook/opt-175b": "opt-175b",
            "meta-llama/llama-2-7b-hf": "llama-2-7b", "meta-llama/llama-2-70b-hf": "llama-2-70b",
            "huggingfacetb/smollm2-135m-instruct": "smollm2-135m", "huggingfacetb/smollm2-135m": "smollm2-135m",
            "smollm2-135m-instruct": "smollm2-135m"}


def preset_names() -> list[str]:
    return list(HF_CONFIGS)


def preset_config(name: str) -> ModelConfig:
    """ModelConfig of a preset ("opt-30b", or a hub id such as "facebook/opt-30b").

    Raises KeyError listing the preset names.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in HF_CONFIGS:
        raise KeyError(f"no preset {name!r}; presets: {', '.join(HF_CONFIGS)}")
    return ModelConfig.from_hf_dict(HF_CONFIGS[key])


def resolve_model_weights(spec: str | None) -> tuple[ModelConfig, StoredWeights | None]:
    """``spec``'s ModelConfig and, for a model whose weights the runtime keeps in their stored
    form (``stored_weights``), those bytes; one resolution of the model. ``spec``: a preset name
    (or its hub id), else anything ``models.sources.resolve_model`` resolves (None: the embedded
    default). Raises what ``resolve_model`` raises (ModelNotFoundError…)."""
    if spec is not None:
        try:
            return preset_config(spec), None
        except KeyError:
            pass
    from localgen.models.sources import resolve_model

    src = resolve_model(spec)
    return src.config, stored_weights(src)


def stored_weights(src, dtype_bytes: int = 2) -> StoredWeights | None:
    """The bytes a resolved model's (``models.sources.ModelSource``) weights take as the runtime
    keeps them, when that is not ``dtype_bytes`` per parameter: a GGUF's matrices stay in the
    file's blocks (tensors of types the packed weight does not hold, and norms, in the compute
    dtype). None for a float checkpoint, or with ``LOCALGEN_GGUF_PACKED=0``."""
    from localgen.models.model import GGUF_PACKED_ENV

    store = src.weights
    if not hasattr(store, "get_packed") or os.environ.get(GGUF_PACKED_ENV, "1") == "0":
        return None
    layers = other = 0
    for name in store.names():
        shape = store.shape(name)
        n = store.nbytes(name) if store.packs(name) else math.prod(shape) * dtype_bytes
        if name.startswith("model.layers."):
            layers += n
        else:
            other += n
    return StoredWeights(layers / src.config.num_layers, other)
