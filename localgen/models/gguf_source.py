"""GGUF files (llama.cpp format) as a `ModelConfig` plus a lazily dequantizing `WeightStore`.

The file is memory-mapped by `gguf.GGUFReader`; a tensor is dequantized only when `get` asks for
it. Names are mapped to Hugging Face parameter names, and for the ``llama`` arch the Q/K row
permutation that llama.cpp's converter applies (rotate-half -> interleaved RoPE pairs) is undone,
so the same layer math runs GGUF and safetensors checkpoints.

Nothing that changes the math is skipped: a key or tensor localgen does not implement refuses the
load (UnsupportedModelError naming the file, the key or tensor and its value). Accepted are:

- keys outside the ``{arch}.`` namespace (``general.*``, ``tokenizer.*``, ``quantize.*``, the
  reader's ``GGUF.*``…): llama.cpp reads no layer math from them. Except ``split.count`` > 1
  (tensors in other files), ``general.type`` other than ``model`` and ``adapter.*`` (LoRA files).
- ``{arch}.`` keys read into the config (`_READ_KEYS`): vocab_size, context_length,
  embedding_length, block_count, feed_forward_length, attention.head_count and head_count_kv
  (a per-layer list only when uniform), attention.key_length, attention.value_length and
  rope.dimension_count (each equal to head_dim: no partial rotary), layer_norm_rms_epsilon,
  rope.freq_base, rope.scaling.type none or linear with rope.scaling.factor (or the older
  rope.scale_linear).
- ``{arch}.`` keys that do not enter the math (`_INFO_KEYS`): rope.scaling.original_context_length
  and rope.scaling.finetuned (inputs of YaRN, which is refused), tensor_data_layout.
- ``{arch}.`` keys at the value that turns their feature off (`_NEUTRAL`): expert_count 0,
  attention.sliding_window 0, attention.causal true, soft-capping 0, logit_scale 1…
- tensors token_embd, output_norm, output, blk.N.{attn_norm, ffn_norm}.weight and
  blk.N.{attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down}.{weight, bias} for
  N < block_count, and rope_freqs.weight: llama.cpp's form of llama3 RoPE scaling, head_dim/2
  divisors of the inverse frequencies, applied as `ModelConfig.rope_freq_factors`.

Bad files fail before any generation: one that is not GGUF, whose header is cut or whose tensor
data runs past its end raises CorruptModelError naming the file, the tensor and the missing
bytes; a tensor type localgen cannot load raises UnsupportedModelError naming tensor and type.
Format: ggml's docs/gguf.md; key and tensor names: gguf-py's constants.py.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localgen.models.config import CorruptModelError, ModelConfig, UnsupportedModelError
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
_NORMS = {"attn_norm", "ffn_norm"}  # RMSNorm gains: a bias there has no place in the Llama math
ROPE_FREQS = "rope_freqs.weight"

# `{arch}.` keys that gguf_hf_config reads.
_READ_KEYS = frozenset({
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
})
# `{arch}.` keys that enter no math localgen runs (YaRN's inputs: YaRN itself is refused).
_INFO_KEYS = frozenset({
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "tensor_data_layout",
})
_MOE = "mixture-of-experts GGUF models are not supported yet"
# `{arch}.` key -> (the value that turns its feature off, why another value is refused). Checked
# in this order, so a Mixtral file is refused for its expert count.
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "expert_count": (0, _MOE),
    "expert_used_count": (0, _MOE),
    "expert_shared_count": (0, _MOE),
    "attention.sliding_window": (0, "sliding-window attention is not supported yet"),
    "attention.causal": (True, "non-causal attention is not supported"),
    "attn_logit_softcapping": (0.0, "attention logit soft-capping is not supported"),
    "final_logit_softcapping": (0.0, "final logit soft-capping is not supported"),
    "logit_scale": (1.0, "scaled output logits are not supported"),
    "embedding_scale": (1.0, "scaled embeddings are not supported"),
    "residual_scale": (1.0, "scaled residuals are not supported"),
    "attention.clamp_kqv": (0.0, "clamped Q/K/V are not supported"),
    "attention.max_alibi_bias": (0.0, "ALiBi attention biases are not supported"),
    "use_parallel_residual": (False, "parallel attention and MLP blocks are not supported"),
    "pooling_type": (0, "embedding (pooling) models are not supported"),
}
_REFUSED = {"attention.layer_norm_epsilon": "LayerNorm (non-RMS) models are not supported"}
_UNKNOWN = ("localgen does not implement this key and it may change the model's math, so the "
            "file is refused rather than the key ignored")
# Chat-turn terminators: generation must stop on them even when the GGUF's eos is another token.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name; None for a name with no HF parameter
    (rope_freqs.weight, which goes into the config; `gguf_hf_config` refuses all others)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if not m or m.group(2) not in _LAYER_NAMES or (m.group(2) in _NORMS and m.group(3) == "bias"):
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


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
    """Tensors of one GGUF file, by HF name, dequantized on `get` or kept in blocks by `get_packed`.

    `get` returns F32 tensors as float32, F16 as float16, BF16 as bfloat16 and every quantized type
    (Q8_0, Q4_0, Q4_1, K-quants… whatever `gguf.quants` can dequantize) as float32, in HF
    orientation ``[out_features, in_features]``. `get_packed` returns a 2-D tensor stored in one of
    ``gguf_blocks.PACKED_TYPES`` as a ``PackedGGUFWeight`` (the file's bytes, rows unpermuted like
    `get`'s); `packs` says which without reading data. `nbytes` is the stored (quantized) size.
    Raises UnsupportedModelError for GGUF archs other than llama/qwen2.
    """

    def __init__(self, path: str | Path, reader=None):
        self.path = Path(path)
        self.reader = reader if reader is not None else open_gguf(self.path)
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
        return self._unpermuted(name, _dequantize(t).reshape(self.shape(name)))

    def stored_type(self, name: str) -> str:
        """The GGUF type `name` is stored in (``"Q4_K"``, ``"F32"``…)."""
        return self._tensor(name).tensor_type.name

    def packs(self, name: str) -> bool:
        """Whether `get_packed` keeps `name` in blocks (a 2-D tensor of a packed type)."""
        from localgen.quant.gguf_blocks import PACKED_TYPES

        t = self._tensor(name)
        return len(t.shape) == 2 and t.tensor_type in PACKED_TYPES

    def get_packed(self, name: str):
        """`name` as a ``PackedGGUFWeight`` (raw blocks copied out of the memory map, CPU) when
        `packs` holds, else None (`get` serves float types as they are and expands the rest).
        llama.cpp's Q/K permutation moves whole rows, so it is undone on the raw rows."""
        from localgen.quant.gguf_blocks import PackedGGUFWeight

        if not self.packs(name):
            return None
        t = self._tensor(name)
        rows, cols = self.shape(name)
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)).reshape(rows, -1)
        _release_mapped(self.reader, int(t.data_offset), int(t.n_bytes))
        return PackedGGUFWeight(self._unpermuted(name, raw), t.tensor_type, (rows, cols))

    def _unpermuted(self, name: str, w: torch.Tensor) -> torch.Tensor:
        for key, heads in self._permute_heads.items():
            if key in name:
                w = unpermute_qk(w, heads).contiguous()
        return w

    def __repr__(self) -> str:
        return f"GGUFStore({str(self.path)!r}, arch={self.arch!r})"


