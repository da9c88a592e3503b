"""EngineService: the engine on its own thread, streams, abort, batch beside chat, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from localgen.api import LLM
from localgen.conversation import Conversation
from localgen.runtime.request import Request, SamplingParams
from localgen.service import EngineService, MetricsSnapshot, RequestStream, ServiceClosed
from tests.tiny_models import make_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("svc"), "smollm")


@pytest.fixture
def service(model_dir):
    svc = EngineService(lambda: LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22),
                        metrics_interval=0.05).start()
    assert svc.wait_ready(60)
    yield svc
    svc.close()


def test_stream_matches_direct_generate(service, model_dir):
    msgs = [{"role": "user", "content": "hello world"}]
    outs = list(service.chat(msgs, GREEDY))
    assert outs[-1].finished and outs[-1].completion_tokens == 8
    assert "".join(o.text_delta for o in outs) == outs[-1].text
    direct = LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22)
    want = direct.generate([Request(messages=msgs, sampling=GREEDY)])[0]
    assert outs[-1].token_ids == want.token_ids


def test_async_iteration_from_another_loop(service):
    async def consume():
        got = []
        async for out in service.chat([{"role": "user", "content": "the quick brown fox"}], GREEDY):
            got.append(out)
        return got

    got = asyncio.run(consume())
    assert got[-1].finished and got[-1].completion_tokens == 8


def test_submissions_from_many_threads(service):
    results = {}

    def worker(i):
        results[i] = service.chat([{"role": "user", "content": f"one two {i}"}], GREEDY).result(30)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r.completion_tokens == 8 for r in results.values())


def test_abort_mid_answer_frees_blocks(service):
    stream = service.chat([{"role": "user", "content": "hello"}],
                          SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    first = stream.get(timeout=30)
    assert first is not None and not first.finished
    stream.abort()
    last = stream.result(30)
    assert last.finish_reason == "abort" and last.completion_tokens < 200
    used = service.call(lambda llm: llm.metrics.kv_blocks_used).get(timeout=10)
    assert used == 0


def test_bad_request_errors_on_its_stream(service):
    stream = service.submit(Request(prompt="hi", sampling=SamplingParams(temperature=-1)))
    with pytest.raises(ValueError, match="temperature"):
        stream.result(10)
    # the service keeps working
    assert service.chat([{"role": "user", "content": "hi"}], GREEDY).result(30).finished


def test_metrics_snapshot(service):
    snaps: list[MetricsSnapshot] = []
    service.add_metrics_listener(snaps.append)
    service.chat([{"role": "user", "content": "a b c"}],
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)).result(30)
    time.sleep(0.2)
    service.remove_metrics_listener(snaps.append)
    s = service.metrics()
    assert s.state == "ready" and s.model is not None
    assert s.model.device == "cpu" and s.model.weights_cpu_share == 1.0 and s.model.weight_bytes > 0
    assert s.memory is not None and s.memory.process_rss_bytes > 0 and s.memory.system_total_bytes > 0
    if not s.memory.gpus:
        assert s.memory.gpu_note == "no GPU"
    assert s.kv_blocks_total > 0 and s.kv_blocks_free == s.kv_blocks_total  # nothing running now
    assert any(x.decode_tokens_per_s > 0 for x in snaps)
    assert s.decode_history and all(v > 0 for v in s.decode_history)
    assert s.token_latency_p50_s is not None and s.token_latency_p90_s >= s.token_latency_p50_s
    assert s.ttft_last_s is not None and s.prefill_tokens_per_s > 0
    assert any(x.decode_bandwidth > s.model.weight_bytes for x in snaps)  # >= 1 weight read/s
    assert s.bandwidth_limit is None and "profile" in s.bandwidth_limit_source


def test_bandwidth_limit_from_profile(model_dir):
    from localgen.profiler import load_profile

    hw = load_profile("flexgen_t4")
    svc = EngineService(LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22), hardware=hw).start()
    try:
        svc.wait_ready(30)
        time.sleep(0.1)
        s = svc.metrics()
        if hw.cpu_mem_bdw:
            assert s.bandwidth_limit == hw.cpu_mem_bdw
        else:
            assert s.bandwidth_limit is None and "no CPU memory bandwidth" in s.bandwidth_limit_source
    finally:
        svc.close()


def test_load_failure_is_reported():
    svc = EngineService(lambda: LLM.load("/nonexistent/model/dir")).start()
    with pytest.raises(Exception):
        svc.wait_ready(30)
    assert svc.state == "failed" and svc.error is not None
    with pytest.raises(ServiceClosed):
        svc.chat([{"role": "user", "content": "hi"}]).result(5)
    svc.close()


def test_close_ends_running_streams(model_dir):
    svc = EngineService(LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22)).start()
    stream = svc.chat([{"role": "user", "content": "hi"}],
                      SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    assert stream.get(timeout=30) is not None
    svc.close()
    assert stream.result(10).finish_reason in ("abort", "length")
    assert svc.state == "closed"


def test_batch_beside_chat_chat_first(service, tmp_path):
    n = 12
    lines = [json.dumps({"id": f"q{i}", "prompt": f"one two three {i}", "max_tokens": 24,
                         "temperature": 0, "ignore_eos": True}) for i in range(n)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    progress = []
    job = service.submit_batch(src, out, on_progress=lambda j: progress.append(j.progress.done))
    # wait until the batch is generating, then ask a chat question
    deadline = time.monotonic() + 30
    while (job.progress is None or job.progress.tokens == 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.state == "running"
    chat = service.chat([{"role": "user", "content": "hello"}], GREEDY)
    chat.result(60)
    first_token = chat.first_token_at
    assert job.wait(120) and job.state == "done", job.error
    assert job.summary.done == n and len(out.read_text().splitlines()) == n
    assert first_token < job.finished_at, "the chat answer's first token came after the batch ended"
    assert progress and progress[-1] == n


def test_batch_cancel_and_bad_path(service, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": "x", "max_tokens": 200, "ignore_eos": True})
                             for i in range(40)) + "\n")
    job = service.submit_batch(src, tmp_path / "out.jsonl")
    deadline = time.monotonic() + 30
    while job.state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    job.cancel()
    assert job.wait(30) and job.state == "cancelled" and job.summary is not None
    bad = service.submit_batch(tmp_path / "missing.jsonl", tmp_path / "o2.jsonl")
    assert bad.wait(30) and bad.state == "failed" and bad.error is not None
    assert service.call(lambda llm: llm.has_unfinished()).get(timeout=10) is False


def test_conversation_reuses_prefix(service, tmp_path):
    conv = Conversation(sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for i, q in enumerate(["hello world", "what is the capital", "one two three"]):
        stream = service.submit(conv.ask(q))
        assert stream  # noqa
        out = stream.result(30)
        assert stream.ttft is not None and stream.ttft > 0
        conv.record_answer(out, ttft_s=stream.ttft)
    cached = [t.cached_prompt_tokens for t in conv.turns if t.role == "assistant"]
    prompts = [t.prompt_tokens for t in conv.turns if t.role == "assistant"]
    assert cached[0] < 16 and cached[2] >= prompts[1] - 16, (cached, prompts)
    paths = conv.save(tmp_path / "t.md")
    assert paths[0].read_text().count("## Assistant") == 3
    assert json.loads(paths[1].read_text())["turns"][1]["role"] == "assistant"


def test_stream_unit_async_wakeup():
    """The async iterator wakes when another thread pushes (no polling)."""
    from localgen.runtime.request import RequestOutput

    stream = RequestStream("r")

    def later():
        time.sleep(0.05)
        stream._push(RequestOutput("r", "a", "a", [1], False, None, 3, 1))
        stream._push(RequestOutput("r", "b", "ab", [1, 2], True, "stop", 3, 2))

    async def consume():
        threading.Thread(target=later).start()
        return [o.text async for o in stream]

    assert asyncio.run(asyncio.wait_for(consume(), 5)) == ["a", "ab"]
    assert stream.final.finish_reason == "stop" and stream.ttft is not None


def test_predicted_peak_reaches_the_model_info(model_dir):
    """The memory panel shows the policy's predicted peak per tier beside the measured memory:
    the service carries it into ``ModelInfo`` (None without a policy)."""
    peak = {"gpu": 0.0, "cpu": 3.5 * 2**30, "disk": 0.0}
    svc = EngineService(LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22),
                        predicted_peak=peak).start()
    try:
        svc.wait_ready(30)
        assert svc.model_info.predicted_peak == peak
        deadline = time.time() + 10
        while svc.metrics().model is None and time.time() < deadline:  # the first snapshot
            time.sleep(0.05)
        assert svc.metrics().model.predicted_peak == peak
    finally:
        svc.close()


def test_pushes_with_shared_wakeups_wake_each_loop_once_when_told():
    """Outputs pushed with a shared ``wakeups`` reach their async readers only at ``wake``, which
    schedules one callback on their loop for both streams (not one per stream)."""
    from localgen.runtime.request import RequestOutput
    from localgen.service.stream import wake

    streams = [RequestStream("a"), RequestStream("b")]
    wakeups: dict = {}
    calls = []

    async def consume():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        readers = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0.01)  # both wait on an event now

        def engine_thread():
            for s in streams:
                s._push(RequestOutput(s.request_id, "x", "x", [1], True, "stop", 3, 1), wakeups)

        threading.Thread(target=engine_thread).start()
        await asyncio.sleep(0.05)
        assert not any(r.done() for r in readers)  # pushed, not woken
        waker = threading.Thread(target=wake, args=(wakeups,))
        waker.start()
        got = [(await asyncio.wait_for(r, 5)).request_id for r in readers]
        waker.join(5)
        return got

    assert asyncio.run(consume()) == ["a", "b"]
    assert len(calls) == 1 and not wakeups


def test_overlapped_outputs_end_every_stream(model_dir, monkeypatch):
    """With the CUDA ordering forced on the CPU (a step's outputs built, routed and woken at
    the next step's launch, or when the engine goes idle), concurrent streams all finish with
    the tokens and text of a service that builds and wakes them at once."""
    def run(defer: bool) -> list[tuple[list[int], str, str]]:
        monkeypatch.setattr(EngineService, "_device_async", staticmethod(lambda llm: defer))
        svc = EngineService(lambda: LLM.load(str(model_dir), device="cpu",
                                             kv_cache_memory=1 << 22)).start()
        try:
            assert svc.wait_ready(60) and svc._defer_wakeups == defer

            async def consume(i):
                msgs = [{"role": "user", "content": f"count {i} {i + 1}"}]
                outs = [o async for o in svc.chat(msgs, GREEDY)]
                assert "".join(o.text_delta for o in outs) == outs[-1].text
                return outs[-1].token_ids, outs[-1].text, outs[-1].finish_reason

            async def all_of():
                return await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(4))), 60)

            return asyncio.run(all_of())
        finally:
            svc.close()

    plain = run(False)
    assert run(True) == plain
