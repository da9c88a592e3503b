"""EngineService: one engine on one background thread, fed from any thread.

The ``LLM`` is not thread-safe, so one thread (the service's) owns it: it loads the model (when
given a loader), takes submissions, aborts and batch jobs from a queue, steps the engine, and
routes every ``RequestOutput`` to the stream of its request. Callers on any thread — a Textual UI,
a script, a test — read a :class:`RequestStream` (blocking iteration or ``async for``) and a
:class:`MetricsSnapshot` (latest one via :meth:`EngineService.metrics`, or pushed to listeners).

Batch jobs (a JSONL file through :func:`localgen.batch.run_batch`, at ``Priority.BATCH``) run on
the same thread through a proxy whose ``step()`` also serves the queue, so chat requests keep
arriving while a batch runs; the scheduler admits ``Priority.INTERACTIVE`` first (FineInfer §3.3).

No UI code lives here. Units: bytes, seconds, tokens/s, bytes/s (DESIGN.md "Shapes and units").
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from localgen.runtime.request import Priority, Request, RequestOutput, SamplingParams

__all__ = [
    "BatchJob", "EngineService", "GpuMemory", "MemorySnapshot", "MetricsSnapshot", "ModelInfo",
    "RequestStream", "ServiceClosed", "probe_memory",
]

_job_ids = itertools.count(1)


class ServiceClosed(RuntimeError):
    """The service shut down before the request finished (or before it could be submitted)."""


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------
class RequestStream:
    """The outputs of one request, in order, readable from any thread.

    Iterate it (blocking) or ``async for`` it (any event loop); both end after the finished
    output. A request the engine refused (bad sampling values, prompt too long) or a service
    that closed raises its exception from the iteration; it is also in ``error``.
    ``ttft`` is the time from :meth:`EngineService.submit` to the first generated token
    (queueing included), in seconds.
    """

    def __init__(self, request_id: str, service: "EngineService | None" = None):
        self.request_id = request_id
        self._service = service
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._ended = False  # the consumer has seen the end
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None
        self.text = ""
        self.cached_prompt_tokens = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    # -- producer side (the engine thread) ------------------------------------------------
    def _push(self, item: RequestOutput | BaseException) -> None:
        now = time.perf_counter()
        if isinstance(item, BaseException):
            self.error, self.finished_at = item, now
        else:
            if self.first_token_at is None and item.completion_tokens > 0:
                self.first_token_at = now
            self.text = item.text
            self.prompt_tokens, self.completion_tokens = item.prompt_tokens, item.completion_tokens
            self.cached_prompt_tokens = item.cached_prompt_tokens
            if item.finished:
                self.final, self.finished_at = item, now
        with self._lock:
            self._q.put(item)
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed; nobody waits there any more
                pass

    # -- consumer side --------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output (None after the last one, or on timeout). Raises the stream's error."""
        if self._ended:
            return None
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._take(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._ended:
            yield self._take(self._q.get())

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._ended:
                raise StopAsyncIteration
            with self._lock:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    ev = asyncio.Event()
                    self._waiters.append((asyncio.get_running_loop(), ev))
                    item = None
            if item is not None:
                return self._take(item)
            await ev.wait()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; its final output (raises its error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left == 0.0:
                raise TimeoutError(f"{self.request_id} did not finish in {timeout} s")
            self.get(timeout=left)
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final

    def abort(self) -> None:
        """Ask the service to stop this request (its blocks are freed; a final output with
        ``finish_reason == "abort"`` ends the stream)."""
        if self._service is not None:
            self._service.abort(self.request_id)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuMemory:
    """One GPU: device-wide figures from NVML (None without nvidia-ml-py) and this process's
    from torch.cuda."""

    name: str
    used_bytes: int | None
    total_bytes: int | None
    torch_allocated_bytes: int
    torch_reserved_bytes: int


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of the machine and of this process, in bytes. ``gpus`` is empty and ``gpu_note``
    says why (e.g. "no GPU") on a machine without one."""

    process_rss_bytes: int
    system_used_bytes: int
    system_total_bytes: int
    gpus: tuple[GpuMemory, ...] = ()
    gpu_note: str = ""
    offload_disk_bytes: int = 0  # tensors offloaded to disk (no disk tier yet: 0)


@dataclass(frozen=True)
class ModelInfo:
    """What the loaded model occupies and where. Shares are fractions of ``weight_bytes``."""

    name: str
    device: str  # "cpu", "cuda:0", ...
    dtype: str
    weight_bytes: int
    weights_gpu_share: float
    weights_cpu_share: float
    weights_disk_share: float
    kv_cache_bytes: int
    kv_bytes_per_token: int
    block_size: int
    # the cost model's peak bytes per tier ("gpu", "cpu", "disk") for the offloading policy the
    # model runs under, shown beside the measured memory; None without a policy
    predicted_peak: dict[str, float] | None = None

    @property
    def kv_tier(self) -> str:
        return "GPU" if self.device.startswith("cuda") else "CPU"


@dataclass(frozen=True)
class KVTier:
    name: str  # "GPU" / "CPU" / "disk"
    blocks_used: int
    blocks_total: int

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the memory and throughput panels show, at ``time`` (perf_counter seconds).

    Rates are over the recent window (``window_s`` of wall time, decode steps only for the
    decode figures). ``decode_history`` is tokens/s of each recent decode step (oldest first),
    for a sparkline. ``decode_bandwidth`` = bytes of weights + KV read per second of decode
    (Efficiently Scaling Transformer Inference: decode is memory bound); ``bandwidth_limit`` is
    the machine's measured memory bandwidth from a HardwareProfile (None when none is known).
    """

    time: float
    state: str  # "loading" | "ready" | "failed" | "closed"
    model: ModelInfo | None
    memory: MemorySnapshot | None
    decode_tokens_per_s: float = 0.0
    decode_history: tuple[float, ...] = ()
    prefill_tokens_per_s: float = 0.0
    ttft_last_s: float | None = None
    ttft_p50_s: float | None = None
    token_latency_p50_s: float | None = None
    token_latency_p90_s: float | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_tiers: tuple[KVTier, ...] = ()
    decode_bandwidth: float = 0.0  # bytes/s
    bandwidth_limit: float | None = None  # bytes/s
    bandwidth_limit_source: str = ""
    generation_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    window_s: float = 0.0

    @property
    def kv_blocks_used(self) -> int:
        return sum(t.blocks_used for t in self.kv_tiers)

    @property
    def kv_blocks_total(self) -> int:
        return sum(t.blocks_total for t in self.kv_tiers)

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


_nvml_state: dict[str, Any] = {}


def _nvml():
    """The pynvml module, initialised once; None when nvidia-ml-py or a driver is missing."""
    if "mod" not in _nvml_state:
        try:
            import pynvml

            pynvml.nvmlInit()
            _nvml_state["mod"] = pynvml
        except Exception as e:  # no library, no driver, no GPU
            _nvml_state["mod"], _nvml_state["why"] = None, str(e) or type(e).__name__
    return _nvml_state["mod"]


def probe_memory(process=None) -> MemorySnapshot:
    """Process RSS and system RAM (psutil); every visible GPU (NVML + torch.cuda) if any."""
    import psutil

    proc = process or psutil.Process()
    vm = psutil.virtual_memory()
    gpus: list[GpuMemory] = []
    note = ""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if cuda:
        nv = _nvml()
        for i in range(torch.cuda.device_count()):
            used = total = None
            if nv is not None:
                try:
                    info = nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i))
                    used, total = int(info.used), int(info.total)
                except Exception:
                    pass
            if total is None:
                free_b, total_b = torch.cuda.mem_get_info(i)
                used, total = int(total_b - free_b), int(total_b)
            gpus.append(GpuMemory(torch.cuda.get_device_name(i), used, total,
                                  int(torch.cuda.memory_allocated(i)),
                                  int(torch.cuda.memory_reserved(i))))
        if nv is None:
            note = "NVML unavailable: device totals from torch.cuda"
    else:
        note = "no GPU"
    return MemorySnapshot(int(proc.memory_info().rss), int(vm.total - vm.available), int(vm.total),
                          tuple(gpus), note)


