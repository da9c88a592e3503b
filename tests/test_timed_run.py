"""`runtime/offload/timed_run`: the offloaded engine the bench and the profiler's layer probe
time, on the CPU with a tiny Llama of dummy weights, checked against the plain resident engine."""

from __future__ import annotations

import torch

from localgen.models.config import ModelConfig
from localgen.models.dummy import DummyStore
from localgen.models.model import CausalLM, family_of
from localgen.runtime.engine import Engine
from localgen.runtime.offload.policy import Policy
from localgen.runtime.offload.timed_run import add_random_requests, build_engine, timed_generation

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def _outputs(engine: Engine, batch: int, prompt_len: int, gen_len: int) -> list[list[int]]:
    # in the order added: the ids come from a process-wide counter ("req-9" < "req-10" but not
    # as strings), so sorting them would depend on how many requests earlier tests made
    order = add_random_requests(engine, batch, prompt_len, gen_len, seed=3)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[k] for k in order]


def test_the_offloaded_engine_generates_what_the_resident_one_does():
    cfg = ModelConfig.from_hf_dict(TINY)
    store = DummyStore(cfg, family_of(cfg), torch.float32)
    # dummy weights of std 0.02 leave a 2-layer model's logits nearly flat, so which of two
    # near-equal logits wins depends on summation order (thread count, backend); at std 0.5 the
    # greedy choice is decided by the weights, and any difference is the runtime's
    store.buf.mul_(25)
    policy = Policy(gbs=2, num_gpu_batches=2, wg=0.5, wc=0.5, cg=1.0, hg=1.0).validate()
    off = build_engine(cfg, policy, 4, 8, 5, store=store, device="cpu", dtype=torch.float32)
    plain = Engine(CausalLM(cfg, store, torch.float32, torch.device("cpu")), None)
    got, want = _outputs(off, 4, 8, 5), _outputs(plain, 4, 8, 5)
    assert got == want and all(len(t) == 5 for t in got)  # EOS ignored: exactly gen_len tokens


def test_timed_generation_counts_each_phase_and_the_wall():
    cfg = ModelConfig.from_hf_dict(TINY)
    policy = Policy(gbs=2, num_gpu_batches=1, compress_weight=True, compress_cache=True).validate()
    engine = build_engine(cfg, policy, 2, 8, 4, device="cpu", dtype=torch.float32)
    before = engine.metrics.generation_tokens
    prefill, decode, wall = timed_generation(engine, 2, 8, 4)
    assert engine.metrics.generation_tokens - before == 2 * 4
    assert prefill > 0 and decode > 0 and wall >= prefill + decode
    assert not engine.has_unfinished()
