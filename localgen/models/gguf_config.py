"""GGUF metadata -> a Hugging Face ``config.json``-style dict, refusing what localgen cannot run.

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
  rope.scale_linear); expert_count, expert_used_count and expert_feed_forward_length of a file
  with experts (llama arch: Mixtral; qwen3moe: Qwen3-MoE; other archs' experts are refused).
- ``{arch}.`` keys that do not enter the math (`_INFO_KEYS`): rope.scaling.original_context_length
  and rope.scaling.finetuned (inputs of YaRN, which is refused), tensor_data_layout.
- ``{arch}.`` keys at the value that turns their feature off (`_NEUTRAL`): expert_count 0,
  attention.sliding_window 0, attention.causal true, soft-capping 0, logit_scale 1…
- tensors token_embd, output_norm, output, blk.N.{attn_norm, ffn_norm}.weight and
  blk.N.{attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down}.{weight, bias} for
  N < block_count, and rope_freqs.weight: llama.cpp's form of llama3 RoPE scaling, head_dim/2
  divisors of the inverse frequencies, applied as `ModelConfig.rope_freq_factors`; in a file
  with experts, blk.N.ffn_gate_inp (the router) and blk.N.ffn_{gate,up,down}_exps (`gguf_experts`).
- for the dense families' archs (qwen3, phi3, granite, olmo2, smollm3, gemma2, gemma3), their own
  keys and tensor names (`gguf_dense.ARCH_KEYS`, `ARCH_LAYER_NAMES`: q/k norms, post-norms, Phi-3's
  fused attn_qkv and ffn_up, its rope_factors_long/short, a rope.dimension_count below head_dim),
  read by `gguf_dense.dense_hf_config` with llama.cpp's per-arch defaults.

The architectures localgen reads are the one table `GGUF_ARCHITECTURES`.
Format: ggml's docs/gguf.md; key and tensor names: gguf-py's constants.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from localgen.models.config import CorruptModelError, UnsupportedModelError, unsupported_architecture
from localgen.models.gguf_experts import is_moe_tensor
from localgen.models.moe_options import MOE_ARCHITECTURES
from localgen.models.gguf_dense import ARCH_KEYS, PARTIAL_ROTARY_ARCHS, ROPE_FACTORS, dense_hf_config
from localgen.models.gguf_names import LAYER_TENSOR_RE, ROPE_FREQS, gguf_to_hf_name
from localgen.models.gguf_reader import gguf_field
from localgen.models.gguf_tensors import dequantize_tensor, loadable


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF ``general.architecture`` maps onto localgen's model code.

    `hf_architecture` and `model_type` are the HF config's ``architectures[0]`` and
    ``model_type``; `qk_permuted` says llama.cpp's converter permuted the Q/K rows of this arch
    (rotate-half -> interleaved RoPE pairs), which loading undoes.
    """

    hf_architecture: str
    model_type: str
    qk_permuted: bool


# GGUF `general.architecture` -> how localgen runs it. Mistral GGUFs use the llama arch.
GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", qk_permuted=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", qk_permuted=False),
    # the dense families (gguf_dense): the llama-derived converters permute Q/K
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", qk_permuted=False),
    "phi3": GGUFArch("Phi3ForCausalLM", "phi3", qk_permuted=False),
    "granite": GGUFArch("GraniteForCausalLM", "granite", qk_permuted=True),
    "olmo2": GGUFArch("Olmo2ForCausalLM", "olmo2", qk_permuted=False),
    "smollm3": GGUFArch("SmolLM3ForCausalLM", "smollm3", qk_permuted=True),
    "gemma2": GGUFArch("Gemma2ForCausalLM", "gemma2", qk_permuted=False),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", qk_permuted=False),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", qk_permuted=False),
}
# a llama-arch file with experts is Mixtral (llama.cpp's converter writes Mixtral as llama)
_LLAMA_MOE = ("MixtralForCausalLM", "mixtral")

# `{arch}.` keys that gguf_hf_config reads.
_READ_KEYS = frozenset({
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "expert_count", "expert_used_count", "expert_feed_forward_length",
})
# `{arch}.` keys that enter no math localgen runs (YaRN's inputs: YaRN itself is refused).
_INFO_KEYS = frozenset({
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "tensor_data_layout",
})
_MOE = ("localgen runs the experts of Mixtral (llama arch) and Qwen3-MoE (qwen3moe) files only")
# `{arch}.` key -> (the value that turns its feature off, why another value is refused). Checked
# in this order, so a Mixtral file is refused for its expert count.
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "expert_shared_count": (0, "shared experts are not supported"),
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


def _vocab(reader) -> list[str]:
    return gguf_field(reader, "tokenizer.ggml.tokens", []) or []


