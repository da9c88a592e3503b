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
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.total_tokens == whole.usage.total_tokens
    # the same prompt again: its whole blocks come from the prefix cache (16 tokens a block)
    assert last.usage.prompt_tokens_details.cached_tokens == 16 * ((whole.usage.prompt_tokens - 1) // 16)
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


# -- concurrency, disconnects, the bounded queue --------------------------------------------------
def test_32_concurrent_streams_finish_with_correct_usage(server):
    tok = server.service.llm.tokenizer
    questions = [f"Name a color number {i}." for i in range(32)]

    def prompt_tokens(q: str) -> int:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    async def one(client, q: str):
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=6, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage, reasons = "", None, []
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                reasons += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
            if c.usage is not None:
                usage = c.usage
        return text, usage, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", timeout=240,
                                      max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, q) for q in questions)), 300)

    results = asyncio.run(main())
    assert len(results) == 32
    for q, (text, usage, reasons) in zip(questions, results):
        assert reasons == ["length"] and text
        assert usage.completion_tokens == 6 and usage.prompt_tokens == prompt_tokens(q)
        assert usage.total_tokens == usage.prompt_tokens + 6
    assert server.app.state.generator.in_flight == 0


def _stream_lines(server, body, lines: int):
    """Open a streamed request, read ``lines`` SSE data lines, then drop the connection."""
    got = []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                    if len(got) == lines:
                        break
    return got


def test_dropped_client_frees_its_kv_blocks(server):
    body = dict(model=server.model, messages=CHAT, max_tokens=400, stream=True, temperature=0,
                ignore_eos=True)
    seen = {}

    def watch():  # read /metrics while the stream is open
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not seen.get("used"):
            seen["used"] = metric(server, "localgen_kv_blocks_used")
            time.sleep(0.05)

    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/chat/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines == 4:
                    watch()
                    break
    assert seen["used"] > 0
    deadline = time.monotonic() + 10
    while metric(server, "localgen_kv_blocks_used") > 0 or metric(server, "localgen_requests_running") > 0:
        assert time.monotonic() < deadline, "the dropped request still holds KV blocks"
        time.sleep(0.05)
    assert server.app.state.generator.in_flight == 0
    assert metric(server, 'localgen_http_requests_total{endpoint="chat",outcome="client_gone"}') >= 1


def test_full_queue_answers_429_with_retry_after(server, client):
    gen = server.app.state.generator
    gen.config.max_pending = 1
    try:
        body = dict(model=server.model, messages=CHAT, max_tokens=200, stream=True, ignore_eos=True)
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", server.url + "/chat/completions", json=body) as r:
                lines = r.iter_lines()  # kept: a closed iterator would drop the connection
                next(line for line in lines if line.startswith("data:"))
                with pytest.raises(openai.RateLimitError) as e:
                    client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
                assert e.value.response.headers["retry-after"] == "1"
                assert e.value.body["code"] == "rate_limit_exceeded"
    finally:
        gen.config.max_pending = 256
    deadline = time.monotonic() + 10
    while gen.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens >= 1


