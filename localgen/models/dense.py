"""The Llama layer with the departures of the dense families (``ModelConfig.dense``): Qwen3,
Phi-3/Phi-4, Granite 3, OLMo 2, SmolLM3, Gemma 2/3, Mistral with a sliding window, and the
attention of gpt-oss (learned sink logits per head; its experts are ``moe``'s).

A family module like ``llama``: the model picks it for a Llama-family config whose
``DenseOptions`` are not plain (``model.family_of``). Its ``rope`` argument is the layer's
``rope.LayerRope`` (the layer index and its own cos/sin, or none), since layers differ in window
and RoPE base. The math follows each family's ``transformers`` modeling code, the reference the
tests compare against; the torch code runs on every device (on CUDA the attention call reaches the
Triton kernels through the paged-attention call site; the fused elementwise kernels serve only
the plain Llama layer).

Layer, in order: [input norm] -> q/k/v (fused ``qkv`` or apart) -> [q/k RMSNorm] -> RoPE on the
first ``rotary_dim`` dims (unless the layer has none) -> attention (scale, window, softcap) ->
o -> [post-attention norm] -> residual (x ``residual_multiplier``) -> [pre-MLP norm] -> gated MLP
-> [post-MLP norm] -> residual. Norms in brackets exist per ``DenseOptions.layout``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from localgen.attention.spec import AttentionSpec
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models import llama
from localgen.models.config import ModelConfig
from localgen.models.fuse import project_qkv
from localgen.models.moe_options import moe_layer_names
from localgen.models.rope import LayerRope, apply_rope, rotary_dim
from localgen.quant import embedding, linear

_ATTN = "self_attn."
# short name -> HF parameter suffix, per layout (DenseOptions.layout)
_NORMS = {
    "llama": {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"},
    "phi3": {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"},
    "olmo2": {"attn_out_norm": "post_attention_layernorm",
              "mlp_out_norm": "post_feedforward_layernorm"},
    "gemma": {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
              "post_norm": "pre_feedforward_layernorm",
              "mlp_out_norm": "post_feedforward_layernorm"},
}
_PHI3_MATS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj",
              "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}
OPTIONAL = llama.OPTIONAL
PACKABLE = llama.PACKABLE | {"qkv", "gate_up"}
fuse_weights = llama.fuse_weights
global_weight_names = llama.global_weight_names


def fused_enabled(h: torch.Tensor) -> bool:
    """The fused Triton elementwise kernels serve only the plain Llama layer: never here."""
    return False


def layer_weight_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Short name -> Hugging Face parameter name for layer ``i`` (biases optional; every norm
    and q/k gain of the layout required)."""
    layout = cfg.dense.layout
    if layout == "phi3":
        names = {k: f"{v}.weight" for k, v in _PHI3_MATS.items()}
    else:
        names = {k: v for k, v in llama.LAYER_WEIGHTS.items() if "norm" not in k}
    names.update({k: f"{v}.weight" for k, v in _NORMS[layout].items()})
    if cfg.dense.qk_norm:
        names.update(q_norm=f"{_ATTN}q_norm.weight", k_norm=f"{_ATTN}k_norm.weight")
    if cfg.dense.attention_sinks:
        names["sinks"] = f"{_ATTN}sinks"
    return moe_layer_names(cfg.moe, i, {k: f"model.layers.{i}.{v}" for k, v in names.items()})


