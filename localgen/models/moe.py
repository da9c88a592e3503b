"""The mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router picks ``top_k`` of
``num_experts`` gated MLPs per token and sums their outputs weighted by the routing weights.

The decoder layer (``llama.mlp``) calls `moe_mlp` in place of the dense MLP for an MoE layer (its
weight dict holds a ``router``). Experts run batched per expert: the (token, expert) pairs are
sorted by expert, and each expert that got tokens runs one gate/up and one down matmul over all
of its tokens (no loop over tokens; one host sync per layer reads the per-expert counts). Every
matrix goes through ``localgen.quant.linear``, so an expert kept in GGUF blocks (one
``PackedGGUFWeight`` per expert slice of llama.cpp's stacked ``ffn_*_exps``) runs the packed
matmul.

Routing, as each family's ``transformers`` router computes it (the tests' reference):
Mixtral takes the softmax over the top-k router logits (Jiang et al., *Mixtral of Experts*,
2024, §2.1), as gpt-oss does over its biased router logits; Qwen3-MoE takes the softmax over
all experts, then the top k, divided by their sum when ``norm_topk_prob``. Weights are computed
in float32. gpt-oss's experts are stacked tensors with biases and a clamped SwiGLU
(``MoEOptions.swiglu_limit``), run from the stacked weights by expert index.
"""

from __future__ import annotations

import torch

from localgen.models.config import ModelConfig
from localgen.models.fuse import fuse_rows
from localgen.models.moe_options import TOPK_SOFTMAX, MoEOptions, expert_short
from localgen.quant import linear


def is_moe(w: dict) -> bool:
    """Whether a layer's weight dict is an MoE layer's (it holds the router)."""
    return "router" in w


def route(moe: MoEOptions, router: torch.Tensor, x: torch.Tensor,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``x`` ``[n, hidden]``: float32 weights ``[n, top_k]`` and expert ids
    ``[n, top_k]`` (int64), by the family's rule (module docstring); ``bias`` ``[num_experts]``
    is added to the router logits (gpt-oss)."""
    logits = linear(x, router, bias).float()
    if moe.routing == TOPK_SOFTMAX:
        top, experts = logits.topk(moe.top_k, dim=-1)
        return top.softmax(dim=-1), experts
    weights, experts = logits.softmax(dim=-1).topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def fuse_experts(moe: MoEOptions, w: dict) -> None:
    """Each expert's gate and up stacked into one ``expert.{e}.gate_up`` matrix, in place (one
    GEMM per expert for both; ``fuse.fuse_rows`` leaves apart what it cannot stack)."""
    for e in range(moe.num_experts):
        fuse_rows(w, expert_short(e, "gate_up"), (expert_short(e, "gate"), expert_short(e, "up")))


def _stacked_expert(moe: MoEOptions, w: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of gpt-oss's stacked weights on its tokens ``x`` ``[m, hidden]``: biased
    gate/up (interleaved columns), the clamped SwiGLU of ``MoEOptions``, biased down."""
    gate_up = torch.addmm(w["experts_gate_up_bias"][e], x, w["experts_gate_up"][e])
    limit = moe.swiglu_limit
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
    glu = gate * torch.sigmoid(gate * moe.swiglu_alpha)
    return torch.addmm(w["experts_down_bias"][e], (up + 1) * glu, w["experts_down"][e])


def _expert(act, w: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s gated MLP on its tokens ``x`` ``[m, hidden]`` -> ``[m, hidden]``."""
    fused = w.get(expert_short(e, "gate_up"))
    if fused is not None:
        gate, up = linear(x, fused).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w[expert_short(e, "gate")]), linear(x, w[expert_short(e, "up")])
    return linear(act(gate).mul_(up), w[expert_short(e, "down")])


def moe_mlp(cfg: ModelConfig, w: dict, x: torch.Tensor, act) -> torch.Tensor:
    """The MoE block on the normed hidden states ``x`` ``[n, hidden]`` -> ``[n, hidden]`` in
    x's dtype; ``act`` is the gate's activation. ``w`` holds ``router`` ``[num_experts, hidden]``
    and per expert ``expert.{e}.gate_up`` ``[2 * expert_size, hidden]`` (or ``.gate`` and
    ``.up``) and ``expert.{e}.down`` ``[hidden, expert_size]``; gpt-oss's holds its stacked
    ``experts_*`` tensors and biases instead (``moe_options._STACKED``)."""
    moe = cfg.moe
    weights, experts = route(moe, w["router"], x, w.get("router_bias"))
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    tokens, pair_weights = order // moe.top_k, weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        xe = x.index_select(0, rows)
        y = _stacked_expert(moe, w, e, xe) if moe.swiglu_limit is not None else _expert(act, w, e, xe)
        out.index_add_(0, rows, (y * pair_weights[start:start + count, None]).to(x.dtype))
        start += count
    return out
