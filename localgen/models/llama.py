"""Llama-family layer math: Llama 2/3, Mistral, Qwen2 (q/k/v bias), SmolLM; GQA/MQA; any head_dim.

Each function takes the weights it needs, so a runtime can place and stream one layer at a time.
Hidden states are packed ``[num_tokens, hidden_size]`` (no padding).

On CUDA, when triton imports, the elementwise chains run as fused Triton kernels
(``localgen.kernels.fused_norm`` / ``fused_rope`` / ``fused_act``): residual add + RMSNorm in one
launch, q and k rotary in one launch (cos/sin formed in-kernel from positions when ``rope`` is a
``RotaryPositions``), silu(gate) * up in one launch. ``forward_layers`` additionally carries the
residual between layers so each layer's last add fuses into the next layer's input norm. Elsewhere
(CPU, or ``LOCALGEN_FUSED_ELEMENTWISE=0``) the torch code below runs unchanged.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from localgen.kernels import layer_ops_cpu as cpu_ops
from localgen.attention.spec import default_spec
from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models.config import ModelConfig
from localgen.models import moe
from localgen.models.fuse import fuse_qkv, fuse_rows, project_qkv
from localgen.models.moe_options import EXPERT_SHORTS, moe_layer_names
from localgen.models.rope import RotaryPositions, _signed_sin, apply_rope
from localgen.quant import cpu_int4, embedding, linear
from localgen.quant.cpu_int4 import BlocksWithCopy, Int4Linear
from localgen.quant.gguf_blocks import gguf_decode_products

_fused_mods = None  # (fused_norm, fused_rope, fused_act) once imported; False when unavailable


def _fused():
    global _fused_mods
    if _fused_mods is None:
        if os.environ.get("LOCALGEN_FUSED_ELEMENTWISE", "1") == "0":
            _fused_mods = False
        else:
            try:
                from localgen.kernels import fused_act, fused_norm, fused_rope
                _fused_mods = (fused_norm, fused_rope, fused_act)
            except Exception:  # triton missing or unusable: the torch path serves
                _fused_mods = False
    return _fused_mods


def fused_enabled(h: torch.Tensor) -> bool:
    """Whether the fused Triton elementwise kernels serve tensors like ``h`` (CUDA + triton)."""
    return h.is_cuda and bool(_fused())


# a decoder layer's short weight names -> the Hugging Face checkpoint's names under model.layers.{i}
LAYER_WEIGHTS = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias", "down_bias": "mlp.down_proj.bias",
}
OPTIONAL = {"q_bias", "k_bias", "v_bias", "o_bias", "gate_bias", "up_bias", "down_bias"}
# weights that may stay in GGUF blocks (``gguf_blocks.PackedGGUFWeight``): every matrix, and the
# embedding (looked up row by row; tied, it is also the output matrix)
PACKABLE = {"q", "k", "v", "o", "gate", "up", "down", "embed", "lm_head"} | EXPERT_SHORTS


def layer_weight_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Short name -> Hugging Face parameter name for layer ``i`` (biases are optional)."""
    return moe_layer_names(cfg.moe, i, {k: f"model.layers.{i}.{v}" for k, v in LAYER_WEIGHTS.items()})