def gguf_eos_token_ids(reader) -> tuple[int, ...]:
    """EOS ids: ``tokenizer.ggml.eos_token_id`` (and eot/eom ids) plus chat-turn end tokens
    (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``) that the chat template uses and the vocab holds."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = gguf_field(reader, key)
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    template = gguf_field(reader, "tokenizer.chat_template") or ""
    wanted = [t for t in CHAT_END_TOKENS if t in template]
    if wanted:
        index = _token_indices(reader, wanted)
        ids += [index[t] for t in wanted if t in index and index[t] not in ids]
    return tuple(ids)


def _token_indices(reader, tokens: list[str]) -> dict[str, int]:
    """Each of ``tokens``' id in the vocabulary (the last, where a token repeats), without
    making the whole vocabulary's strings where the reader can search it in place."""
    search = getattr(reader, "string_indices", None)
    found = search("tokenizer.ggml.tokens", tokens) if search is not None else None
    if found is not None:
        return found
    wanted = set(tokens)
    return {tok: i for i, tok in enumerate(_vocab(reader)) if tok in wanted}


def gguf_hf_config(reader) -> dict[str, Any]:
    """GGUF metadata -> a Hugging Face ``config.json``-style dict, plus localgen's
    ``rope_freq_factors`` (the rope_freqs tensor, head_dim/2 floats) and ``gguf_file_type``.

    Raises UnsupportedModelError for archs other than llama/qwen2 and for any key or tensor that
    changes the math and that localgen does not implement (module docstring), naming the file,
    the key or tensor and its value.
    """
    arch, file = _arch(reader), _file_of(reader)
    _check_keys(reader, arch, file)
    g = lambda key, default=None: gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    n_head = int(_required(reader, arch, "attention.head_count"))
    hidden = int(_required(reader, arch, "embedding_length"))
    n_layers = int(_required(reader, arch, "block_count"))
    _check_tensors(reader, file, n_layers, arch, moe=bool(g("expert_count", 0)))
    head_dim = _head_dim(reader, arch, hidden, n_head)
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = g("vocab_size") or len(_vocab(reader)) or _embedding_rows(reader)
    hf_arch, model_type = _hf_architecture(reader, arch)
    d: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
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
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(reader)),
        "gguf_file_type": _file_type_name(reader),
    }
    d.update(_moe_config(reader, arch, hf_arch))
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        d["rope_scaling"] = scaling
    d.update(dense_hf_config(reader, arch, d))
    factors = _rope_freq_factors(reader, file, head_dim)
    if factors is not None:
        d["rope_freq_factors"] = factors
    return d


def _moe_config(reader, arch: str, hf_arch: str) -> dict[str, Any]:
    """The HF config keys of a file's experts (none for a dense file). llama.cpp's MoE layer of
    both archs divides the top-k routing weights by their sum (``build_moe_ffn``'s ``norm_w``),
    so a Qwen3-MoE file means ``norm_topk_prob``. Raises UnsupportedModelError for experts in
    another arch."""
    n = gguf_field(reader, f"{arch}.expert_count", 0)
    if not n:
        return {}
    if hf_arch not in MOE_ARCHITECTURES:
        _refuse(_file_of(reader), f"{arch}.expert_count", n, _MOE)
    d = {"num_local_experts": int(n),
         "num_experts_per_tok": int(_required(reader, arch, "expert_used_count"))}
    if hf_arch == "Qwen3MoeForCausalLM":
        d.update(moe_intermediate_size=int(_required(reader, arch, "expert_feed_forward_length")),
                 norm_topk_prob=True)
    return d


def _arch(reader) -> str:
    arch = str(gguf_field(reader, "general.architecture"))
    if arch == "gpt-oss":  # the HF directory runs; llama.cpp's file is another layout
        raise UnsupportedModelError(
            f"{_file_of(reader)}: GGUF architecture 'gpt-oss' is not supported (its MXFP4 experts, "
            f"sinks and biases have no GGUF mapping in localgen); run gpt-oss from its Hugging "
            f"Face directory")
    if arch not in GGUF_ARCHITECTURES:
        raise unsupported_architecture(f"GGUF architecture {arch!r}", _file_of(reader),
                                       f" (GGUF archs {', '.join(sorted(GGUF_ARCHITECTURES))})")
    return arch