def _release_mapped(reader, offset: int, nbytes: int) -> None:
    """Drop this process's mapping of a tensor's bytes once they are copied out (madvise
    DONTNEED on the read-only file map: the pages stay in the page cache, and a later read faults
    them back in), so loading holds the copies and not the mapped file besides them. A reader
    without a plain memory map (a split set) is left as it is."""
    mm = getattr(getattr(reader, "data", None), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
    except (OSError, ValueError):  # a map that refuses advice keeps its pages: only memory
        pass


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
    """GGUF metadata -> a Hugging Face ``config.json``-style dict, plus localgen's
    ``rope_freq_factors`` (the rope_freqs tensor, head_dim/2 floats) and ``gguf_file_type``.

    Raises UnsupportedModelError for archs other than llama/qwen2 and for any key or tensor that
    changes the math and that localgen does not implement (module docstring), naming the file,
    the key or tensor and its value.
    """
    arch, file = _arch(reader), _file_of(reader)
    _check_keys(reader, arch, file)
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_head = int(_required(reader, arch, "attention.head_count"))
    hidden = int(_required(reader, arch, "embedding_length"))
    n_layers = int(_required(reader, arch, "block_count"))
    _check_tensors(reader, file, n_layers)
    head_dim = _head_dim(reader, arch, hidden, n_head)
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = g("vocab_size") or len(_vocab(reader)) or _embedding_rows(reader)
    hf_arch = _hf_architecture(reader, arch)
    d: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(hf_arch, arch),
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, arch, "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_uniform(reader, arch, "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(reader)),
        "gguf_file_type": _file_type_name(reader),
    }
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        d["rope_scaling"] = scaling
    factors = _rope_freq_factors(reader, file, head_dim)
    if factors is not None:
        d["rope_freq_factors"] = factors
    return d


