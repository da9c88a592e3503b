"""llama.cpp's GGUF tensor names -> Hugging Face parameter names.

Names: gguf-py's ``constants.py`` (``MODEL_TENSOR`` / ``TENSOR_NAMES``). A GGUF layer tensor is
``blk.N.<part>.{weight,bias}``; ``rope_freqs.weight`` has no HF parameter (it enters the config).
"""

from __future__ import annotations

import re

from localgen.models.gguf_dense import ARCH_LAYER_NAMES

TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# blk.N.<part>.<weight|bias>: group 1 the layer index, 2 the part, 3 weight or bias.
LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_NORMS = {"attn_norm", "ffn_norm"}  # RMSNorm gains: a bias there has no place in the Llama math
ROPE_FREQS = "rope_freqs.weight"


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> HF parameter name in a file of GGUF arch ``arch`` (whose own
    names, ``gguf_dense.ARCH_LAYER_NAMES``, come first); None for a name with no HF parameter
    (rope_freqs.weight, which goes into the config; `gguf_hf_config` refuses all others)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    m = LAYER_TENSOR_RE.fullmatch(name)
    names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(arch, {})}
    if not m or m.group(2) not in names or ("norm" in m.group(2) and m.group(3) == "bias"):
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
