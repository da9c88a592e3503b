"""q/k/v fused into one matrix (models/fuse.py): an OPT layer gives the unfused layer's output
from dense and from 4-bit weights (the 4-bit matrices stacked code for code), and its K/V
cache writes match."""

from __future__ import annotations

import pytest
import torch

from localgen.kv.attention import AttentionMetadata, LayerKV
from localgen.models import opt
from localgen.models.config import ModelConfig
from localgen.quant import int4

H, HEADS, D, FFN, BS = 128, 4, 32, 256, 16


def opt_weights(gen: torch.Generator) -> dict:
    def mat(n, k):
        return torch.randn(n, k, generator=gen) * 0.05

    w = {p: mat(H, H) for p in ("q", "k", "v", "o")}
    w.update({f"{p}_bias": torch.randn(H, generator=gen) * 0.02 for p in ("q", "k", "v", "o")})
    w.update(fc1=mat(FFN, H), fc1_bias=torch.zeros(FFN), fc2=mat(H, FFN), fc2_bias=torch.zeros(H),
             attn_norm=torch.ones(H), attn_norm_bias=torch.zeros(H), ffn_norm=torch.ones(H),
             ffn_norm_bias=torch.zeros(H))
    return w


def run_layer(cfg, w, h):
    """The layer over a 5-token prompt in a fresh cache: (output, the cache's K and V)."""
    pair = torch.zeros(2, 4, BS, HEADS, D)
    meta = AttentionMetadata(True, torch.arange(5), torch.tensor([[0]]), torch.tensor([5]), [5],
                             [5])
    out = opt.layer(cfg, w, h, None, LayerKV(pair[0], pair[1], pair), meta)
    return out, pair


@pytest.mark.parametrize("four_bit", [False, True])
def test_opt_fused_qkv_gives_the_unfused_layer(four_bit):
    cfg = ModelConfig("OPTForCausalLM", "opt", 50, H, FFN, 1, HEADS, HEADS, D, 64,
                      activation="relu")
    gen = torch.Generator().manual_seed(0)
    w = opt_weights(gen)
    if four_bit:
        w.update({p: int4.quantize(w[p]) for p in ("q", "k", "v", "o", "fc1", "fc2")})
    fused = opt.fuse_weights(cfg, w)
    assert "qkv" in fused and "qkv_bias" in fused and not {"q", "k", "v"} & set(fused)
    if four_bit:
        assert isinstance(fused["qkv"], int4.Int4Tensor)
    if four_bit:  # callable as the runtime calls them (on the CPU through the torch route)
        w, fused = ({k: int4.as_linear(t, torch.float32) if isinstance(t, int4.Int4Tensor) else t
                     for k, t in d.items()} for d in (w, fused))
    h = torch.randn(5, H, generator=gen)
    (want, want_kv), (got, got_kv) = run_layer(cfg, w, h), run_layer(cfg, fused, h)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_kv, want_kv, rtol=1e-5, atol=1e-6)


def test_biases_stay_apart_when_the_matrices_cannot_fuse():
    """4-bit q/k/v of 32 rows (half a group of 64: a group would straddle each seam) stay
    apart, and so do their biases: a fused bias beside unfused matrices would be dropped."""
    from localgen.models import llama

    q, k, v = (int4.quantize(torch.randn(32, 64)) for _ in range(3))
    w = {"q": q, "k": k, "v": v, **{f"{p}_bias": torch.zeros(32) for p in "qkv"}}
    for fam in (opt, llama):
        fused = fam.fuse_weights(None, w)
        assert "qkv" not in fused and "qkv_bias" not in fused and "q_bias" in fused
    # q/k/v packed elsewhere (the CPU int4 path's "qkv"): the biases fuse to match it
    packed = {k: t for k, t in w.items() if k.endswith("_bias")}
    assert "qkv_bias" in llama.fuse_weights(None, packed)