# -- bad requests ---------------------------------------------------------------------------------
M = "SmolLM2-135M-Instruct"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body (dict or raw bytes), status, param, code)
    ("/chat/completions", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("/chat/completions", b'[1, 2]', 400, None, "invalid_type"),
    ("/chat/completions", {"model": M}, 400, "messages", "missing_required_parameter"),
    ("/chat/completions", {"model": M, "messages": "hi"}, 400, "messages", "invalid_type"),
    ("/chat/completions", {"model": M, "messages": []}, 400, "messages", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "invalid_type"),
    ("/chat/completions", {"model": M, "messages": MSG, "temperature": "hot"}, 400, "temperature",
     "invalid_type"),
    ("/chat/completions", {"model": M, "messages": MSG, "temperature": 2.5}, 400, "temperature",
     "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "n": 0}, 400, "n", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "max_tokens": 0}, 400, "max_tokens",
     "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "max_tokens": 1.5}, 400, "max_tokens",
     "invalid_type"),
    ("/chat/completions", {"model": M, "messages": MSG, "presence_penalty": 3}, 400,
     "presence_penalty", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "stream": "yes"}, 400, "stream",
     "invalid_type"),
    ("/chat/completions", {"model": M, "messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format", "invalid_value"),
    ("/chat/completions", {"model": M, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice",
     "invalid_value"),
    ("/chat/completions", {"model": "gpt-4o", "messages": MSG}, 404, "model", "model_not_found"),
    ("/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi " * 600}]}, 400,
     "messages", "context_length_exceeded"),
    ("/completions", {"model": M, "prompt": []}, 400, "prompt", "invalid_value"),
    ("/completions", {"model": M, "prompt": [1, 10**9]}, 400, "prompt", "invalid_value"),
    ("/completions", {"model": M, "prompt": "hi", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ("/completions", {"model": M, "prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/completions", {"model": M, "prompt": "x" * (5 << 20)}, 413, None, "request_too_large"),
    ("/nothing", {"model": M}, 404, None, "unknown_url"),
]


def test_malformed_requests_get_openai_errors_and_disturb_no_one(server, client):
    assert server.model == M
    done = {}

    def good():  # a request in the batch while the bad ones arrive
        done["r"] = client.chat.completions.create(model=M, messages=CHAT, temperature=0,
                                                   max_tokens=24, extra_body={"ignore_eos": True})

    t = threading.Thread(target=good)
    t.start()
    failures = []
    with httpx.Client(timeout=60) as http:
        for path, body, status, param, code in BAD:
            kw = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            r = http.post(server.url + path, **kw)
            err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            ok = (r.status_code == status and isinstance(err, dict)
                  and set(err) == {"message", "type", "param", "code"}
                  and isinstance(err["message"], str) and err["message"]
                  and isinstance(err["type"], str) and err["param"] == param
                  and (code is None or err["code"] == code))
            if not ok:
                failures.append((path, str(body)[:80], r.status_code, r.text[:300]))
    t.join(120)
    assert not failures, failures
    assert done["r"].usage.completion_tokens == 24 and done["r"].choices[0].finish_reason == "length"


def test_api_key_is_required_when_configured(service):
    s = Served(create_app(service, ServerConfig(model_names=("m",), api_key="s3cret")))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url, api_key="wrong", max_retries=0).models.list()
        r = httpx.get(s.url + "/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.base + "/metrics").status_code == 401
        assert httpx.get(s.base + "/health").status_code == 200  # probes need no key
        good = openai.OpenAI(base_url=s.url, api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["m"]
    finally:
        s.stop()


def test_non_loopback_bind_is_refused_without_a_key(monkeypatch):
    from typer.testing import CliRunner

    from localgen.cli.main import app
    from localgen.cli.serve_cmd import check_bind

    monkeypatch.delenv("LOCALGEN_API_KEY", raising=False)
    r = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "--api-key" in r.output and "--no-auth" in r.output
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(host, None, False)
    for host in ("0.0.0.0", "192.168.1.7", "::", "example.org"):
        with pytest.raises(ValueError, match="--api-key"):
            check_bind(host, None, False)
        check_bind(host, "k", False)
        check_bind(host, None, True)


# -- structured output and tools ------------------------------------------------------------------
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {"lat": {"type": "number"},
                                                      "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
        "required": ["answer", "confidence"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                   "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(server, client, name, stream):
    import jsonschema

    schema = SCHEMAS[name]
    kw = dict(model=server.model, temperature=0, max_tokens=80,
              messages=[{"role": "user", "content": "Answer in JSON."}],
              response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    if stream:
        text = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_json_object_answer_is_json(server, client):
    # a prompt that asks for a short object: greedy decoding of a 135M model asked for an open
    # description can repeat a value until max_tokens, which says nothing about the grammar
    ask = "Give me a JSON object with the name and age of a cat."
    r = client.chat.completions.create(model=server.model, temperature=0, max_tokens=80,
                                       messages=[{"role": "user", "content": ask}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream,choice", [
    (False, {"type": "function", "function": {"name": "get_weather"}}),
    (True, {"type": "function", "function": {"name": "get_weather"}}),
    (False, "required")])
def test_forced_tool_call(server, client, stream, choice):
    import jsonschema

    kw = dict(model=server.model, temperature=0, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL],
              messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tool_choice=choice)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert reason == ["tool_calls"] and len(calls) == 1 and calls[0].index == 0
        fn = calls[0].function
    else:
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        assert len(ch.message.tool_calls) == 1 and ch.message.tool_calls[0].type == "function"
        assert ch.message.tool_calls[0].id.startswith("call_")
        fn = ch.message.tool_calls[0].function
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[fn.name]
    assert fn.name == "get_weather" or choice == "required"
    jsonschema.validate(json.loads(fn.arguments), tool["function"]["parameters"])
    # the answer goes back as a tool message: the conversation renders and continues
    follow = client.chat.completions.create(model=server.model, temperature=0, max_tokens=4, messages=[
        *kw["messages"],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": fn.name, "arguments": fn.arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}], tools=[WEATHER_TOOL])
    assert follow.usage.completion_tokens >= 1


def test_n_streamed_choices_equal_the_whole_ones(server, client):
    kw = dict(model=server.model, messages=CHAT, temperature=0.8, max_tokens=6, n=2, seed=5,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_dropped_whole_request_is_aborted_and_latencies_are_recorded(server):
    before = metric(server, "localgen_time_to_first_token_seconds_count")
    body = dict(model=server.model, messages=CHAT, max_tokens=400, temperature=0, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/chat/completions", json=body, timeout=3)
    deadline = time.monotonic() + 10
    while metric(server, "localgen_kv_blocks_used") > 0 or server.app.state.generator.in_flight:
        assert time.monotonic() < deadline, "the abandoned request still runs"
        time.sleep(0.05)
    assert metric(server, "localgen_time_to_first_token_seconds_count") == before + 1
    assert metric(server, "localgen_inter_token_latency_seconds_count") > 0


def test_auto_tool_choice_streams_plain_answers_unchanged(server, client):
    kw = dict(model=server.model, temperature=0, max_tokens=12, tools=[WEATHER_TOOL],
              messages=[{"role": "user", "content": "Say hello to Anna."}])
    whole = client.chat.completions.create(**kw).choices[0]
    text = "".join(c.choices[0].delta.content or ""
                   for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert whole.message.tool_calls is None and whole.message.content == text


def test_completions_several_prompts_times_n_count_each_prompt_once(server, client):
    tok = server.service.llm.tokenizer
    prompts = ["The sky is", "Two plus two equals"]
    r = client.completions.create(model=server.model, prompt=prompts, n=2, temperature=0,
                                  max_tokens=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in prompts)
    assert r.usage.completion_tokens == 12


def test_streamed_logprobs_equal_the_whole_ones(server, client):
    kw = dict(model=server.model, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == \
        [[a.token for a in t.top_logprobs] for t in whole]
