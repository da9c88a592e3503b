"""``GET /metrics``: the engine and the server in Prometheus text format (prometheus-client).

Gauges and counters are read from the service's latest ``MetricsSnapshot`` when scraped (the
engine thread publishes one after every step that finishes a request and every abort, before
the request's stream ends, so a client sees its request counted and its KV blocks freed); the
TTFT and inter-token latency histograms are observed by the server as it streams each request's tokens,
so they include queueing and HTTP time, as a client sees it. Each server has its own registry.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from localgen.service import EngineService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the service's latest snapshot at scrape time (nothing while no model is loaded)."""

    def __init__(self, service: EngineService, in_flight: Callable[[], int]):
        self._service, self._in_flight = service, in_flight

    def collect(self):
        m = self._service.metrics()
        if m.model is None:
            return
        gauges = [
            ("localgen_requests_running", "Requests in the running batch.", m.num_running),
            ("localgen_requests_waiting", "Requests waiting for the running batch.", m.num_waiting),
            ("localgen_server_requests_in_flight",
             "HTTP generation requests admitted and not finished (the bounded queue).", self._in_flight()),
            ("localgen_kv_blocks_used", "KV cache blocks in use.", m.kv_blocks_used),
            ("localgen_kv_blocks_total", "KV cache blocks in all.", m.kv_blocks_total),
            ("localgen_decode_tokens_per_second",
             "Decode tokens per second of decode time, over the recent window.", m.decode_tokens_per_s),
            ("localgen_prefill_tokens_per_second",
             "Prompt tokens per second of prefill time, over recent prefills.", m.prefill_tokens_per_s),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = [
            ("localgen_prompt_tokens", "Prompt tokens computed by prefill.", m.prompt_tokens),
            ("localgen_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
             m.cached_prompt_tokens),
            ("localgen_generation_tokens", "Tokens generated.", m.generation_tokens),
            ("localgen_preemptions", "Sequences preempted for KV blocks.", m.num_preemptions),
            ("localgen_requests_finished", "Requests finished by the engine.", m.requests_finished),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    """The server's registry: the engine collector plus request histograms and counters."""

    def __init__(self, service: EngineService, in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(service, in_flight))
        self.ttft = Histogram("localgen_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("localgen_inter_token_latency_seconds",
                             "Seconds between consecutive generated tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.requests = Counter("localgen_http_requests", "Generation requests by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """Observes one request's TTFT and inter-token latencies as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, arrived: float | None = None):
        self._m = metrics
        self._arrived = time.perf_counter() if arrived is None else arrived
        self._last: float | None = None
        self._tokens = 0

    def update(self, completion_tokens: int) -> None:
        new = completion_tokens - self._tokens
        if new <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self._arrived)
            new -= 1
        elif new:
            gap = (now - self._last) / new  # tokens that arrived together share the gap
            for _ in range(new):
                self._m.itl.observe(gap)
        self._last, self._tokens = now, completion_tokens