def norm(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim with gain ``norm_offset + weight``: Gemma's ``(1 + w)`` form
    in float32 as its HF RMSNorm computes it, else the Llama form (``llama.rms_norm``)."""
    off = cfg.dense.norm_offset
    if not off:
        return llama.rms_norm(x, weight, cfg.norm_eps)
    y = F.rms_norm(x.float(), x.shape[-1:], eps=cfg.norm_eps)
    return (y * (off + weight.float())).to(x.dtype)


def embed(cfg: ModelConfig, w: dict, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """token_ids ``[num_tokens]`` -> hidden ``[num_tokens, hidden_size]`` in the weights' dtype,
    times ``embedding_multiplier`` (rounded to that dtype first where the family does so)."""
    e = embedding(token_ids, w["embed"]).to(w["norm"].dtype)
    m = cfg.dense.embedding_multiplier
    if m == 1.0:
        return e
    return e * (torch.tensor(m, dtype=e.dtype) if cfg.dense.embedding_multiplier_in_dtype else m)


def _qk_normed(cfg: ModelConfig, w: dict, q: torch.Tensor, k: torch.Tensor):
    """q and k after their RMSNorm: per head over head_dim ("head") or over the whole projection
    before it is cut into heads ("proj", OLMo 2)."""
    mode = cfg.dense.qk_norm
    if not mode:
        return q, k
    if mode == "head":
        return norm(cfg, q, w["q_norm"]), norm(cfg, k, w["k_norm"])
    n = q.shape[0]
    return (norm(cfg, q.reshape(n, -1), w["q_norm"]).view(q.shape),
            norm(cfg, k.reshape(n, -1), w["k_norm"]).view(k.shape))


def _rotated(cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[n, heads, head_dim]`` with RoPE on its first ``rotary_dim`` dims (partial rotary:
    the rest pass through)."""
    rd = rotary_dim(cfg)
    if rd == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


def attention_scale(cfg: ModelConfig) -> float:
    """The softmax scale of ``q . k``: the family's, else ``head_dim ** -0.5``."""
    s = cfg.dense.attention_scale
    return cfg.head_dim ** -0.5 if s is None else s


def layer_spec(cfg: ModelConfig, i: int) -> AttentionSpec:
    """Layer ``i``'s attention: the family's scale, the layer's window, the score softcap."""
    return _spec(attention_scale(cfg), cfg.dense.window(i), cfg.dense.attn_logit_softcap)


@functools.lru_cache(maxsize=256)
def _spec(scale: float, window: int | None, cap: float | None) -> AttentionSpec:
    return AttentionSpec(scale, window, cap)  # one object per distinct spec, shared by layers


def _residual(cfg: ModelConfig, w: dict, h: torch.Tensor, out: torch.Tensor, post: str) -> torch.Tensor:
    """``h + norm(out) * residual_multiplier`` (the norm where the layout has ``post``)."""
    if post in w:
        out = norm(cfg, out, w[post])
    m = cfg.dense.residual_multiplier
    return h + (out if m == 1.0 else out * m)


def layer(cfg: ModelConfig, w: dict, h: torch.Tensor, rope: LayerRope, kv: LayerKV,
          meta: AttentionMetadata) -> torch.Tensor:
    """One decoder layer (module docstring) on hidden ``[n, hidden_size]``; ``rope`` is this
    layer's ``LayerRope``."""
    n = h.shape[0]
    x = norm(cfg, h, w["input_norm"]) if "input_norm" in w else h
    q, k, v = project_qkv(cfg, w, x)
    q, k = _qk_normed(cfg, w, q, k)
    if rope.cos_sin is not None:
        q, k = _rotated(cfg, q, *rope.cos_sin), _rotated(cfg, k, *rope.cos_sin)
    spec = layer_spec(cfg, rope.index)
    if "sinks" in w:  # the layer's own learned sink logits
        spec = dataclasses.replace(spec, sinks=w["sinks"])
    attn = kv.attend(q, k, v, meta, spec)
    del q, k, v
    h = _residual(cfg, w, h, linear(attn.reshape(n, cfg.q_size), w["o"], w.get("o_bias")),
                  "attn_out_norm")
    del attn
    x = norm(cfg, h, w["post_norm"]) if "post_norm" in w else h
    return _residual(cfg, w, h, llama.mlp(cfg, w, x), "mlp_out_norm")


def logits(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """hidden ``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]``: final norm, output
    matrix (tied: the embedding), divided by ``logits_scaling``, then soft-capped."""
    out = linear(norm(cfg, h, w["norm"]), w.get("lm_head", w["embed"]))
    if cfg.dense.logits_scaling != 1.0:
        out = out / cfg.dense.logits_scaling
    cap = cfg.dense.final_logit_softcap
    if cap is not None:
        out = torch.tanh(out / cap) * cap
    return out.float()