def global_weight_names(cfg: ModelConfig) -> dict[str, str]:
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    return names


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # float32 statistics, as Hugging Face LlamaRMSNorm does, whatever the compute dtype:
    # ``weight * (x / rms(x))`` rounded to x's dtype before the weight multiplies it; on the CPU
    # one C call instead of ~10 small ops (most of a decode step's norm time)
    if x.device.type == "cpu" and cpu_ops.supports_norm(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def embed(cfg: ModelConfig, w: dict, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """token_ids ``[num_tokens]`` -> hidden ``[num_tokens, hidden_size]`` (a packed embedding
    gives float32 rows; the caller casts)."""
    return embedding(token_ids, w["embed"])


def packed_row_groups(names: dict[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The matrices ``fuse_weights`` stacks, for a store that can stack them as it reads
    (``read_weights``'s ``row_groups``; ``names``: the layer's shorts the checkpoint holds):
    q/k/v, and gate/up where they have no biases."""
    qkv = (("qkv", ("q", "k", "v")),)
    return qkv if "gate_bias" in names else qkv + (("gate_up", ("gate", "up")),)


def fuse_weights(cfg: ModelConfig, w: dict) -> dict:
    """Concatenate q/k/v and gate/up into one matrix each (vLLM's QKVParallelLinear and
    MergedColumnParallelLinear): decode is memory-bound, and one long GEMV per group reads the
    same bytes in fewer, better-utilized kernels. ``layer`` accepts fused or separate weights."""
    w = dict(w)
    fuse_qkv(w)
    if "gate_bias" not in w:
        fuse_rows(w, "gate_up", ("gate", "up"))
    if moe.is_moe(w):
        moe.fuse_experts(cfg.moe, w)
    return w


def _qkv_roped(cfg: ModelConfig, w: dict, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    """q, k (rotated) and v ``[n, heads, head_dim]``. With fused q/k/v weights, q and k are
    rotated together as one ``[n, num_heads + num_kv_heads, head_dim]`` view of the GEMM output
    (one rotary pass, no split copies)."""
    cos, sin = rope
    if "qkv" not in w:
        q, k, v = project_qkv(cfg, w, x)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
    n, hq, hk, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    y = linear(x, w["qkv"], w.get("qkv_bias"))
    qk = apply_rope(y[:, :(hq + hk) * d].view(n, hq + hk, d), cos, sin)
    return qk[:, :hq], qk[:, hq:], y[:, (hq + hk) * d:].view(n, hk, d)


def _gate_up(w: dict, x: torch.Tensor):
    if "gate_up" in w:
        return linear(x, w["gate_up"]).chunk(2, dim=-1)
    return linear(x, w["gate"], w.get("gate_bias")), linear(x, w["up"], w.get("up_bias"))


def layer(cfg: ModelConfig, w: dict, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
          kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
    """One decoder layer: pre-norm attention then pre-norm gated MLP, both residual.

    ``rope``: (cos, sin) tables, or ``RotaryPositions`` where the fused kernels serve ``h``
    (``fused_enabled``); they then run the layer (``layer_step``, its residual added back here: a
    runtime that keeps each layer's output whole, as the offload schedule does, pays one add)."""
    if fused_enabled(h):
        x, residual = layer_step(cfg, w, h, None, rope, kv, meta)
        return residual + x
    if isinstance(rope, RotaryPositions):
        rope = rope.cos_sin(h.dtype)
    if not meta.is_prefill and not h.is_cuda:
        mats = _cpu_decode_mats(cfg, w, h, kv)
        if mats is not None:
            return _cpu_decode_layer(cfg, w, mats, h, rope, kv, meta)
    n = h.shape[0]
    x = rms_norm(h, w["input_norm"], cfg.norm_eps)
    q, k, v = _qkv_roped(cfg, w, x, rope)
    attn = kv.attend(q, k, v, meta, default_spec(cfg.head_dim))
    del q, k, v  # free the q/k/v GEMM output before the MLP's peak (prefill)
    h = h + linear(attn.reshape(n, cfg.q_size), w["o"], w.get("o_bias"))
    del attn
    x = rms_norm(h, w["post_norm"], cfg.norm_eps)
    return h + mlp(cfg, w, x)


def mlp(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The layer's MLP on the normed ``x`` ``[n, hidden]``: the gated MLP, or for an MoE layer
    (its weights hold a ``router``) the mixture of experts (``moe.moe_mlp``)."""
    if moe.is_moe(w):
        return moe.moe_mlp(cfg, w, x, _act(cfg))
    gate, up = _gate_up(w, x)
    return linear(_act(cfg)(gate).mul_(up), w["down"], w.get("down_bias"))


def _cpu_decode_mats(cfg: ModelConfig, w: dict, h: torch.Tensor, kv: LayerKV):
    """The four matrix products (qkv, o, gate_up, down), each ``x -> x @ W.T`` in x's dtype,
    when ``_cpu_decode_layer`` can run this layer's decode step, else None. It can for a layer
    without biases, with a SiLU MLP and a plain paged cache holding K and V in one tensor of h's
    dtype (no score observer), whose matrices are either all int4 (bf16 activations) or all
    GGUF blocks (``PackedGGUFWeight``; float32 or bf16 activations; q/k/v may stay three
    matrices where their types differ), or all GGUF blocks with bf16 copies
    (``BlocksWithCopy``, read through their blocks) when the step has at most
    ``cpu_int4.BLOCKS_DECODE_MAX_M`` rows."""
    if (cfg.activation not in ("silu", "swish") or "gate_up" not in w or moe.is_moe(w)
            or any(k in w for k in ("qkv_bias", "q_bias", "k_bias", "v_bias", "o_bias",
                                    "down_bias"))
            or not kv.fuses_cpu_decode(h.dtype)):
        return None
    n = h.shape[0]
    mats = (w.get("qkv"), w.get("o"), w["gate_up"], w.get("down"))
    if type(mats[2]) is BlocksWithCopy:  # with_copies wraps every GGUF matrix of the layer
        if n > cpu_int4.BLOCKS_DECODE_MAX_M:
            return None  # the step reads the bf16 copies: the op-by-op path, by M
        return _blocks_products(w, mats)
    if h.dtype == torch.bfloat16 and all(
            type(m) is Int4Linear and m.max_m >= n and m.repeat_input == 1 for m in mats):
        return tuple(m.small for m in mats)
    if h.dtype in (torch.float32, torch.bfloat16):
        qkv = mats[0] if mats[0] is not None else (w.get("q"), w.get("k"), w.get("v"))
        return gguf_decode_products(qkv, mats[1:])
    return None


def _blocks_products(w: dict, mats: tuple):
    """``gguf_decode_products`` of a layer whose matrices are ``BlocksWithCopy`` (read here
    through their blocks), or None where one of them is held otherwise."""
    blocks = lambda m: m.blocks if type(m) is BlocksWithCopy else m  # noqa: E731
    qkv = mats[0] if mats[0] is not None else tuple(blocks(w.get(p)) for p in "qkv")
    return gguf_decode_products(blocks(qkv), [blocks(m) for m in mats[1:]])


def _cpu_decode_layer(cfg: ModelConfig, w: dict, mats: tuple, h: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], kv: LayerKV,
                      meta: AttentionMetadata) -> torch.Tensor:
    """``layer`` for a CPU decode step of an int4 or GGUF-block layer (``_cpu_decode_mats``): the
    same values (bit-identical output) with fewer ops and less Python between them. The matrix
    kernels are called directly; where the C layer ops are built
    (``localgen.kernels.layer_ops_cpu``) the norms, the rotary embedding with the K/V write, and
    the residual add are one C call each, as is attention (the bound backend's ``decode``); the
    torch twin of each is ``_torch_rope_store`` and the two-op add + ``rms_norm``."""
    qkv, o, gate_up, down = mats
    n, hq, hk, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.norm_eps
    drivers = getattr(mats, "drivers", None)
    if drivers is not None and _drivers_take(w, h, rope, meta):
        return _cpu_decode_driven(cfg, w, drivers, h, rope, kv, meta)
    y = qkv(rms_norm(h, w["input_norm"], eps))
    cos, sin = rope
    fused = cpu_ops.supports_rope(y, cos, sin, kv.pair, meta.slot_mapping)
    if fused:
        cpu_ops.rope_store(y, cos, sin, kv.pair, meta.slot_mapping, hq, hk, d)
    else:
        _torch_rope_store(y, cos, sin, kv, meta, hq, hk, d)
    attn = kv.attend_written(y[:, :hq * d].view(n, hq, d), meta, default_spec(d))
    delta = o(attn.view(n, hq * d))
    if fused:
        h, x = cpu_ops.add_rms_norm(h, delta, w["post_norm"], eps)
    else:
        h = h + delta
        x = rms_norm(h, w["post_norm"], eps)
    gu = gate_up(x)
    inter = gu.shape[1] // 2
    return h + down(F.silu(gu[:, :inter]).mul_(gu[:, inter:]))


def _drivers_take(w: dict, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  meta: AttentionMetadata) -> bool:
    """Whether ``_cpu_decode_driven`` takes this step: float32 rows, norms and rotary tables,
    all contiguous, int64 slots (the cache itself ``_cpu_decode_mats`` has checked)."""
    cos, sin = rope
    f32 = torch.float32
    return (h.dtype == f32 and h.is_contiguous() and cos.dtype == f32 and sin.dtype == f32
            and cos.is_contiguous() and sin.is_contiguous() and w["input_norm"].dtype == f32
            and w["post_norm"].dtype == f32 and w["input_norm"].is_contiguous()
            and w["post_norm"].is_contiguous() and meta.slot_mapping.dtype == torch.int64
            and meta.slot_mapping.is_contiguous())


def _cpu_decode_driven(cfg: ModelConfig, w: dict, drivers, h: torch.Tensor,
                       rope: tuple[torch.Tensor, torch.Tensor], kv: LayerKV,
                       meta: AttentionMetadata) -> torch.Tensor:
    """``_cpu_decode_layer`` on float32 rows through ``layer_ops_cpu``'s GGUF drivers: norm,
    q/k/v product, rotary and K/V write in one C call; the o product, residual add, norm and
    gate/up product in another; SiLU(gate) * up in torch (its rounding is torch's); the down
    product and residual add in a third. The same operations as the one-by-one calls, so the
    same bits."""
    n, hq, hk, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.norm_eps
    a_qkv, a_o, a_gate_up, a_down = drivers.args(n)
    y = cpu_ops.decode_qkv(h, w["input_norm"], eps, drivers.matmul, a_qkv, *rope, kv.pair,
                           meta.slot_mapping, hq, hk, d)
    attn = kv.attend_written(y[:, :hq * d].view(n, hq, d), meta, default_spec(d))
    h, gu = cpu_ops.decode_o_gate_up(attn.reshape(n, hq * d).contiguous(), drivers.matmul, a_o, h, w["post_norm"],
                                     eps, a_gate_up)
    inter = a_gate_up.n // 2
    return cpu_ops.decode_down(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), drivers.matmul, a_down, h)


def _torch_rope_store(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV,
                      meta: AttentionMetadata, hq: int, hk: int, d: int) -> None:
    """q/k of ``y`` ``[n, (hq + 2 hk) d]`` rotated in place, rotate-half as a swap of the halves
    (``flip`` of a ``[.., 2, d/2]`` view, one copy where ``roll`` takes several); then the new
    k and v written to the cache in one ``index_copy_``."""
    n = y.shape[0]
    qk = y[:, :(hq + hk) * d].view(n, hq + hk, d)
    torch.addcmul(qk * cos[:, None, :], qk.view(n, hq + hk, 2, d // 2).flip(2).view(qk.shape),
                  _signed_sin(sin), out=qk)  # rotated in place: y holds q, k, v as written
    kv.pair.view(2, -1, hk, d).index_copy_(
        1, meta.slot_mapping, y[:, hq * d:].view(n, 2, hk, d).transpose(0, 1))


def layer_step(cfg: ModelConfig, w: dict, x: torch.Tensor, residual: torch.Tensor | None,
               rope: tuple[torch.Tensor, torch.Tensor] | RotaryPositions, kv: LayerKV,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused-kernel layer carrying the residual stream (vLLM's ``(hidden, residual)`` form).

    The layer's input hidden state is ``x + residual`` (``x`` alone when ``residual`` is None);
    returns ``(mlp_out, residual)`` whose sum is the layer's output hidden state. Needs CUDA +
    triton (``fused_enabled``). Elementwise launches: fused add+norm, rope, fused add+norm,
    silu*mul (4, against ~30 torch kernels in ``layer``)."""
    fnorm, frope, fact = _fused()
    n = x.shape[0]
    xn, residual = fnorm.add_rms_norm(x, residual, w["input_norm"], cfg.norm_eps)
    q, k, v = project_qkv(cfg, w, xn)
    if isinstance(rope, RotaryPositions):
        q, k = frope.rope_qk(q, k, rope.positions, rope.inv_freq)
    else:
        q, k = frope.rope_qk_cos_sin(q, k, *rope)
    attn = kv.attend(q, k, v, meta, default_spec(cfg.head_dim))
    del q, k, v  # free the q/k/v GEMM output (v views it) before the MLP's peak (prefill)
    o = linear(attn.reshape(n, cfg.q_size), w["o"], w.get("o_bias"))
    del attn
    xn, residual = fnorm.add_rms_norm(o, residual, w["post_norm"], cfg.norm_eps)
    del o
    if moe.is_moe(w):
        return moe.moe_mlp(cfg, w, xn, _act(cfg)), residual
    if cfg.activation in ("silu", "swish"):
        if "gate_up" in w:
            act = fact.silu_mul_fused(linear(xn, w["gate_up"]))
        else:
            act = fact.silu_mul(*_gate_up(w, xn))
    else:
        gate, up = _gate_up(w, xn)
        act = _act(cfg)(gate) * up
    return linear(act, w["down"], w.get("down_bias")), residual


def forward_layers(cfg: ModelConfig, layers: list[dict], h: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | RotaryPositions,
                   kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
    """All layers with the residual carried across layer boundaries: each layer's final residual
    add fuses into the next layer's input norm; one add at the end. Fused path only."""
    x, residual = h, None
    for w, kv in zip(layers, kv_caches):
        x, residual = layer_step(cfg, w, x, residual, rope, kv, meta)
    return x if residual is None else residual + x


def logits(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """hidden ``[n, hidden_size]`` -> logits ``[n, vocab_size]`` in float32."""
    if fused_enabled(h):
        x, _ = _fused()[0].add_rms_norm(h, None, w["norm"], cfg.norm_eps)
    else:
        x = rms_norm(h, w["norm"], cfg.norm_eps)
    return linear(x, w.get("lm_head", w["embed"])).float()


def _act(cfg: ModelConfig):
    if cfg.activation in ("silu", "swish"):
        return F.silu
    if cfg.activation in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda t: F.gelu(t, approximate="tanh")
    return F.gelu
