"""A fake EngineService for the chat app's tests and snapshots: fixed numbers, scripted answers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from localgen.runtime.request import RequestOutput
from localgen.service import (GpuMemory, KVTier, MemorySnapshot, MetricsSnapshot, ModelInfo,
                              RequestStream)

MiB, GiB = 1 << 20, 1 << 30

INFO = ModelInfo(name="SmolLM2-135M-Instruct", device="cpu", dtype="float32",
                 weight_bytes=540 * MiB, weights_gpu_share=0.0, weights_cpu_share=1.0,
                 weights_disk_share=0.0, kv_cache_bytes=64 * MiB, kv_bytes_per_token=46080,
                 block_size=16)


def snapshot(*, gpu: bool = False, decode: float = 42.5, running: int = 1, used: int = 37,
             state: str = "ready") -> MetricsSnapshot:
    gpus = (GpuMemory("NVIDIA H100 80GB HBM3", 3 * GiB, 80 * GiB, int(1.5 * GiB), 2 * GiB),) if gpu else ()
    mem = MemorySnapshot(process_rss_bytes=812 * MiB, system_used_bytes=int(6.5 * GiB),
                         system_total_bytes=16 * GiB, gpus=gpus, gpu_note="" if gpu else "no GPU")
    info = INFO if not gpu else replace(INFO, device="cuda:0", dtype="bfloat16", weight_bytes=270 * MiB,
                                        weights_gpu_share=1.0, weights_cpu_share=0.0)
    return MetricsSnapshot(
        time=100.0, state=state, model=info, memory=mem, decode_tokens_per_s=decode,
        decode_history=tuple(float(20 + (i * 7) % 30) for i in range(40)),
        prefill_tokens_per_s=1530.0, ttft_last_s=0.084, ttft_p50_s=0.09,
        token_latency_p50_s=0.0231, token_latency_p90_s=0.0312, num_running=running,
        num_waiting=0, kv_tiers=(KVTier("GPU" if gpu else "CPU", used, 1456),), decode_bandwidth=23.4e9,
        bandwidth_limit=38.0e9, bandwidth_limit_source="profile cpu_2core",
    )


def output(rid: str, text: str, n: int, *, finished: bool = False, reason: str | None = None,
           delta: str = "", prompt: int = 30, cached: int = 0) -> RequestOutput:
    return RequestOutput(rid, delta, text, list(range(n)), finished, reason, prompt, n, cached)


class FakeJob:
    def __init__(self, in_path, out_path):
        self.job_id = "batch-job-1"
        self.in_path, self.out_path = str(in_path), str(out_path)
        self.state, self.progress, self.summary, self.error = "queued", None, None, None


class FakeService:
    """The EngineService surface the app uses. ``answers``: texts to stream, in order (each is
    split into words, one output per word). ``hold=True`` keeps streams open for the test to
    feed (``push``)."""

    def __init__(self, answers: list[str] | None = None, *, hold: bool = False,
                 state: str = "ready", error: BaseException | None = None, snap: MetricsSnapshot | None = None):
        self.answers = list(answers or ["Hello! **Paris** is the capital of France."])
        self.hold = hold
        self.state, self.error = state, error
        self.model_info = INFO if state == "ready" else None
        self.started = True
        self.snap = snap or snapshot(state=state)
        self.listeners: list[Any] = []
        self.requests: list[Any] = []
        self.streams: dict[str, RequestStream] = {}
        self.aborted: list[str] = []
        self.batch_jobs: list[FakeJob] = []
        self.closed = False
        self.turn = 0

    def start(self):
        return self

    def wait_ready(self, timeout=None) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def metrics(self) -> MetricsSnapshot:
        return self.snap

    def add_metrics_listener(self, fn) -> None:
        self.listeners.append(fn)

    def remove_metrics_listener(self, fn) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    def emit(self, snap: MetricsSnapshot) -> None:
        self.snap = snap
        for fn in list(self.listeners):
            fn(snap)

    def submit(self, req) -> RequestStream:
        self.requests.append(req)
        stream = RequestStream(req.request_id, self)
        self.streams[req.request_id] = stream
        if not self.hold:
            text = self.answers[min(self.turn, len(self.answers) - 1)]
            self.feed(stream, text, finish=True, cached=self.turn * 24)
            # fixed timings, so snapshots do not depend on the machine's speed
            stream.submitted_at, stream.first_token_at, stream.finished_at = 0.0, 0.084, 0.5
        self.turn += 1
        return stream

    def feed(self, stream: RequestStream, text: str, *, finish: bool, start: str = "", cached: int = 0) -> str:
        acc = start
        words = text.split(" ")
        for i, w in enumerate(words):
            piece = ("" if not acc else " ") + w
            acc += piece
            last = finish and i == len(words) - 1
            stream._push(output(stream.request_id, acc, len(acc.split(" ")), finished=last,
                                reason="stop" if last else None, delta=piece, cached=cached))
        return acc

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        s = self.streams.get(rid)
        if s is not None and not s.done:
            s._push(output(rid, s.text, s.completion_tokens, finished=True, reason="abort"))

    def submit_batch(self, in_path, out_path, on_progress=None, on_done=None, **kw) -> FakeJob:
        job = FakeJob(in_path, out_path)
        job.on_progress, job.on_done = on_progress, on_done  # the test moves the job along
        self.batch_jobs.append(job)
        return job