def _percentile(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    k = min(len(sorted_vals) - 1, max(0, round(q * (len(sorted_vals) - 1))))
    return sorted_vals[k]


@dataclass
class _StepSample:
    t: float
    tokens: int
    seconds: float
    bytes_read: int = 0


class _MetricsTracker:
    """Turns the engine's cumulative counters into recent-window rates (engine thread only)."""

    def __init__(self, window_s: float = 3.0):
        self.window_s = window_s
        self.decode: deque[_StepSample] = deque(maxlen=512)
        self.prefill: deque[_StepSample] = deque(maxlen=64)
        self.history: deque[float] = deque(maxlen=120)
        self.prev = (0, 0.0, 0, 0.0)

    def after_step(self, m, outputs: list[RequestOutput], info: ModelInfo | None, now: float) -> None:
        dt, ds, pt, ps = m.decode_tokens, m.decode_seconds, m.prompt_tokens, m.prefill_seconds
        p_dt, p_ds, p_pt, p_ps = self.prev
        self.prev = (dt, ds, pt, ps)
        if dt > p_dt and ds > p_ds:
            bytes_read = 0
            if info is not None:
                ctx = sum(o.prompt_tokens + o.completion_tokens - 1 for o in outputs)
                bytes_read = info.weight_bytes + info.kv_bytes_per_token * ctx
            s = _StepSample(now, dt - p_dt, ds - p_ds, bytes_read)
            self.decode.append(s)
            self.history.append(s.tokens / s.seconds)
        if pt > p_pt and ps > p_ps:
            self.prefill.append(_StepSample(now, pt - p_pt, ps - p_ps))

    def rates(self, now: float) -> dict[str, Any]:
        recent = [s for s in self.decode if now - s.t <= self.window_s]
        secs = sum(s.seconds for s in recent)
        lat = sorted(s.seconds for s in list(self.decode)[-256:])
        pre = list(self.prefill)[-16:]
        pre_s = sum(s.seconds for s in pre)
        return dict(
            decode_tokens_per_s=(sum(s.tokens for s in recent) / secs) if secs else 0.0,
            decode_bandwidth=(sum(s.bytes_read for s in recent) / secs) if secs else 0.0,
            decode_history=tuple(self.history),
            prefill_tokens_per_s=(sum(s.tokens for s in pre) / pre_s) if pre_s else 0.0,
            token_latency_p50_s=_percentile(lat, 0.5),
            token_latency_p90_s=_percentile(lat, 0.9),
        )


# --------------------------------------------------------------------------------------------
# Batch jobs
# --------------------------------------------------------------------------------------------
class BatchJob:
    """One JSONL batch run inside the service. ``state``: "queued" -> "running" -> "done" |
    "failed" | "cancelled". ``progress`` is the latest :class:`localgen.batch.BatchProgress`,
    ``summary`` the :class:`localgen.batch.BatchSummary` once it ends."""

    def __init__(self, in_path, out_path, kwargs: dict[str, Any],
                 on_progress: Callable[["BatchJob"], None] | None,
                 on_done: Callable[["BatchJob"], None] | None):
        self.job_id = f"batch-job-{next(_job_ids)}"
        self.in_path, self.out_path, self.kwargs = str(in_path), str(out_path), kwargs
        self.on_progress, self.on_done = on_progress, on_done
        self.state = "queued"
        self.progress = None
        self.summary = None
        self.error: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._cancel = threading.Event()
        self._done = threading.Event()

    def cancel(self) -> None:
        """Stop the job at the next engine step: its queued requests are aborted; results
        already written stay in OUT (rerun to resume)."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()


class _BatchCancelled(KeyboardInterrupt):
    """Raised inside run_batch's loop to stop it; run_batch aborts its requests and re-raises
    it as BatchInterrupted (with the summary so far)."""


class _BatchEngine:
    """What run_batch drives: the LLM surface, where ``step()`` also serves the service queue so
    chat keeps flowing while the batch runs."""

    def __init__(self, service: "EngineService", job: BatchJob):
        self._svc, self._job, llm = service, job, service._llm
        self.model_name = getattr(llm, "model_name", "model")
        self.max_model_len = getattr(llm, "max_model_len", None)
        self.max_num_seqs = getattr(llm, "max_num_seqs", 64)
        self.metrics = getattr(llm, "metrics", None)

    def add_request(self, req: Request) -> str:
        req.priority = Priority.BATCH
        return self._svc._llm.add_request(req)

    def abort(self, request_id: str):
        return self._svc._llm.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._svc._llm.has_unfinished()

    def step(self) -> list[RequestOutput]:
        svc = self._svc
        svc._drain(block=False)
        if self._job._cancel.is_set() or svc._closing:
            raise _BatchCancelled()
        return svc._step()


# --------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------
class EngineService:
    """Owns one ``LLM`` (or a loader that builds it) on a background thread.

    ``llm``: a loaded ``localgen.api.LLM`` (or anything with its surface), or a zero-argument
    callable returning one, called on the service thread (``state`` is "loading" meanwhile;
    a failure leaves ``state == "failed"`` and ``error`` set). ``hardware``: an optional
    ``localgen.profiler.HardwareProfile`` whose memory bandwidth is shown beside the decode
    bandwidth. ``metrics_interval``: seconds between snapshots (also while idle).
    ``predicted_peak``: the cost model's peak bytes per tier for the model's offloading policy
    (``ModelInfo.predicted_peak``; the memory panel shows it beside the measured memory).
    Listeners get every snapshot on the service thread: keep them quick (post a message).
    """

    def __init__(self, llm: Any, *, hardware: Any = None, metrics_interval: float = 0.25,
                 window_s: float = 3.0, predicted_peak: dict[str, float] | None = None):
        if callable(llm) and not hasattr(llm, "step"):
            self._loader, self._llm = llm, None
        else:
            self._loader, self._llm = None, llm
        self.hardware = hardware
        self.predicted_peak = predicted_peak
        self.metrics_interval = metrics_interval
        self.state = "loading"
        self.error: BaseException | None = None
        self.model_info: ModelInfo | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._batches: deque[BatchJob] = deque()
        self.batch_jobs: list[BatchJob] = []
        self.active_batch: BatchJob | None = None
        self._tracker = _MetricsTracker(window_s)
        self._listeners: list[Callable[[MetricsSnapshot], None]] = []
        self._snapshot = MetricsSnapshot(time.perf_counter(), "loading", None, None)
        self._last_publish = 0.0
        self._closing = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="localgen-engine", daemon=True)
        self._proc = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "EngineService":
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.state != "loading"

    def __enter__(self) -> "EngineService":
        if not self.started:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded; raises the load error if loading failed; False on
        timeout."""
        if not self._ready.wait(timeout):
            return False
        if self.error is not None and self.state == "failed":
            raise self.error
        return self.state == "ready"

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread: running requests are aborted, queued ones end with ServiceClosed,
        a running batch job is cancelled."""
        self._closing = True
        self._inbox.put(("wake",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def llm(self) -> Any:
        """The LLM, for reading only from other threads (e.g. ``model_name``); never step it."""
        return self._llm

    # -- requests -----------------------------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Queue ``request``; returns its stream at once (errors surface on the stream)."""
        stream = RequestStream(request.request_id, self)
        if self._closing or self.state in ("failed", "closed"):
            stream._push(ServiceClosed(f"the engine is {self.state}" if self.state != "ready" else "closing"))
            return stream
        self._inbox.put(("submit", request, stream))
        return stream

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams | None = None,
             request_id: str | None = None) -> RequestStream:
        """Submit chat ``messages`` at ``Priority.INTERACTIVE``."""
        req = Request(messages=list(messages), sampling=sampling or SamplingParams(),
                      priority=Priority.INTERACTIVE)
        if request_id:
            req.request_id = request_id
        return self.submit(req)

    def abort(self, request_id: str) -> None:
        """Stop a request (frees its KV blocks); its stream ends with finish_reason "abort"."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> "queue.Queue":
        """Run ``fn(llm)`` on the service thread between steps; returns a queue that receives
        its result (or exception). For tests and tools that need a consistent view."""
        q: queue.Queue = queue.Queue(maxsize=1)
        self._inbox.put(("call", fn, q))
        return q

    # -- batch --------------------------------------------------------------------------------
    def submit_batch(self, in_path: str | os.PathLike, out_path: str | os.PathLike, *,
                     on_progress: Callable[[BatchJob], None] | None = None,
                     on_done: Callable[[BatchJob], None] | None = None,
                     **run_batch_kwargs: Any) -> BatchJob:
        """Run a JSONL file of jobs (native or OpenAI Batch lines) at ``Priority.BATCH``,
        results appended to ``out_path`` (resumable, see ``localgen.batch.run_batch``, whose
        keyword arguments pass through). Jobs run one after another; chat requests submitted
        meanwhile are scheduled first. Callbacks run on the service thread."""
        job = BatchJob(in_path, out_path, run_batch_kwargs, on_progress, on_done)
        self.batch_jobs.append(job)
        self._inbox.put(("batch", job))
        return job

    # -- metrics ------------------------------------------------------------------------------
    def metrics(self) -> MetricsSnapshot:
        """The latest snapshot (refreshed every ``metrics_interval`` s and after steps)."""
        return self._snapshot

    def add_metrics_listener(self, fn: Callable[[MetricsSnapshot], None]) -> None:
        self._listeners.append(fn)

    def remove_metrics_listener(self, fn: Callable[[MetricsSnapshot], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    # -- the service thread -------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._loader is not None:
                self._llm = self._loader()
            self.model_info = replace(_model_info(self._llm), predicted_peak=self.predicted_peak)
            self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - reported to the caller, not raised here
            self.error, self.state = e, "failed"
            self._ready.set()
            self._publish(force=True)
            self._fail_pending(e)
            return
        self._ready.set()
        self._publish(force=True)
        try:
            while not self._closing:
                busy = self._llm.has_unfinished() or bool(self._batches)
                self._drain(block=not busy)
                if self._closing:
                    break
                if self._batches:
                    self._run_batch(self._batches.popleft())
                elif self._llm.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as e:  # noqa: BLE001 - the engine failed: end every stream with it
            self.error = e
            self._fail_pending(e)
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> None:
        """Serve the inbox: everything queued, waiting up to ``metrics_interval`` if ``block``."""
        while True:
            try:
                item = self._inbox.get(timeout=self.metrics_interval) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = item[0]
            if kind == "submit":
                _, req, stream = item
                if self._closing:
                    stream._push(ServiceClosed("the service is closing"))
                    continue
                self._streams[req.request_id] = stream
                try:
                    self._llm.add_request(req)
                except Exception as e:  # ValueError, PromptTooLongError: the caller's to show
                    self._streams.pop(req.request_id, None)
                    stream._push(e)
            elif kind == "abort":
                out = self._llm.abort(item[1])
                if out is not None:
                    self._route([out])
            elif kind == "batch":
                self._batches.append(item[1])
            elif kind == "call":
                _, fn, q = item
                try:
                    q.put(fn(self._llm))
                except Exception as e:  # noqa: BLE001
                    q.put(e)

    def _step(self) -> list[RequestOutput]:
        outs = self._llm.step()
        now = time.perf_counter()
        self._tracker.after_step(self._llm.metrics, outs, self.model_info, now)
        self._route(outs)
        self._publish()
        return outs

    def _route(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # a batch request: run_batch reads it from step()'s return value
            if out.finished:
                del self._streams[out.request_id]
            stream._push(out)

    def _run_batch(self, job: BatchJob) -> None:
        from localgen.batch import BatchInterrupted, run_batch

        if job._cancel.is_set():
            job.state = "cancelled"
            self._end_job(job)
            return
        job.state, job.started_at, self.active_batch = "running", time.perf_counter(), job

        def progress(p) -> None:
            job.progress = p
            if job.on_progress is not None:
                job.on_progress(job)

        try:
            job.summary = run_batch(_BatchEngine(self, job), job.in_path, job.out_path,
                                    progress=progress, **job.kwargs)
            job.state = "done"
        except BatchInterrupted as e:
            job.summary, job.state = e.summary, "cancelled"
        except Exception as e:  # noqa: BLE001 - a bad file or OUT path: the job's error
            job.error, job.state = e, "failed"
        finally:
            self.active_batch = None
            self._end_job(job)

    def _end_job(self, job: BatchJob) -> None:
        job.finished_at = time.perf_counter()
        job._done.set()
        if job.on_done is not None:
            try:
                job.on_done(job)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                pass

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "submit":
                item[2]._push(ServiceClosed(f"the engine is not running: {err}"))
            elif item[0] == "batch":
                item[1].error, item[1].state = err, "failed"
                self._end_job(item[1])
            elif item[0] == "call":
                item[2].put(err)
        for rid, stream in list(self._streams.items()):
            stream._push(ServiceClosed(f"the engine stopped: {err}"))
        self._streams.clear()
        for job in list(self._batches):
            job.error, job.state = err, "failed"
            self._end_job(job)
        self._batches.clear()

    def _shutdown(self) -> None:
        if self._llm is not None:
            for rid in list(self._streams):
                try:
                    out = self._llm.abort(rid)
                except Exception:  # noqa: BLE001
                    out = None
                if out is not None:
                    self._route([out])
        self._fail_pending(ServiceClosed("the service closed"))
        for job in list(self._batches):
            job.state = "cancelled"
            self._end_job(job)
        self._batches.clear()
        self.state = "closed"
        self._publish(force=True)

    def _publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_publish < self.metrics_interval:
            return
        self._last_publish = now
        snap = self._build_snapshot(now)
        self._snapshot = snap
        for fn in list(self._listeners):
            try:
                fn(snap)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                pass

    def _build_snapshot(self, now: float) -> MetricsSnapshot:
        try:
            if self._proc is None:
                import psutil

                self._proc = psutil.Process()
            mem = probe_memory(self._proc)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            mem = None
        info = self.model_info
        limit, source = _bandwidth_limit(self.hardware, info)
        llm = self._llm
        m = getattr(llm, "metrics", None) if llm is not None else None
        if m is None or info is None:
            return MetricsSnapshot(now, self.state, info, mem, bandwidth_limit=limit,
                                   bandwidth_limit_source=source)
        ttfts = list(m.ttft_seconds)[-64:]
        return MetricsSnapshot(
            time=now, state=self.state, model=info, memory=mem,
            ttft_last_s=ttfts[-1] if ttfts else None,
            ttft_p50_s=_percentile(sorted(ttfts), 0.5),
            num_running=m.num_running, num_waiting=m.num_waiting,
            kv_tiers=(KVTier(info.kv_tier, m.kv_blocks_used, m.kv_blocks_total),),
            bandwidth_limit=limit, bandwidth_limit_source=source,
            generation_tokens=m.generation_tokens, prompt_tokens=m.prompt_tokens,
            cached_prompt_tokens=m.cached_prompt_tokens, num_preemptions=m.num_preemptions,
            window_s=self._tracker.window_s,
            **self._tracker.rates(now),
        )


def _tier_shares(llm: Any, on_gpu: bool) -> tuple[float, float, float]:
    """GPU/CPU/disk shares of what the model holds: from the offloading runtime's placement when
    a policy runs it, else everything on the model's device."""
    if getattr(llm, "policy", None) is not None and hasattr(llm, "memory_by_tier"):
        tiers = llm.memory_by_tier()
        total = sum(tiers.values()) or 1
        return tiers.get("gpu", 0) / total, tiers.get("cpu", 0) / total, tiers.get("disk", 0) / total
    return (1.0, 0.0, 0.0) if on_gpu else (0.0, 1.0, 0.0)