def _arch(reader) -> str:
    arch = str(_field(reader, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{_file_of(reader)}: unsupported GGUF architecture {arch!r}; localgen reads GGUF "
            f"archs: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return arch


def _hf_architecture(reader, arch: str) -> str:
    name = str(_field(reader, "general.name", "") or "")
    if arch == "llama" and "mistral" in name.lower():
        return "MistralForCausalLM"  # same math; keeps the name users expect
    return GGUF_ARCHITECTURES[arch]


def _file_of(reader) -> str:
    """The reader's file path (its memory map's), for messages."""
    return str(getattr(reader.data, "filename", None) or "GGUF file")


def _refuse(file: str, key: str, value: Any, why: str):
    shown = repr(value) if isinstance(value, str) else str(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise UnsupportedModelError(f"{file}: {key} = {shown}: {why}")


def _check_keys(reader, arch: str, file: str) -> None:
    """Refuse every metadata key that changes the math and that localgen does not implement."""
    prefix = arch + "."
    for name, (neutral, why) in _NEUTRAL.items():
        value = _field(reader, prefix + name)
        if value is not None and value != neutral:
            _refuse(file, prefix + name, value, why)
    for key in reader.fields:
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name in _REFUSED:
            _refuse(file, key, _field(reader, key), _REFUSED[name])
        if name is not None and name not in _READ_KEYS | _INFO_KEYS | _NEUTRAL.keys():
            _refuse(file, key, _field(reader, key), _UNKNOWN)
        if key.startswith("adapter."):
            _refuse(file, key, _field(reader, key), "a LoRA adapter file, not a model")
    splits = _field(reader, "split.count")
    if splits is not None and int(splits) > 1:
        _refuse(file, "split.count", splits, "this is one part of a split GGUF; merge the parts "
                "with llama-gguf-split --merge and load the merged file")
    kind = _field(reader, "general.type")
    if kind not in (None, "model"):
        _refuse(file, "general.type", kind, "only model files are supported")


def _uniform(reader, arch: str, key: str, default: Any = None) -> Any:
    """An `{arch}.` key that may hold a per-layer list: its one value. Raises
    UnsupportedModelError when the layers differ (the layer math has one shape)."""
    value = _field(reader, f"{arch}.{key}", default)
    if not isinstance(value, list):
        return value
    if len(set(value)) > 1:
        _refuse(_file_of(reader), f"{arch}.{key}", value,
                "per-layer values differ; layers of different shapes are not supported")
    return value[0] if value else default


def _required(reader, arch: str, key: str) -> Any:
    """`_uniform` of a key the layer math cannot do without; CorruptModelError when absent."""
    value = _uniform(reader, arch, key)
    if value is None:
        raise CorruptModelError(f"{_file_of(reader)}: key {arch}.{key} is missing; "
                                f"a {arch} model needs it")
    return value


def _head_dim(reader, arch: str, hidden: int, n_head: int) -> int:
    """Width of one attention head: key_length, else the Q rows per head, else hidden / heads
    (as llama.cpp). Raises UnsupportedModelError when value_length or rope.dimension_count
    differ from it (partial rotary, value heads of another width)."""
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        q = next((t for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)
        head_dim = int(q.shape[1]) // n_head if q is not None else hidden // n_head
    head_dim = int(head_dim)
    why = {"attention.value_length": "value heads narrower or wider than key heads are not "
                                     "supported",
           "rope.dimension_count": "partial rotary embeddings are not supported"}
    for key, reason in why.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and int(value) != head_dim:
            _refuse(_file_of(reader), f"{arch}.{key}", value, f"head_dim is {head_dim}; {reason}")
    return head_dim


def _rope_scaling(reader, arch: str) -> dict[str, Any] | None:
    """The HF rope_scaling dict of ``{arch}.rope.scaling.*``: None or linear. As in llama.cpp, a
    factor without a type means linear and type none ignores the factor. Raises
    UnsupportedModelError for other types (yarn, longrope…)."""
    rtype = _field(reader, f"{arch}.rope.scaling.type")
    factor = (_field(reader, f"{arch}.rope.scaling.factor")
              or _field(reader, f"{arch}.rope.scale_linear"))
    rtype = rtype if rtype is not None else ("linear" if factor else "none")
    if rtype not in ("none", "linear"):
        _refuse(_file_of(reader), f"{arch}.rope.scaling.type", rtype,
                "this RoPE scaling is not supported yet (localgen implements none, linear and the "
                "rope_freqs tensor that carries llama3 scaling)")
    if rtype == "none" or not factor or float(factor) == 1.0:
        return None
    return {"rope_type": "linear", "factor": float(factor)}


def _rope_freq_factors(reader, file: str, head_dim: int) -> list[float] | None:
    """The rope_freqs tensor's head_dim/2 divisors of the inverse frequencies (llama.cpp's
    ``freq_factors``), or None. Raises UnsupportedModelError for another length,
    CorruptModelError for factors that are not finite and positive."""
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    factors = _dequantize(t).float().flatten()
    if factors.numel() != head_dim // 2:
        raise UnsupportedModelError(f"{file}: tensor {ROPE_FREQS} holds {factors.numel()} factors; "
                                    f"head_dim {head_dim} has {head_dim // 2} rotary frequencies")
    if not (torch.isfinite(factors).all() and (factors > 0).all()):
        raise CorruptModelError(f"{file}: tensor {ROPE_FREQS} holds factors that are not finite "
                                f"and positive: {factors.tolist()}")
    return factors.tolist()


def _check_tensors(reader, file: str, n_layers: int) -> None:
    """Refuse tensors with no place in the layer math and types `_dequantize` cannot read."""
    for t in reader.tensors:
        m = _BLOCK_RE.fullmatch(t.name)
        shape = f"[{', '.join(str(int(d)) for d in reversed(t.shape.tolist()))}]"
        if t.name != ROPE_FREQS and gguf_to_hf_name(t.name) is None:
            raise UnsupportedModelError(
                f"{file}: tensor {t.name} {shape} {t.tensor_type.name}: localgen has no math for "
                f"it, and it may change the model's output, so the file is refused rather than "
                f"the tensor ignored")
        if m and int(m.group(1)) >= n_layers:
            raise UnsupportedModelError(
                f"{file}: tensor {t.name}: layer {m.group(1)} is beyond block_count {n_layers}")
        if not _loadable(t.tensor_type):
            raise UnsupportedModelError(
                f"{file}: tensor {t.name} is stored as {t.tensor_type.name}, a type localgen "
                f"cannot load (it reads F32, F16, BF16 and the types gguf.quants dequantizes)")


@lru_cache(maxsize=None)
def _loadable(qtype) -> bool:
    """Whether `_dequantize` reads `qtype`: the float types, and each type `gguf.quants`
    dequantizes (probed on one zero block)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if qtype in (Q.F32, Q.F16, Q.BF16):
        return True
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# ---- opening files: the reader's failures as one sentence ------------------------------------


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; tensor data is not read).

    Raises OSError as the file opens (FileNotFoundError…), CorruptModelError for a file that is
    not GGUF, a header cut short or tensor data past the end of the file, UnsupportedModelError
    for a GGUF version or tensor type id gguf does not know: each one sentence naming the file
    and what is wrong, in place of the reader's own ValueError/IndexError.
    """
    from localgen.models.gguf_reader import FastGGUFReader

    path = Path(path)
    try:
        return FastGGUFReader(str(path))
    except OSError:
        raise
    except Exception as e:  # the reader indexes raw bytes: bad files fail in many ways
        raise _diagnose(path, e) from e


class _Cut(Exception):
    """The file ended while reading `what`: `n` bytes wanted at `offset`."""

    def __init__(self, what: str, offset: int, n: int):
        super().__init__(what)
        self.what, self.offset, self.n = what, offset, n


class _Walk:
    """A cursor over a GGUF header (ggml docs/gguf.md) that names what it reads."""

    # GGUF metadata value type -> struct format; 8 is a string, 9 an array
    SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
               12: "d"}

    def __init__(self, buf, size: int, order: str):
        self.buf, self.size, self.order, self.pos = buf, size, order, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.size:
            raise _Cut(what, self.pos, n)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def num(self, fmt: str, what: str):
        return struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        return self.take(self.num("Q", what), what).decode("utf-8", "replace")

    def skip_value(self, vtype: int, what: str) -> None:
        if vtype == 8:
            self.string(what)
        elif vtype == 9:
            itype, n = self.num("I", what), self.num("Q", what)
            if itype in self.SCALARS:
                self.take(n * struct.calcsize(self.SCALARS[itype]), what)
            else:
                for _ in range(n):
                    self.skip_value(itype, what)
        elif vtype in self.SCALARS:
            self.take(struct.calcsize(self.SCALARS[vtype]), what)
        else:
            raise ValueError(f"{what} has value type {vtype}, which is no GGUF type")


def _diagnose(path: Path, err: Exception) -> ValueError:
    """What is wrong with a file GGUFReader failed on, as one error naming it."""
    size = path.stat().st_size
    if size == 0:
        return CorruptModelError(f"{path}: not a GGUF file: it is empty")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            return CorruptModelError(f"{path}: not a GGUF file: it starts with {buf[:8]!r}, "
                                     f"not with b'GGUF'")
        try:
            infos, data_start = _read_header(path, buf, size)
        except _Cut as c:
            return CorruptModelError(
                f"{path}: the file ends inside its header: {c.what} needs {c.n:,} bytes at offset "
                f"{c.offset:,}, the file ends {c.offset + c.n - size:,} bytes short")
        except ValueError as e:
            return e if isinstance(e, UnsupportedModelError) else CorruptModelError(f"{path}: {e}")
    problem = _tensor_problem(path, infos, data_start, size)
    return problem or CorruptModelError(
        f"{path}: not a readable GGUF file ({type(err).__name__}: {err})")


def _read_header(path: Path, buf, size: int) -> tuple[list[tuple[str, int, list[int], int]], int]:
    """(name, type id, dims, offset) of each tensor and where tensor data starts. Raises _Cut,
    ValueError for a value type that is none, UnsupportedModelError for GGUF versions but 2, 3."""
    version = struct.unpack("<I", buf[4:8])[0] if size >= 8 else 0
    order = ">" if version and not version & 0xFFFF else "<"  # a big-endian file (as the reader)
    w = _Walk(buf, size, order)
    w.take(4, "the magic")
    version = w.num("I", "the version")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported; localgen "
                                    f"reads versions 2 and 3")
    n_tensors, n_kv = w.num("Q", "the tensor count"), w.num("Q", "the metadata count")
    alignment = 32
    for i in range(n_kv):
        key = w.string(f"metadata entry {i + 1} of {n_kv}")
        what = f"metadata key {key}"
        vtype = w.num("I", what)
        if key == "general.alignment" and vtype == 4:
            alignment = w.num("I", what) or 32
        else:
            w.skip_value(vtype, what)
    infos = []
    for i in range(n_tensors):
        name = w.string(f"tensor info {i + 1} of {n_tensors}")
        what = f"the info of tensor {name}"
        n_dims = w.num("I", what)
        dims = list(struct.unpack(f"{order}{n_dims}Q", w.take(8 * n_dims, what)))
        infos.append((name, w.num("I", what), dims, w.num("Q", what)))
    return infos, -(-w.pos // alignment) * alignment


def _tensor_problem(path: Path, infos, data_start: int, size: int) -> ValueError | None:
    """An unknown type id, rows not whole blocks, or the first tensor whose data the file lacks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    short = []
    for name, type_id, dims, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            return UnsupportedModelError(
                f"{path}: tensor {name} has type id {type_id}, which the installed gguf package "
                f"does not know (a newer GGML type, or a corrupt file)")
        if dims and dims[0] % block:
            return CorruptModelError(f"{path}: tensor {name}: rows of {dims[0]} values are not "
                                     f"whole {qtype.name} blocks of {block}")
        start, nbytes = data_start + offset, math.prod(dims) // block * type_size
        if start + nbytes > size:
            short.append((start, name, nbytes))
    if not short:
        return None
    start, name, nbytes = min(short)
    more = f" ({len(short) - 1} more tensors lie past the end)" if len(short) > 1 else ""
    return CorruptModelError(
        f"{path}: tensor {name} needs {nbytes:,} bytes at offset {start:,}, the file ends "
        f"{start + nbytes - size:,} bytes short{more}; the file is truncated (an interrupted "
        f"download or copy?)")


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

    Raises FileNotFoundError, CorruptModelError (not GGUF, cut short) and UnsupportedModelError
    (archs other than llama/qwen2; keys, tensors and types localgen does not implement), each
    naming the file and what is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    store = GGUFStore(path)
    d = dict(store.hf_config)
    d["torch_dtype"] = str(store.dtype).removeprefix("torch.")
    return ModelConfig.from_hf_dict(d), store


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF: converted by transformers on the first load (slow for a
    49k vocab), then read from localgen's cache (`localgen.models.tokenizer_cache`)."""
    from localgen.models.tokenizer_cache import cached_gguf_tokenizer

    return cached_gguf_tokenizer(path, lambda: convert_gguf_tokenizer(path))


def convert_gguf_tokenizer(path: str | Path):
    """The tokenizer stored in the GGUF, via transformers' GGUF loader (no cache).

    Sets `chat_template` from the GGUF metadata when transformers did not.
    """
    from transformers import AutoTokenizer

    from localgen.models.gguf_reader import stock_reader_replaced

    path = Path(path)
    with stock_reader_replaced():  # transformers parses the whole file's metadata again
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tok, "chat_template", None):
        template = _field(open_gguf(path), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
