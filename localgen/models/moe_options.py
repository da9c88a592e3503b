"""Mixture-of-experts settings (``MoEOptions``) of Mixtral, Qwen3-MoE and gpt-oss, read from a
Hugging Face ``config.json`` dict, and the weight names of an MoE layer.

Torch-free, so a config is checked without importing the math (`moe` holds it). Sources: the
``transformers`` modeling code of each class (``MixtralSparseMoeBlock``,
``Qwen3MoeSparseMoeBlock`` and their routers: the reference the tests compare against); Jiang et
al., *Mixtral of Experts*, 2024, §2.1 (the router's softmax over the top-k logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# HF class -> weight-name layout of its MoE block (`_LAYOUTS`)
MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                     "GptOssForCausalLM": "gpt_oss"}
# layout -> (router, expert prefix, {short: HF matrix name}) under ``model.layers.{i}.``
_LAYOUTS = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts",
                {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3_moe": ("mlp.gate", "mlp.experts",
                  {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
# gpt-oss stores each layer's experts stacked, in ``x @ W`` orientation, with biases: short ->
# name under ``model.layers.{i}.mlp.`` (gate_up: ``[E, hidden, 2 * expert_size]``, gate and up
# interleaved along the last dim; down: ``[E, expert_size, hidden]``)
_STACKED = {"router": "router.weight", "router_bias": "router.bias",
            "experts_gate_up": "experts.gate_up_proj", "experts_gate_up_bias": "experts.gate_up_proj_bias",
            "experts_down": "experts.down_proj", "experts_down_bias": "experts.down_proj_bias"}
# the dense MLP's shorts an MoE layer replaces (llama.LAYER_WEIGHTS)
_DENSE_MLP = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
TOPK_SOFTMAX, SOFTMAX_TOPK = "topk_softmax", "softmax_topk"
# experts whose matrices may stay in GGUF blocks (a family's PACKABLE is a fixed set of shorts):
# more than any released MoE model has per layer
MAX_PACKED_EXPERTS = 512


class MoEConfigError(ValueError):
    """A config setting the MoE block has no math for (config.py turns it into
    UnsupportedModelError)."""


@dataclass(frozen=True)
class MoEOptions:
    """How an MoE layer routes each token and where its weights are.

    num_experts / top_k: experts per layer and experts each token uses.
    expert_size: the intermediate width of one expert's gated MLP.
    routing: ``topk_softmax`` (Mixtral: softmax over the top-k router logits) or
        ``softmax_topk`` (Qwen3-MoE: softmax over all experts, then the top k).
    norm_topk_prob: with ``softmax_topk``, the k weights are divided by their sum.
    layout: weight-name layout (``mixtral`` or ``qwen3_moe``).
    dense_layers: layers whose MLP is dense (Qwen3-MoE's ``mlp_only_layers`` and
        ``decoder_sparse_step``); they use the config's ``intermediate_size``.
    swiglu_limit / swiglu_alpha: gpt-oss's expert activation, ``(clamp(up, ±limit) + 1) *
        g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``; None = the family's plain
        ``act(gate) * up``.
    """

    num_experts: int
    top_k: int
    expert_size: int
    routing: str
    norm_topk_prob: bool
    layout: str
    dense_layers: tuple[int, ...] = ()
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.dense_layers

    def num_moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))


def moe_options(arch: str, d: Mapping[str, Any], num_layers: int) -> MoEOptions | None:
    """The ``MoEOptions`` of HF class ``arch`` from its ``config.json`` dict ``d``; None for a
    dense class.

    Raises MoEConfigError naming a setting that changes the math and is not implemented."""
    layout = MOE_ARCHITECTURES.get(arch)
    if layout is None:
        return None
    n = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    k = int(d.get("num_experts_per_tok") or 0)
    if not 1 <= k <= n:
        raise MoEConfigError(f"num_experts_per_tok = {k} with {n} experts: each token needs "
                             "between 1 and all of the experts")
    if layout == "mixtral":
        return MoEOptions(n, k, int(d["intermediate_size"]), TOPK_SOFTMAX, True, layout)
    if layout == "gpt_oss":
        return MoEOptions(n, k, int(d["intermediate_size"]), TOPK_SOFTMAX, True, layout,
                          swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                          swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
    step = int(d.get("decoder_sparse_step", 1) or 1)
    only = {int(i) for i in d.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return MoEOptions(n, k, int(d["moe_intermediate_size"]), SOFTMAX_TOPK,
                      bool(d.get("norm_topk_prob", False)), layout, dense)


def router_name(moe: MoEOptions, i: int) -> str:
    return f"model.layers.{i}.{_LAYOUTS[moe.layout][0]}.weight"


def expert_name(moe: MoEOptions, i: int, e: int, short: str) -> str:
    """HF name of expert ``e``'s ``short`` matrix (``gate``, ``up`` or ``down``) in layer ``i``."""
    _, prefix, mats = _LAYOUTS[moe.layout]
    return f"model.layers.{i}.{prefix}.{e}.{mats[short]}.weight"


def expert_short(e: int, short: str) -> str:
    """The layer dict's key of expert ``e``'s ``short`` matrix."""
    return f"expert.{e}.{short}"


EXPERT_SHORTS = frozenset(expert_short(e, s) for e in range(MAX_PACKED_EXPERTS)
                          for s in ("gate", "up", "down", "gate_up"))


def moe_layer_names(moe: MoEOptions | None, i: int, names: dict[str, str]) -> dict[str, str]:
    """``names`` (short -> HF name of layer ``i``) with the dense MLP replaced by the router and
    every expert's gate/up/down when layer ``i`` is an MoE layer; else ``names`` as given."""
    if moe is None or not moe.is_moe_layer(i):
        return names
    out = {k: v for k, v in names.items() if k not in _DENSE_MLP}
    if moe.layout == "gpt_oss":
        return {**out, **{k: f"model.layers.{i}.mlp.{v}" for k, v in _STACKED.items()}}
    out["router"] = router_name(moe, i)
    for e in range(moe.num_experts):
        out.update({expert_short(e, s): expert_name(moe, i, e, s) for s in ("gate", "up", "down")})
    return out


def moe_layer_parameters(moe: MoEOptions, hidden: int) -> int:
    """Elements of one MoE block: every expert's three matrices and the router."""
    return moe.num_experts * (3 * hidden * moe.expert_size + hidden)
