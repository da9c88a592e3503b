"""The CPU KV pool takes memory only as blocks are written: a pool sized for many long
sequences costs nothing up front, reads as zeros, and keeps what is written."""

from __future__ import annotations

import gc

import psutil
import torch

from localgen.kv.cache import PagedKVCache, lazy_zeros
from localgen.models.config import ModelConfig

MiB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _cfg() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
    })


def test_lazy_zeros_reads_zero_and_keeps_writes():
    t = lazy_zeros((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    gc.collect()  # the map must outlive the function's local reference
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 7


def test_a_large_cpu_pool_takes_ram_only_for_written_blocks():
    cfg = _cfg()  # 8 layers x K,V x 4 heads x 64 dims x 4 bytes: 16 KiB a token
    before = _rss()
    kv = PagedKVCache(cfg, num_blocks=2048, block_size=16, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert kv.nbytes >= 512 * MiB
    allocated = _rss()
    assert allocated - before < 64 * MiB, "the pool was committed up front"
    for i in range(cfg.num_layers):  # one block written in every layer, as a prefill does
        kv.views[i].k_cache[0].fill_(1.0)
        kv.views[i].v_cache[0].fill_(2.0)
    assert _rss() - allocated < 64 * MiB
    assert kv.views[3].k_cache[0].sum().item() == 16 * 4 * 64
    assert kv.views[3].k_cache[1].abs().sum().item() == 0