def _model_info(llm: Any) -> ModelInfo:
    """Where the model lives: the offloading policy's tiers, or the model's one device."""
    device = str(getattr(llm, "device", "cpu"))
    weight_bytes = int(getattr(llm, "weight_bytes", 0) or 0)
    on_gpu = device.startswith("cuda")
    gpu_share, cpu_share, disk_share = _tier_shares(llm, on_gpu)
    return ModelInfo(
        name=str(getattr(llm, "model_name", "model")), device=device,
        dtype=str(getattr(llm, "dtype", "")).replace("torch.", ""),
        weight_bytes=weight_bytes,
        weights_gpu_share=gpu_share, weights_cpu_share=cpu_share, weights_disk_share=disk_share,
        kv_cache_bytes=int(getattr(llm, "kv_cache_bytes", 0) or 0),
        kv_bytes_per_token=int(getattr(llm, "kv_bytes_per_token", 0) or 0),
        block_size=int(getattr(llm, "block_size", 16) or 16),
    )


def _bandwidth_limit(hw: Any, info: ModelInfo | None) -> tuple[float | None, str]:
    """The memory bandwidth decode can reach on the model's device, from a HardwareProfile."""
    if hw is None or info is None:
        return None, "no hardware profile (run `localgen profile`)"
    on_gpu = info.device.startswith("cuda")
    val = getattr(hw, "gpu_mem_bdw" if on_gpu else "cpu_mem_bdw", None)
    if not val:
        return None, f"profile {getattr(hw, 'name', '?')} has no {'GPU' if on_gpu else 'CPU'} memory bandwidth"
    return float(val), f"profile {getattr(hw, 'name', '?')}"
