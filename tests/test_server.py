"""`localgen serve` end to end: the embedded model behind uvicorn on 127.0.0.1 (a free port),
driven by the official `openai` client and raw HTTP (httpx). One server for the module."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from localgen.api import LLM
from localgen.runtime.request import Priority, Request, SamplingParams
from localgen.server.app import create_app
from localgen.server.generation import ServerConfig
from localgen.service import EngineService

CONTEXT = 512  # a short context keeps the context-limit tests cheap
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class Served:
    """A uvicorn server in a thread; ``url`` ends in /v1."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def service():
    svc = EngineService(LLM.load(kv_cache_memory=128 << 20, max_model_len=CONTEXT)).start()
    assert svc.wait_ready(120)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def server(service):
    name = service.llm.model_name
    app = create_app(service, ServerConfig(model_names=(name,)))
    s = Served(app)
    s.model, s.app, s.service = name, app, service
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def engine_answer(service, sp: SamplingParams, messages=None, prompt=None):
    """The same request straight through the engine service (no HTTP)."""
    req = Request(messages=messages, prompt=prompt, sampling=sp, priority=Priority.INTERACTIVE)
    return service.submit(req).result(timeout=120)


def metric(server, name: str) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# -- models, health ------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


# -- chat -----------------------------------------------------------------------------------------
def test_chat_matches_the_engine_and_counts_usage(server, client):
    r = client.chat.completions.create(model=server.model, messages=CHAT, temperature=0, max_tokens=12)
    ref = engine_answer(server.service, SamplingParams(temperature=0, max_tokens=12), messages=CHAT)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == ref.text
    assert ch.finish_reason == ref.finish_reason
    tok = server.service.llm.tokenizer
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    n_prompt = len(tok(text, add_special_tokens=False)["input_ids"])
    assert r.usage.prompt_tokens == n_prompt == ref.prompt_tokens
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == n_prompt + ref.completion_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream_equals_whole_answer_with_usage(server, client):
    kw = dict(model=server.model, messages=CHAT, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_are_the_greedy_maxima(server, client):
    r = client.chat.completions.create(model=server.model, messages=CHAT, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the most likely
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_n_seeded_choices_are_reproducible(server, client):
    kw = dict(model=server.model, messages=CHAT, temperature=1.0, max_tokens=8, n=3, seed=11,
              extra_body={"ignore_eos": True})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # each choice has its own seed
    assert a.usage.completion_tokens == 24


def test_stop_string_cuts_the_answer(server, client):
    kw = dict(model=server.model, messages=CHAT, temperature=0, max_tokens=12)
    full = client.chat.completions.create(**kw).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[:full.index(stop)]


def test_penalties_reach_the_sampler(server, client):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Repeat: la la la la la"}],
              temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    pen = client.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw)
    ref = engine_answer(server.service, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                       frequency_penalty=2.0, presence_penalty=2.0),
                        messages=kw["messages"])
    assert pen.choices[0].message.content == ref.text != plain


# -- completions ----------------------------------------------------------------------------------
def test_completions_whole_and_streamed(server, client):
    kw = dict(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=8)
    whole = client.completions.create(logprobs=2, **kw)
    ref = engine_answer(server.service, SamplingParams(temperature=0, max_tokens=8),
                        prompt="The capital of France is")
    c = whole.choices[0]
    assert c.text == ref.text and whole.usage.completion_tokens == ref.completion_tokens
    assert whole.usage.prompt_tokens == ref.prompt_tokens
    assert len(c.logprobs.tokens) == ref.completion_tokens == len(c.logprobs.top_logprobs)
    assert all(len(alts) == 2 for alts in c.logprobs.top_logprobs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == ref.completion_tokens


def test_max_tokens_capped_by_the_context_says_why(server, client):
    tok = server.service.llm.tokenizer
    prompt = "one two " * 245
    n_prompt = len(tok(prompt)["input_ids"])
    room = CONTEXT - n_prompt
    assert 0 < room < 40
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=100, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == room
    assert r.model_extra["warnings"] == [
        f"max_tokens 100 capped to {room}: the prompt's {n_prompt} tokens leave {room} of the "
        f"{CONTEXT}-token context"]
