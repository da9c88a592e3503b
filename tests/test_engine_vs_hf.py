"""Greedy tokens of the engine equal Hugging Face transformers' (fp32, CPU) on the same weights,
for every supported family and variant, with requests joining at different steps, with and without
prefix caching, and with preemption forced by a tiny KV cache."""

from __future__ import annotations

import pytest
import torch

from localgen.api import LLM, Request, SamplingParams
from tests.tiny_models import VARIANTS, make_hf_model, make_model

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Greedy continuation by transformers' own KV-cached forward (EOS neither stops nor is
    suppressed, as with ignore_eos)."""
    ids, out, past = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past, tok = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def prompts(seed: int, lengths=(3, 17, 9, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 300, (n,), generator=g).tolist() for n in lengths]


def run_staggered(llm: LLM, ps: list[list[int]], sp: SamplingParams = GREEDY) -> dict[int, list[int]]:
    """Submit prompt i after i engine steps, so requests join a running batch at different steps."""
    done, pending, ids = {}, list(enumerate(ps)), {}
    while pending or llm.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            ids[llm.add_request(Request(prompt_token_ids=p, sampling=sp))] = i
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    return done


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {v: make_hf_model(root, v) for v in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_tokens_equal_transformers(model_dirs, variant, prefix_caching):
    hf = make_model(variant)
    llm = LLM.load(str(model_dirs[variant]), device="cpu", kv_cache_memory=1 << 22, block_size=4,
                   enable_prefix_caching=prefix_caching)
    ps = prompts(1)
    ps.append(ps[1][:13] + [7, 8])  # shares 3 full blocks with prompt 1: a prefix-cache hit
    got = run_staggered(llm, ps)
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(hf, p), f"{variant}: prompt {i} (len {len(p)}) differs"
    if prefix_caching:
        assert llm.metrics.cached_prompt_tokens >= 12
    else:
        assert llm.metrics.cached_prompt_tokens == 0


@pytest.mark.parametrize("variant", ["llama3", "opt_proj"])
def test_preemption_by_recomputation_keeps_greedy_tokens(model_dirs, variant):
    hf = make_model(variant)
    llm = LLM.load(str(model_dirs[variant]), device="cpu", block_size=4)
    # rebuild the engine with a cache of 14 blocks (56 tokens) for 4 sequences that need ~100
    from localgen.runtime.engine import Engine, EngineConfig
    per_block = llm.engine.kv_cache.nbytes // llm.engine.block_manager.num_blocks
    llm.engine = Engine(llm.engine.model, llm.tokenizer,
                        EngineConfig(block_size=4, kv_cache_memory=14 * per_block),
                        tuple(llm.engine.eos_token_ids))
    ps = prompts(2, lengths=(11, 14, 9, 13))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = run_staggered(llm, ps, sp)
    assert llm.metrics.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(hf, p, 12)
    assert llm.engine.block_manager.num_free_blocks == 14  # everything freed at the end


def test_logits_within_tolerance(model_dirs):
    """Last-position logits of a prefill match transformers within 1e-4 (fp32)."""
    hf = make_model("qwen2")
    llm = LLM.load(str(model_dirs["qwen2"]), device="cpu", kv_cache_memory=1 << 20)
    p = prompts(3, lengths=(21,))[0]
    eng = llm.engine
    eng.add_request(Request(prompt_token_ids=p, sampling=GREEDY))
    batch = eng.scheduler.schedule()
    ours = eng.runner.run(batch.seqs, batch.is_prefill)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
