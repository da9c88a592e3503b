"""Engine behaviour with a tiny real-architecture model and its tokenizer: seeded sampling,
stop strings, EOS, limits, priorities, aborts and prefix reuse."""

from __future__ import annotations

import pytest

from localgen.api import (LLM, KVBudgetError, Priority, PromptTooLongError, Request,
                          SamplingParams)
from tests.tiny_models import make_hf_model

CHAT = [{"role": "user", "content": "what is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("m"), "smollm")


def load(model_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM.load(str(model_dir), device="cpu", block_size=4, **kw)


def test_seeded_sampling_same_alone_and_in_a_full_batch(model_dir):
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = load(model_dir).generate([Request(messages=CHAT, sampling=sp)])[0]
    llm = load(model_dir, max_num_seqs=8)
    others = [Request(prompt=f"hello world {i}",
                      sampling=SamplingParams(temperature=0.8, seed=i, max_tokens=5 + i, ignore_eos=True))
              for i in range(7)]
    outs = llm.generate(others[:3] + [Request(messages=CHAT, sampling=sp)] + others[3:])
    assert outs[3].token_ids == alone.token_ids and outs[3].text == alone.text
    unseeded = load(model_dir).generate([Request(messages=CHAT, sampling=SamplingParams(
        temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))])[0]
    assert unseeded.token_ids != alone.token_ids  # the seed matters


def test_stop_string_spanning_tokens_ends_the_text(model_dir):
    llm = load(model_dir)
    full = llm.generate([Request(messages=CHAT, sampling=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))])[0]
    toks = llm.tokenizer
    # choose a stop string that starts inside one token and ends inside a later one
    pieces = [toks.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    i = next(i for i in range(2, len(pieces) - 2) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    start = len(pieces[i]) - 1
    stop = full.text[start:start + 3]
    assert len(stop) == 3 and full.text.find(stop) == start
    out = llm.generate([Request(messages=CHAT, sampling=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))])[0]
    assert out.finish_reason == "stop" and out.text == full.text[:start]


def test_eos_ends_with_stop_and_max_tokens_with_length(model_dir):
    llm = load(model_dir)
    first = llm.generate([Request(prompt="hello", sampling=SamplingParams(temperature=0, max_tokens=3))])[0]
    assert first.finish_reason == "length" and first.completion_tokens == 3
    llm.engine.eos_token_ids = frozenset({first.token_ids[1]})  # make the 2nd token an EOS
    out = llm.generate([Request(prompt="hello", sampling=SamplingParams(temperature=0, max_tokens=3))])[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[:2]


def test_context_limit_and_too_long_prompt(model_dir):
    llm = load(model_dir, max_model_len=40)
    with pytest.raises(PromptTooLongError, match="40"):
        llm.add_request(Request(prompt_token_ids=[7] * 40))
    out = llm.generate([Request(prompt_token_ids=[7] * 30,
                                sampling=SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))])[0]
    assert out.finish_reason == "length" and out.prompt_tokens + out.completion_tokens == 40


def test_kv_budget_limits_and_errors_name_the_budget(model_dir):
    llm = load(model_dir, max_model_len=64)
    per_block = llm.engine.kv_cache.bytes_per_block
    small = load(model_dir, max_model_len=64, kv_cache_memory=3 * per_block)  # 12 tokens
    assert small.token_limit == 12
    with pytest.raises(KVBudgetError, match=r"holds 12 tokens; this prompt needs 13 .*--kv-cache-memory") as e:
        small.add_request(Request(prompt_token_ids=[7] * 12))
    assert e.value.needed_bytes == 4 * per_block and e.value.budget_bytes == 3 * per_block
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([Request(prompt_token_ids=[7] * 5, sampling=sp)])[0]
    cut = small.generate([Request(prompt_token_ids=[7] * 5, sampling=sp)])[0]
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:7]


def test_prompt_text_over_the_byte_bound_is_refused_untokenized(model_dir, monkeypatch):
    llm = load(model_dir, max_model_len=64)
    assert llm.max_prompt_bytes == 63 * llm.engine.max_token_bytes * 4
    calls = []
    monkeypatch.setattr(llm.engine, "tokenizer", _Counting(llm.tokenizer, calls))
    with pytest.raises(PromptTooLongError, match="not tokenized"):
        llm.add_request(Request(prompt="x" * (llm.max_prompt_bytes + 1)))
    assert calls == []
    with pytest.raises(PromptTooLongError, match="tokens does not fit"):
        llm.add_request(Request(prompt="x " * 100))  # under the bound: tokenized, then judged
    assert calls == [200]


class _Counting:
    def __init__(self, tok, calls):
        self._tok, self._calls = tok, calls

    def __call__(self, text, **kw):
        self._calls.append(len(text))
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_interactive_request_runs_before_queued_batch_work(model_dir):
    llm = load(model_dir, max_num_seqs=2)
    batch_ids = [llm.add_request(Request(prompt=f"job {i}", sampling=SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))) for i in range(6)]
    for _ in range(3):
        llm.step()
    chat_id = llm.add_request(Request(messages=CHAT, priority=Priority.INTERACTIVE,
                                      sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    finished = []
    while llm.has_unfinished():
        finished += [o.request_id for o in llm.step() if o.finished]
    assert finished.index(chat_id) < 2  # ahead of all batch jobs but one already running
    assert set(finished) == set(batch_ids + [chat_id])
    assert llm.metrics.num_preemptions >= 1  # a running batch job made room


def test_abort_frees_blocks(model_dir):
    llm = load(model_dir)
    free = llm.engine.block_manager.num_free_blocks
    rid = llm.add_request(Request(messages=CHAT, sampling=SamplingParams(max_tokens=50, ignore_eos=True)))
    llm.step()
    assert llm.engine.block_manager.num_free_blocks < free
    out = llm.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert llm.engine.block_manager.num_free_blocks == free and not llm.has_unfinished()


def test_second_turn_reuses_the_conversation_prefix(model_dir):
    llm = load(model_dir)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    turn1 = llm.generate([Request(messages=CHAT, sampling=sp)])[0]
    history = CHAT + [{"role": "assistant", "content": turn1.text},
                      {"role": "user", "content": "and of Germany?"}]
    turn2 = llm.generate([Request(messages=history, sampling=sp)])[0]
    assert turn2.cached_prompt_tokens >= turn1.prompt_tokens // 4 * 4 - 4
    fresh = load(model_dir, enable_prefix_caching=False).generate([Request(messages=history, sampling=sp)])[0]
    assert fresh.token_ids == turn2.token_ids and fresh.cached_prompt_tokens == 0


def _drive(llm: LLM, requests: list[Request], abort_id: str, abort_at: int):
    """Step ``llm`` to the end, aborting ``abort_id`` before step ``abort_at``; each request's
    outputs in order, and how many outputs the after_launch hooks were handed."""
    hooked: list = []
    handed = 0
    if llm.engine.overlap_outputs:
        llm.engine.after_launch = hooked.extend
    for r in requests:
        llm.add_request(r)
    got: dict[str, list] = {r.request_id: [] for r in requests}
    steps = 0
    while llm.has_unfinished():
        if steps == abort_at:
            out = llm.abort(abort_id)
            if out is not None:
                got[out.request_id].append(out)
        outs = llm.step()
        assert outs[:len(hooked)] == hooked  # the hook's outputs lead the step's
        handed += len(hooked)
        hooked.clear()
        for out in outs:
            got[out.request_id].append(out)
        steps += 1
    return got, handed


def test_overlapped_outputs_equal_immediate_ones(model_dir):
    """``overlap_outputs`` (a step's outputs built in the next step, as on CUDA) gives every
    request the same outputs, deltas and ends: EOS, a stop string, max_tokens, a grammar's end,
    logprobs, seeded sampling, and an abort (whose final output then carries the last token)."""
    llm = load(model_dir, max_num_seqs=8)
    probe = llm.generate([Request(prompt="hello", sampling=SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))])[0]
    eos = probe.token_ids[6]
    stop = probe.text[len(llm.tokenizer.decode(probe.token_ids[:3])):][:2]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def requests():
        sp = dict(temperature=0, max_tokens=24)
        return [
            Request(request_id="eos", prompt="hello", sampling=SamplingParams(**sp)),
            Request(request_id="stop", prompt="hello", sampling=SamplingParams(**sp, ignore_eos=True, stop=[stop])),
            Request(request_id="length", prompt="hi there", sampling=SamplingParams(
                temperature=0.9, seed=5, max_tokens=9, ignore_eos=True, logprobs=2)),
            Request(request_id="json", messages=CHAT, sampling=SamplingParams(
                temperature=0, max_tokens=40, response_format={"type": "json_schema",
                                                               "json_schema": {"name": "a", "schema": schema}})),
            Request(request_id="abort", messages=CHAT, sampling=SamplingParams(**sp, ignore_eos=True)),
        ]

    runs = []
    for overlap in (False, True):
        llm = load(model_dir, max_num_seqs=8)
        llm.engine.eos_token_ids = frozenset({eos})
        llm.engine.overlap_outputs = overlap
        runs.append(_drive(llm, requests(), "abort", abort_at=5))
    (plain, none_handed), (overlapped, handed) = runs
    assert none_handed == 0 and handed > 20  # built inside the next step
    assert [o[-1].finish_reason for o in plain.values()] == ["stop", "stop", "length", "stop", "abort"]
    for rid in plain:
        a, b = plain[rid], overlapped[rid]
        assert [o.finished for o in b].count(True) == 1 and b[-1].finished
        assert "".join(o.text_delta for o in b) == b[-1].text == a[-1].text
        assert (b[-1].token_ids, b[-1].finish_reason, b[-1].logprobs) == \
               (a[-1].token_ids, a[-1].finish_reason, a[-1].logprobs)
        if rid != "abort":
            assert [(o.text_delta, o.token_ids) for o in b] == [(o.text_delta, o.token_ids) for o in a]
