"""GGUF files (llama.cpp format) as a `ModelConfig` plus a lazily dequantizing `WeightStore`.

The file is memory-mapped by `gguf.GGUFReader`; a tensor is dequantized only when `get` asks for
it. Names are mapped to Hugging Face parameter names, and for the ``llama`` arch the Q/K row
permutation that llama.cpp's converter applies (rotate-half -> interleaved RoPE pairs) is undone,
so the same layer math runs GGUF and safetensors checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localgen.models.config import ModelConfig, UnsupportedModelError
from localgen.models.weights import WeightStore

# GGUF `general.architecture` -> HF architecture class. Mistral GGUFs use the llama arch.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Chat-turn terminators: generation must stop on them even when the GGUF's eos is another token.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name; None for tensors we do not use (rope_freqs…)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation along rows (dim 0).

    llama.cpp views each head's rows as ``[2, head_dim/2]`` and transposes to ``[head_dim/2, 2]``
    (pairs interleaved); the inverse views ``[head_dim/2, 2]`` and transposes back. `n_head` is
    the number of heads the rows hold (num_kv_heads for K).
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class GGUFStore(WeightStore):
    """Tensors of one GGUF file, by HF name, dequantized on `get`.

    `get` returns F32 tensors as float32, F16 as float16, BF16 as bfloat16 and every quantized type
    (Q8_0, Q4_0, Q4_1, K-quants… whatever `gguf.quants` can dequantize) as float32, in HF
    orientation ``[out_features, in_features]``. `nbytes` is the stored (quantized) size.
    Raises UnsupportedModelError for GGUF archs other than llama/qwen2.
    """

    def __init__(self, path: str | Path, reader=None):
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = reader if reader is not None else GGUFReader(str(self.path))
        self.arch = str(_field(self.reader, "general.architecture"))
        self.hf_config = gguf_hf_config(self.reader)  # raises UnsupportedModelError first
        self._tensors = {}
        for t in self.reader.tensors:
            hf = gguf_to_hf_name(t.name)
            if hf is not None:
                self._tensors[hf] = t
        n_head, n_kv = self.hf_config["num_attention_heads"], self.hf_config["num_key_value_heads"]
        # Only the llama converter permutes Q/K; qwen2 (NeoX-style RoPE) is stored as in HF.
        self._permute_heads = (
            {".self_attn.q_proj.": n_head, ".self_attn.k_proj.": n_kv} if self.arch == "llama" else {}
        )
        self.dtype = self._dominant_dtype()

    def _dominant_dtype(self) -> torch.dtype:
        from gguf import GGMLQuantizationType as Q

        kinds = [t.tensor_type for t in self._tensors.values() if len(t.shape) > 1]
        if kinds and all(k == Q.F16 for k in kinds):
            return torch.float16
        if kinds and all(k == Q.BF16 for k in kinds):
            return torch.bfloat16
        return torch.float32

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first (ne0 = columns); HF lists rows first.
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def nbytes(self, name: str) -> int:
        return int(self._tensor(name).n_bytes)

    def get(self, name: str) -> torch.Tensor:
        t = self._tensor(name)
        w = _dequantize(t).reshape(self.shape(name))
        for key, heads in self._permute_heads.items():
            if key in name:
                w = unpermute_qk(w, heads).contiguous()
        return w

    def __repr__(self) -> str:
        return f"GGUFStore({str(self.path)!r}, arch={self.arch!r})"


def _dequantize(t) -> torch.Tensor:
    """One GGUF tensor as a CPU torch tensor (copied out of the memory map)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type == Q.F32:
        return torch.from_numpy(np.array(t.data, dtype=np.float32))
    if t.tensor_type == Q.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16))
    if t.tensor_type == Q.BF16:
        # Keep bf16 bit-exact instead of widening: reinterpret the raw 16-bit words.
        raw = np.array(t.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))


def _head_count_kv(reader, arch: str, n_head: int) -> int:
    kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    # Some files store a per-layer list; the layer math needs one value.
    return int(max(kv)) if isinstance(kv, list) else int(kv)


def _vocab(reader) -> list[str]:
    return _field(reader, "tokenizer.ggml.tokens", []) or []


def gguf_eos_token_ids(reader) -> tuple[int, ...]:
    """EOS ids: ``tokenizer.ggml.eos_token_id`` (and eot/eom ids) plus chat-turn end tokens
    (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``) that the chat template uses and the vocab holds."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _field(reader, key)
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    template = _field(reader, "tokenizer.chat_template") or ""
    wanted = [t for t in CHAT_END_TOKENS if t in template]
    if wanted:
        index = {tok: i for i, tok in enumerate(_vocab(reader))}
        ids += [index[t] for t in wanted if t in index and index[t] not in ids]
    return tuple(ids)


def gguf_hf_config(reader) -> dict[str, Any]:
    """GGUF metadata -> a Hugging Face ``config.json``-style dict.

    Raises UnsupportedModelError for archs other than llama/qwen2.
    """
    arch = str(_field(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; localgen reads GGUF archs: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    hf_arch = GGUF_ARCHITECTURES[arch]
    name = str(_field(reader, "general.name", "") or "")
    if arch == "llama" and "mistral" in name.lower():
        hf_arch = "MistralForCausalLM"  # same math; keeps the name users expect
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_head = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = g("vocab_size") or len(_vocab(reader)) or _embedding_rows(reader)
    head_dim = g("attention.key_length") or (g("rope.dimension_count") if arch == "llama" else None)
    d: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(hf_arch, arch),
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": _head_count_kv(reader, arch, n_head),
        "head_dim": int(head_dim or hidden // n_head),
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(reader)),
        "gguf_file_type": _file_type_name(reader),
    }
    scaling = g("rope.scaling.type")
    if scaling in ("linear", "yarn") and g("rope.scaling.factor"):
        d["rope_scaling"] = {"rope_type": scaling, "factor": float(g("rope.scaling.factor"))}
    return d


def _embedding_rows(reader) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    return 0


def _file_type_name(reader) -> str | None:
    from gguf import LlamaFileType

    ft = _field(reader, "general.file_type")
    try:
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else None
    except ValueError:
        return str(ft)


def load_gguf(path: str | Path) -> tuple[ModelConfig, GGUFStore]:
    """Open a GGUF file: its `ModelConfig` (dtype = the dequantized dtype) and lazy weights.

    Raises FileNotFoundError, UnsupportedModelError (archs other than llama/qwen2).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    store = GGUFStore(path)
    d = dict(store.hf_config)
    d["torch_dtype"] = str(store.dtype).removeprefix("torch.")
    return ModelConfig.from_hf_dict(d), store


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF, via transformers (slow: ~10 s for a 49k vocab).

    Sets `chat_template` from the GGUF metadata when transformers did not.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tok, "chat_template", None):
        from gguf import GGUFReader

        template = _field(GGUFReader(str(path)), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
