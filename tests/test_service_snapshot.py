"""MetricsSnapshot against a real engine run on the embedded model: its counts are what the
engine did (tokens the requests report, KV blocks of the block manager, requests finished)."""

from __future__ import annotations

import dataclasses

import pytest

from localgen.api import LLM
from localgen.runtime.request import Request, SamplingParams
from localgen.service import EngineService, MetricsSnapshot

MAX_TOKENS = (5, 9)


@pytest.fixture(scope="module")
def service():
    # a long interval: every figure read below comes from the snapshot published when a
    # request finished or was aborted, not from a periodic refresh
    svc = EngineService(lambda: LLM.load(kv_cache_memory=16 << 20), metrics_interval=60.0).start()
    assert svc.wait_ready(300)
    yield svc
    svc.close()


def _ask(service, text: str, max_tokens: int):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return service.chat([{"role": "user", "content": text}], sp)


def _engine_view(service):
    """The engine's own counters and block manager, read on the service thread."""
    def read(llm):
        m, bm = llm.metrics, llm.engine.block_manager
        return dict(generation_tokens=m.generation_tokens, prompt_tokens=m.prompt_tokens,
                    cached_prompt_tokens=m.cached_prompt_tokens, requests_finished=m.requests_finished,
                    num_preemptions=m.num_preemptions, blocks_total=bm.num_blocks,
                    blocks_used=bm.num_blocks - bm.num_free_blocks)
    return service.call(read).get(timeout=30)


def test_counts_equal_what_the_requests_did(service):
    before = service.metrics()
    outs = [_ask(service, f"Name {n} colours.", n).result(120) for n in MAX_TOKENS]
    snap = service.metrics()  # read at once: published before the last stream ended
    assert [o.completion_tokens for o in outs] == list(MAX_TOKENS)
    assert snap.requests_finished - before.requests_finished == len(MAX_TOKENS)
    assert snap.generation_tokens - before.generation_tokens == sum(MAX_TOKENS)
    computed = snap.prompt_tokens - before.prompt_tokens
    cached = snap.cached_prompt_tokens - before.cached_prompt_tokens
    assert computed + cached == sum(o.prompt_tokens for o in outs)
    assert cached == sum(o.cached_prompt_tokens for o in outs)
    assert snap.num_preemptions == 0 and snap.num_running == 0 and snap.num_waiting == 0
    engine = _engine_view(service)
    assert snap.kv_blocks_used == engine["blocks_used"] == 0
    assert snap.kv_blocks_total == engine["blocks_total"] > 0
    for field in ("generation_tokens", "prompt_tokens", "cached_prompt_tokens", "requests_finished"):
        assert getattr(snap, field) == engine[field], field


def test_rates_and_latencies_come_from_the_run(service):
    _ask(service, "Count to ten.", 12).result(120)
    snap = service.metrics()
    assert snap.state == "ready" and snap.ttft_last_s is not None and snap.ttft_last_s > 0
    assert snap.prefill_tokens_per_s > 0 and snap.decode_history
    assert 0 < snap.token_latency_p50_s <= snap.token_latency_p90_s
    assert snap.model is not None and snap.model.block_size == 16
    info = service.call(lambda llm: (llm.weight_bytes, llm.kv_cache_bytes)).get(timeout=30)
    assert (snap.model.weight_bytes, snap.model.kv_cache_bytes) == info
    assert snap.memory is not None and snap.memory.process_rss_bytes > 0


def test_an_abort_shows_its_freed_blocks_at_once(service):
    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = service.submit(Request(prompt="Once upon a time " * 20, sampling=sp))
    assert stream.get(timeout=120) is not None
    before_total = service.metrics().kv_blocks_total
    stream.abort()
    last = stream.result(60)
    snap = service.metrics()
    assert last.finish_reason == "abort"
    assert snap.kv_blocks_used == 0 and snap.kv_blocks_total == before_total
    assert snap.num_running == 0


def test_the_snapshot_is_frozen(service):
    snap: MetricsSnapshot = service.metrics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.num_running = 3  # type: ignore[misc]
