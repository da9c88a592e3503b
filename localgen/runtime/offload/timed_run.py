"""An offloaded engine built to be measured, and its timed generation over random prompts.

What the offload bench (``localgen bench offload``) and the profiler's eager-layer probe
(``profiler.probes.probe_layer_host``) both run: a model of ``cfg``'s shapes (dummy weights unless
a store is given) under a ``Policy``, its KV cache sized for ``batch`` prompts and no more, and
greedy requests of random prompt ids with EOS ignored, timed by the engine's own prefill and
decode clocks (FlexGen's measure: the model steps, runner and sampling).
"""

from __future__ import annotations

import time

import torch

from localgen.models.config import ModelConfig
from localgen.runtime.engine import Engine, EngineConfig
from localgen.runtime.offload.policy import Policy
from localgen.runtime.request import Request, SamplingParams


def engine_config(cfg: ModelConfig, policy: Policy, batch: int, prompt_len: int, gen_len: int,
                  dtype: torch.dtype = torch.float16, block_size: int = 16,
                  prefill_graphs: bool = True) -> EngineConfig:
    """An EngineConfig whose KV cache holds ``batch`` sequences of ``prompt_len + gen_len``
    tokens, plus one spare KV block each, in the policy's storage format (4-bit when it
    compresses the cache) and no more: under a GPU cap the cache must not take the memory the
    policy's weights and activations were planned with."""
    from localgen.runtime.offload.kv import kv_layer_bytes

    blocks = batch * (-(-(prompt_len + gen_len) // block_size) + 1)
    per_block = kv_layer_bytes(cfg, 1, block_size, dtype, policy.compress_cache) * cfg.num_layers
    return EngineConfig(block_size=block_size, max_num_seqs=max(batch, policy.bls),
                        max_num_batched_tokens=max(8192, batch * prompt_len),
                        kv_cache_memory=blocks * per_block, enable_prefix_caching=False,
                        prefill_graphs=prefill_graphs)


def build_engine(cfg: ModelConfig, policy: Policy, batch: int, prompt_len: int, gen_len: int, *,
                 store=None, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.float16, gpu_memory: int | None = None,
                 offload_dir: str | None = None, block_size: int = 16,
                 prefill_graphs: bool = True) -> Engine:
    """An ``Engine`` (no tokenizer) running ``policy`` over ``store`` (default: dummy weights of
    ``cfg``'s shapes, ``DummyStore``), its cache as ``engine_config``. ``gpu_memory`` (bytes)
    caps this process's CUDA allocations as ``build_offload`` does."""
    from localgen.models.dummy import DummyStore
    from localgen.models.model import family_of
    from localgen.runtime.offload.runner import build_offload

    store = store if store is not None else DummyStore(cfg, family_of(cfg), dtype)
    ecfg = engine_config(cfg, policy, batch, prompt_len, gen_len, dtype, block_size, prefill_graphs)
    model, factory = build_offload(cfg, store, dtype, torch.device(device), policy,
                                   offload_dir=offload_dir, gpu_memory=gpu_memory)
    return Engine(model, None, ecfg, tuple(sorted(set(cfg.eos_token_ids))), runner_factory=factory)


def add_random_requests(engine: Engine, batch: int, prompt_len: int, gen_len: int,
                        seed: int = 0) -> list[str]:
    """``batch`` greedy requests of ``prompt_len`` random prompt ids (drawn with ``seed``), EOS
    ignored, so each generates exactly ``gen_len`` tokens -> their request ids, in the order added."""
    g = torch.Generator().manual_seed(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    vocab = engine.model.cfg.vocab_size
    added = []
    for _ in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        added.append(engine.add_request(Request(prompt_token_ids=ids, sampling=sp)))
    return added


def timed_generation(engine: Engine, batch: int, prompt_len: int, gen_len: int,
                     seed: int = 0) -> tuple[float, float, float]:
    """``add_random_requests`` run to completion -> (prefill s, decode s, wall s): the engine's
    model-step seconds of each phase, and the wall time from the first step to the last token,
    which also counts what the engine does between model steps (scheduling, detokenizing)."""
    add_random_requests(engine, batch, prompt_len, gen_len, seed)
    m = engine.metrics
    p0, d0 = m.prefill_seconds, m.decode_seconds
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return m.prefill_seconds - p0, m.decode_seconds - d0, time.perf_counter() - t0
