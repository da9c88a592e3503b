"""The windowed and soft-capped dense families (Gemma 2: softcap and sliding layers; Gemma 3:
sliding layers interleaved with global ones; Mistral: a window on every layer) through the offload
runtime on CPU: weights and KV cache split across the GPU-less tiers (the "gpu" tier is the CPU
here), greedy tokens equal to transformers' on the committed fixtures, with 20-token prompts past
their 8-token window (tests/test_families_dense.py shows the window changes transformers' logits).
The tiered layers attend through the gather path, whose window/softcap masking is the reference
backend's (``localgen.attention.reference.per_sequence_attention``)."""

from __future__ import annotations

import pytest
import torch

from localgen.api import LLM
from localgen.attention.base import UnsupportedAttention
from localgen.attention.spec import AttentionSpec
from localgen.runtime.offload.kv import TieredKVCache
from localgen.runtime.offload.tier_backends import Int4KernelTierLayer, MappedHostTierLayer
from localgen.runtime.offload.tier_layer import TierLayer
from localgen.runtime.offload.timers import Timers
from localgen.policy.policy import Policy
from tests.test_families_dense import WINDOWED, _greedy, _path, reference  # noqa: F401

# (weights and cache all on the CPU tier: test_families_dense.py's offload test, GGUFs included)
POLICIES = {
    # weights and cache split across the three tiers (the cache's disk layers in mapped files)
    "split": Policy(gbs=2, num_gpu_batches=1, wg=0.3, wc=0.4, wd=0.3, cg=0.3, cc=0.3, cd=0.4,
                    hg=1, hc=0),
    # the policy delegates decode attention to the CPU (a CPU compute device keeps the gather path)
    "cpu_compute": Policy(gbs=1, num_gpu_batches=2, wg=0.5, wc=0.5, wd=0, cg=0, cc=0.5, cd=0.5,
                          hg=1, hc=0, cpu_cache_compute=True),
}


def _offloaded(name: str, tmp_path, policy: Policy) -> LLM:
    return LLM.load(_path(name, "hf"), device="cpu", dtype="float32", kv_cache_memory=1 << 22,
                    block_size=4, policy=policy.validate(), offload_dir=str(tmp_path / "off"))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windowed_families_give_transformers_tokens_offloaded(reference, tmp_path, name, policy):
    assert _greedy(_offloaded(name, tmp_path, POLICIES[policy])) == reference(name)[1]


def _cache(tiers, compress, specs):
    from localgen.models.config import ModelConfig
    from tests.tiny_models import make_config

    cfg = ModelConfig.from_hf_dict(make_config("llama3").to_dict())
    return TieredKVCache(cfg, 8, 4, torch.float32, torch.device("cpu"), tiers, compress, False, None,
                         Timers(torch.device("cpu")), specs=specs)


def test_a_windowed_layer_gets_a_tier_layer_that_computes_its_spec():
    windowed = AttentionSpec(0.25, sliding_window=8, logit_softcap=30.0)
    cache = _cache(["cpu", "cpu"], True, [windowed, None])
    for view in cache.views:
        assert type(view) is TierLayer and view.supports(windowed)


@pytest.mark.parametrize("cls", [Int4KernelTierLayer, MappedHostTierLayer])
def test_in_place_kernel_layers_refuse_windows_in_one_sentence(cls):
    layer = _cache(["cpu"], cls is Int4KernelTierLayer, None).views[0]
    layer.__class__ = cls  # the kernels are CUDA-only; the refusal is the class's, not the device's
    spec = AttentionSpec(0.25, sliding_window=8)
    assert not layer.supports(spec) and layer.supports(AttentionSpec(0.25))
    q = torch.zeros(1, layer.kv_heads * 2, layer.head_dim)
    with pytest.raises(UnsupportedAttention, match=r"^sliding-window attention is not supported "
                                                   r"by the tiered.* attention backend on cpu$"):
        layer.forward(layer, q, q[:, :2], q[:, :2], None, spec)


def test_a_windowed_4bit_layer_attends_over_its_dequantized_cache():
    """A 4-bit, rotated tier layer (recent-block pool on) with a window and a softcap: a prefill
    and a decode step past the window equal ``spec_attention`` over the dequantized cache turned
    back by ``R^T`` (scores ``(qR)(kR)^T = qk^T``), the pool left unused by such a layer."""
    from localgen.attention.metadata import AttentionMetadata
    from localgen.attention.reference import spec_attention
    from localgen.kernels.quant_ref import GROUP_SIZE, dequantize_int4, quantize_int4
    from localgen.runtime.offload.kv import kv_rotation

    cache = _cache(["cpu"], True, None)
    layer = cache.views[0]
    assert layer.recent_blocks and layer.rot is not None
    H, kvh, d = layer.kv_heads * 2, layer.kv_heads, layer.head_dim
    spec = AttentionSpec(d ** -0.5, sliding_window=3, logit_softcap=2.0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, d, generator=g) for h in (H, kvh, kvh))
    table = torch.tensor([[2, 5]])
    steps = [AttentionMetadata(True, torch.tensor([8, 9, 10, 11, 20, 21, 22]), table,
                               torch.tensor([7]), [7], [7]),
             AttentionMetadata(False, torch.tensor([23]), table, torch.tensor([8]), [1], [8])]
    r = kv_rotation(d).float()
    kq, vq = (dequantize_int4(*quantize_int4(x @ r, GROUP_SIZE, dim=-1), GROUP_SIZE, dim=-1,
                              dtype=torch.float32) @ r.T for x in (k, v))
    for meta, rows in zip(steps, (slice(0, 7), slice(7, 8))):
        out = layer.attend(q[rows], k[rows], v[rows], meta, spec)
        want = spec_attention(q[rows], kq[:rows.stop], vq[:rows.stop], rows.start, spec)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
