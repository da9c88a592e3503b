"""Tiny random-weight Hugging Face models, hub caches and GGUF files for tests.

Everything here is small (hidden 64, 2 layers, vocab ~300) so a test builds a model in well under a
second on one CPU core. Weights are re-initialised with larger values than transformers' defaults
so greedy decoding produces varied tokens rather than one repeated id.
"""

from __future__ import annotations

import json
import math
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

# Special tokens first, so their ids are small and stable across variants.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID, IM_START_ID, IM_END_ID = range(6)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests of local language models",
    "user assistant system: what is the capital of France? Paris is the capital.",
    "one two three four five six seven eight nine ten 0123456789",
    "a local runner places weights on the gpu, cpu or disk and generates text quickly",
]

# Init scales chosen by scanning greedy outputs: every variant yields several distinct tokens.
EMBED_STD = 0.05  # small next to layer outputs, so a tied lm_head does not echo the input token
LINEAR_STD = 0.2
BIAS_STD = 0.02  # OPT's relu MLP biases otherwise push every position to the same token

_LLAMA_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
_OPT_BASE: dict[str, Any] = dict(
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    word_embed_proj_dim=64,
    do_layer_norm_before=True,
)

# Config kwargs per variant; "model_type" picks the transformers config class.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama2": dict(model_type="llama", **_LLAMA_BASE, num_key_value_heads=4),
    "llama3": dict(
        model_type="llama",
        **{**_LLAMA_BASE, "max_position_embeddings": 512},
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(model_type="mistral", **_LLAMA_BASE, num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(model_type="qwen2", **_LLAMA_BASE, num_key_value_heads=2),
    "smollm": dict(
        model_type="llama", **{**_LLAMA_BASE, "tie_word_embeddings": True}, num_key_value_heads=2
    ),
    "mqa": dict(model_type="llama", **_LLAMA_BASE, num_key_value_heads=1),
    "head_dim_odd": dict(model_type="llama", **_LLAMA_BASE, num_key_value_heads=2, head_dim=24),
    "opt": dict(model_type="opt", **_OPT_BASE),
    "opt_proj": dict(
        model_type="opt", **{**_OPT_BASE, "word_embed_proj_dim": 32, "do_layer_norm_before": False}
    ),
    "opt_postln": dict(model_type="opt", **{**_OPT_BASE, "do_layer_norm_before": False}),
}


@lru_cache(maxsize=1)
def _tokenizer_object():
    """A byte-level BPE `tokenizers.Tokenizer` trained on a tiny corpus (deterministic, ~330 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def make_tokenizer():
    """A `PreTrainedTokenizerFast` with bos/eos/pad/unk and a ChatML-like chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer_object(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def vocab_size() -> int:
    return _tokenizer_object().get_vocab_size()


def make_config(variant: str):
    """The transformers config object of `variant` (fp32, vocab = tokenizer size)."""
    from transformers import AutoConfig

    kw = dict(VARIANTS[variant])
    model_type = kw.pop("model_type")
    ids = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size(), **ids, **kw)
    cfg.torch_dtype = torch.float32
    if model_type == "qwen2":
        cfg.use_sliding_window = False
    return cfg


def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' tiny init with values that make greedy decoding non-degenerate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)  # RMSNorm / LayerNorm gains near 1
            elif "embed" in name:
                p.copy_(EMBED_STD * noise)
            elif name.endswith("bias"):
                p.copy_(BIAS_STD * noise)  # nonzero, so qwen2 q/k/v biases are really exercised
            else:
                p.copy_(LINEAR_STD * noise)


def make_model(variant: str, *, seed: int = 0) -> torch.nn.Module:
    """A random-weight `*ForCausalLM` of `variant` in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(variant), dtype=torch.float32)
    _reinit_(model, seed)
    model.tie_weights()  # re-tie after re-init so lm_head is the embedding when tied
    return model.eval()


def make_hf_model(
    tmp_dir: Path, variant: str, *, seed: int = 0, max_shard_size: int | str | None = None
) -> Path:
    """Save a tiny `variant` model plus tokenizer into ``tmp_dir/variant`` (safetensors) and return it.

    ``max_shard_size`` (bytes or "10KB") forces a sharded checkpoint with an index json.
    """
    out = Path(tmp_dir) / variant
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(variant, seed=seed)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kw)
    make_tokenizer().save_pretrained(out)
    return out


def make_hub_cache(
    cache_dir: Path,
    repo_id: str,
    model_dir: Path,
    revision_sha: str = "0123456789abcdef0123456789abcdef01234567",
    *,
    ref: str = "main",
) -> Path:
    """Lay out `model_dir` as a huggingface_hub cache entry; return the snapshot directory.

    Layout: ``models--org--name/{blobs/<hash>, snapshots/<sha>/<file> -> ../../blobs/<hash>,
    refs/<ref>}``, so ``snapshot_download(repo_id, local_files_only=True, cache_dir=...)`` and
    ``revision=<sha>`` both resolve without network.
    """
    import hashlib

    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / revision_sha
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(model_dir).rglob("*")):
        if not f.is_file():
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = blobs / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        rel = Path(*[".."] * (len(link.relative_to(repo).parts) - 1)) / "blobs" / digest
        try:
            link.symlink_to(rel)
        except OSError:  # filesystems without symlinks: huggingface_hub accepts copies too
            shutil.copyfile(blob, link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(revision_sha)
    return snap


# ---------------------------------------------------------------------------------------------
# GGUF writing (what llama.cpp's convert_hf_to_gguf.py does, reduced to llama/qwen2)

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf_name(name: str) -> str | None:
    """HF parameter name -> llama.cpp tensor name (None for names GGUF does not store)."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    layer, rest = parts[2], ".".join(parts[3:])
    for hf, gg in _GGUF_LAYER_NAMES.items():
        if rest.startswith(hf + "."):
            return f"blk.{layer}.{gg}.{rest[len(hf) + 1:]}"
    return None


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF rotate-half -> interleaved RoPE pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _load_hf(hf_model_dir_or_state) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if isinstance(hf_model_dir_or_state, (str, Path)):
        from safetensors.torch import load_file

        d = Path(hf_model_dir_or_state)
        state: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            state.update(load_file(f))
        return state, json.loads((d / "config.json").read_text())
    state, cfg = hf_model_dir_or_state
    return dict(state), dict(cfg)


def write_gguf(
    path: Path,
    hf_model_dir_or_state,
    qtype: str = "F32",
    *,
    name: str = "tiny",
    with_tokenizer: bool = True,
    metadata: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a llama/qwen2 GGUF of a tiny HF model; return `path`.

    `hf_model_dir_or_state`: a directory made by `make_hf_model`, or ``(state_dict, config_dict)``.
    `qtype`: F32, F16, BF16, Q8_0, Q4_0 or Q4_1; 2-D weights get `qtype`, 1-D norms and biases stay
    F32 (as llama.cpp does). Q/K rows are permuted for the llama arch only (llama.cpp does not
    permute qwen2). With `with_tokenizer`, the tiny BPE vocab, merges and chat template are stored.
    RoPE scaling as llama.cpp's converter stores it: linear as ``rope.scaling.type``/``factor``,
    llama3 (llama arch) only as the ``rope_freqs.weight`` tensor (`llama3_rope_factors`).
    `metadata` replaces or adds keys (``{arch}`` in a key becomes the arch; None drops the key;
    bool/int/float/str/list values), `tensors` adds F32 tensors by GGUF name: files localgen must
    refuse.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    state, cfg = _load_hf(hf_model_dir_or_state)
    model_type = cfg.get("model_type", "llama")
    arch = "qwen2" if model_type == "qwen2" else "llama"  # mistral GGUFs use the llama arch
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    qt = getattr(Q, qtype)
    w.add_file_type(
        {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}[qtype]
    )
    if with_tokenizer:
        _add_tokenizer(w, cfg)
    _add_rope_scaling(w, cfg, arch)
    for key, value in (metadata or {}).items():
        _set_key(w, key.format(arch=arch), value)
    for gg, data in (tensors or {}).items():
        w.add_tensor(gg, np.ascontiguousarray(data, dtype=np.float32))

    for hf_name, t in state.items():
        gg = hf_to_gguf_name(hf_name)
        if gg is None:
            continue
        data = t.detach().to(torch.float32).numpy()
        if arch == "llama" and ".attn_q." in gg:
            data = llama_cpp_permute(data, n_head, n_head)
        elif arch == "llama" and ".attn_k." in gg:
            data = llama_cpp_permute(data, n_head, n_kv)
        data = np.ascontiguousarray(data)
        if data.ndim == 1 or qt == Q.F32:
            w.add_tensor(gg, data.astype(np.float32))
        elif qt == Q.F16:
            w.add_tensor(gg, data.astype(np.float16))
        else:
            packed = gguf.quants.quantize(data, qt)
            w.add_tensor(gg, packed, raw_shape=packed.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's RoPE dict as the converter sees it (rope_parameters, else rope_scaling, with
    the top-level rope_theta filled in)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_theta" not in rope and cfg.get("rope_theta") is not None:
        rope["rope_theta"] = cfg["rope_theta"]
    rope.setdefault("rope_type", rope.get("type"))
    return rope


def llama3_rope_factors(cfg: Mapping[str, Any]) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor llama.cpp's convert_hf_to_gguf.py writes for a Llama whose
    rope_type is "llama3": float32 ``[head_dim/2]`` divisors of the inverse frequencies — 1 for
    wavelengths under original/high_freq_factor, `factor` over original/low_freq_factor, the
    smooth llama3 blend between. As in the converter, the original context length is the config's
    top-level ``original_max_position_embeddings`` (default 8192), not rope_scaling's, and the
    missing factors default to 8, 1 and 4; the arithmetic is float32 as there."""
    rope = _rope_parameters(cfg)
    base = float(rope.get("rope_theta", 10000.0))
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(cfg.get("original_max_position_embeddings", 8192))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen > original / low, torch.full_like(inv, factor), blended)
    out = torch.where(wavelen < original / high, torch.ones_like(inv), out)
    return out.numpy().astype(np.float32)


def _add_rope_scaling(w, cfg: Mapping[str, Any], arch: str) -> None:
    import gguf

    rope = _rope_parameters(cfg)
    rtype = str(rope.get("rope_type") or "").lower()
    if rtype == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rtype == "llama3" and arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))


def _set_key(w, key: str, value: Any) -> None:
    """Replace (value None: drop) one metadata key of a GGUFWriter that has not written yet."""
    w.kv_data[0].pop(key, None)
    if value is None:
        return
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        (w.add_uint32 if value >= 0 else w.add_int32)(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def _add_tokenizer(w, cfg: Mapping[str, Any]) -> None:
    """Store the tiny byte-level BPE as a llama.cpp "gpt2" tokenizer (tokens, types, merges)."""
    tok = _tokenizer_object()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    n = int(cfg["vocab_size"])
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n)]
    special = set(SPECIAL_TOKENS)
    types = [3 if t in special else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_chat_template(CHAT_TEMPLATE)
