"""OPT layer math (Zhang et al. 2022), as Hugging Face OPTForCausalLM computes it.

Covers pre-LN (``do_layer_norm_before=True``, OPT-125m/1.3b/…/175b) and post-LN (OPT-350m), and
``word_embed_proj_dim != hidden_size`` (project_in / project_out). Learned positions carry OPT's
offset of 2. Hidden states are packed ``[num_tokens, hidden_size]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localgen.attention.spec import default_spec
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models.config import ModelConfig
from localgen.models.fuse import fuse_qkv, project_qkv
from localgen.quant import linear

POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding reserves the first two rows

_LAYER = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.out_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.out_proj.bias",
    "attn_norm": "self_attn_layer_norm.weight", "attn_norm_bias": "self_attn_layer_norm.bias",
    "fc1": "fc1.weight", "fc1_bias": "fc1.bias", "fc2": "fc2.weight", "fc2_bias": "fc2.bias",
    "ffn_norm": "final_layer_norm.weight", "ffn_norm_bias": "final_layer_norm.bias",
}
OPTIONAL = {"q_bias", "k_bias", "v_bias", "o_bias", "fc1_bias", "fc2_bias",
            "attn_norm_bias", "ffn_norm_bias"}


def layer_weight_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    return {k: f"model.decoder.layers.{i}.{v}" for k, v in _LAYER.items()}


def global_weight_names(cfg: ModelConfig) -> dict[str, str]:
    names = {"embed": "model.decoder.embed_tokens.weight",
             "pos_embed": "model.decoder.embed_positions.weight",
             "final_norm": "model.decoder.final_layer_norm.weight",
             "final_norm_bias": "model.decoder.final_layer_norm.bias",
             "project_in": "model.decoder.project_in.weight",
             "project_out": "model.decoder.project_out.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    return names


GLOBAL_OPTIONAL = {"final_norm", "final_norm_bias", "project_in", "project_out"}


def embed(cfg: ModelConfig, w: dict, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """token_ids, positions ``[num_tokens]`` -> hidden ``[num_tokens, hidden_size]``."""
    x = F.embedding(token_ids, w["embed"])
    if "project_in" in w:
        x = F.linear(x, w["project_in"])
    return x + F.embedding(positions + POSITION_OFFSET, w["pos_embed"])


def _ln(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, cfg.norm_eps)


def fuse_weights(cfg: ModelConfig, w: dict) -> dict:
    """q/k/v (and their biases) as one matrix: two GEMM launches fewer a layer, which an
    offloaded decode step feels, since its many small layer calls are bound by the host's
    launches. ``layer`` takes either form."""
    w = dict(w)
    fuse_qkv(w)
    return w


def layer(cfg: ModelConfig, w: dict, h: torch.Tensor, rope, kv: LayerKV,
          meta: AttentionMetadata) -> torch.Tensor:
    """One decoder layer; norms before (pre-LN) or after (post-LN) each residual block."""
    n, pre = h.shape[0], cfg.do_layer_norm_before
    x = _ln(cfg, h, w["attn_norm"], w.get("attn_norm_bias")) if pre else h
    q, k, v = project_qkv(cfg, w, x)
    attn = kv.attend(q, k, v, meta, default_spec(cfg.head_dim))
    del q, k, v, x  # free the q/k/v GEMM output (views of it) before the MLP's peak (prefill)
    h = h + linear(attn.reshape(n, cfg.q_size), w["o"], w.get("o_bias"))
    del attn
    if not pre:
        h = _ln(cfg, h, w["attn_norm"], w.get("attn_norm_bias"))
    x = _ln(cfg, h, w["ffn_norm"], w.get("ffn_norm_bias")) if pre else h
    x = linear(_act(cfg)(linear(x, w["fc1"], w.get("fc1_bias"))), w["fc2"], w.get("fc2_bias"))
    h = h + x
    return h if pre else _ln(cfg, h, w["ffn_norm"], w.get("ffn_norm_bias"))


def logits(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """hidden ``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]``."""
    if "final_norm" in w:
        h = _ln(cfg, h, w["final_norm"], w.get("final_norm_bias"))
    if "project_out" in w:
        h = F.linear(h, w["project_out"])
    return F.linear(h, w.get("lm_head", w["embed"])).float()


def _act(cfg: ModelConfig):
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}.get(cfg.activation, F.relu)