def _hf_architecture(reader, arch: str) -> tuple[str, str]:
    """(HF architecture class, model_type) of a file of GGUF arch `arch`."""
    name = str(gguf_field(reader, "general.name", "") or "")
    if arch == "llama" and gguf_field(reader, "llama.expert_count", 0):
        return _LLAMA_MOE
    if arch == "llama" and "mistral" in name.lower():
        return "MistralForCausalLM", "mistral"  # same math; keeps the name users expect
    entry = GGUF_ARCHITECTURES[arch]
    return entry.hf_architecture, entry.model_type


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
        value = gguf_field(reader, prefix + name)
        if value is not None and value != neutral and name not in ARCH_KEYS.get(arch, ()):
            _refuse(file, prefix + name, value, why)
    for key in reader.fields:
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name in _REFUSED:
            _refuse(file, key, gguf_field(reader, key), _REFUSED[name])
        if name is not None and name not in _READ_KEYS | _INFO_KEYS | _NEUTRAL.keys() \
                and name not in ARCH_KEYS.get(arch, ()):
            _refuse(file, key, gguf_field(reader, key), _UNKNOWN)
        if key.startswith("adapter."):
            _refuse(file, key, gguf_field(reader, key), "a LoRA adapter file, not a model")
    splits = gguf_field(reader, "split.count")
    if splits is not None and int(splits) > 1:
        _refuse(file, "split.count", splits, "this is one part of a split GGUF; merge the parts "
                "with llama-gguf-split --merge and load the merged file")
    kind = gguf_field(reader, "general.type")
    if kind not in (None, "model"):
        _refuse(file, "general.type", kind, "only model files are supported")


def _uniform(reader, arch: str, key: str, default: Any = None) -> Any:
    """An `{arch}.` key that may hold a per-layer list: its one value. Raises
    UnsupportedModelError when the layers differ (the layer math has one shape)."""
    value = gguf_field(reader, f"{arch}.{key}", default)
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
    head_dim = gguf_field(reader, f"{arch}.attention.key_length")
    if head_dim is None:
        q = next((t for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)
        head_dim = int(q.shape[1]) // n_head if q is not None else hidden // n_head
    head_dim = int(head_dim)
    why = {"attention.value_length": "value heads narrower or wider than key heads are not "
                                     "supported",
           "rope.dimension_count": "partial rotary embeddings are not supported"}
    for key, reason in why.items():
        value = gguf_field(reader, f"{arch}.{key}")
        partial = key == "rope.dimension_count" and arch in PARTIAL_ROTARY_ARCHS
        if value is not None and int(value) != head_dim and not partial:
            _refuse(_file_of(reader), f"{arch}.{key}", value, f"head_dim is {head_dim}; {reason}")
    return head_dim


def _rope_scaling(reader, arch: str) -> dict[str, Any] | None:
    """The HF rope_scaling dict of ``{arch}.rope.scaling.*``: None or linear. As in llama.cpp, a
    factor without a type means linear and type none ignores the factor. Raises
    UnsupportedModelError for other types (yarn, longrope…)."""
    rtype = gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = (gguf_field(reader, f"{arch}.rope.scaling.factor")
              or gguf_field(reader, f"{arch}.rope.scale_linear"))
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
    factors = dequantize_tensor(t).float().flatten()
    if factors.numel() != head_dim // 2:
        raise UnsupportedModelError(f"{file}: tensor {ROPE_FREQS} holds {factors.numel()} factors; "
                                    f"head_dim {head_dim} has {head_dim // 2} rotary frequencies")
    if not (torch.isfinite(factors).all() and (factors > 0).all()):
        raise CorruptModelError(f"{file}: tensor {ROPE_FREQS} holds factors that are not finite "
                                f"and positive: {factors.tolist()}")
    return factors.tolist()


def _check_tensors(reader, file: str, n_layers: int, arch: str, moe: bool = False) -> None:
    """Refuse tensors with no place in the layer math (router and expert tensors have one in a
    file with experts) and types `dequantize_tensor` cannot read."""
    for t in reader.tensors:
        m = LAYER_TENSOR_RE.fullmatch(t.name)
        shape = f"[{', '.join(str(int(d)) for d in reversed(t.shape.tolist()))}]"
        if (t.name not in (ROPE_FREQS, *ROPE_FACTORS) and gguf_to_hf_name(t.name, arch) is None
                and not (moe and is_moe_tensor(t.name))):
            raise UnsupportedModelError(
                f"{file}: tensor {t.name} {shape} {t.tensor_type.name}: localgen has no math for "
                f"it, and it may change the model's output, so the file is refused rather than "
                f"the tensor ignored")
        if m and int(m.group(1)) >= n_layers:
            raise UnsupportedModelError(
                f"{file}: tensor {t.name}: layer {m.group(1)} is beyond block_count {n_layers}")
        if not loadable(t.tensor_type):
            raise UnsupportedModelError(
                f"{file}: tensor {t.name} is stored as {t.tensor_type.name}, a type localgen "
                f"cannot load (it reads F32, F16, BF16 and the types gguf.quants dequantizes)")


def _embedding_rows(reader) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    return 0


def _file_type_name(reader) -> str | None:
    from gguf import LlamaFileType

    ft = gguf_field(reader, "general.file_type")
    try:
        return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else None
    except ValueError:
        return str(ft)
