"""EngineService: one engine on one background thread, fed from any thread.

The ``LLM`` is not thread-safe, so one thread (the service's) owns it: it loads the model (when
given a loader), takes submissions, aborts and batch jobs from a queue, steps the engine, and
routes every ``RequestOutput`` to the stream of its request. Callers on any thread (a Textual
UI, the HTTP server, a script, a test) read a :class:`RequestStream` and a
:class:`MetricsSnapshot` (the latest via :meth:`EngineService.metrics`, or pushed to listeners).

Batch jobs (``localgen.service.batch_job``) run on the same thread, so chat requests keep
arriving while a batch runs. No UI code lives here. Units: bytes, seconds, tokens/s, bytes/s.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from localgen.batch import BatchInterrupted, run_batch
from localgen.runtime.request import Priority, Request, RequestOutput, SamplingParams
from localgen.service.batch_job import BatchEngine, BatchJob
from localgen.service.memory import probe_memory
from localgen.service.rates import MetricsTracker, build_snapshot, model_info
from localgen.service.served import ServedLLM
from localgen.service.snapshot import MemorySnapshot, MetricsSnapshot, ModelInfo
from localgen.service.stream import RequestStream, ServiceClosed, Wakeups, wake

if TYPE_CHECKING:
    from localgen.profiler.hardware import HardwareProfile

__all__ = ["EngineService"]

MetricsListener = Callable[[MetricsSnapshot], None]


class EngineService:
    """Owns one ``LLM`` (or a loader that builds it) on a background thread.

    ``llm``: a loaded ``localgen.api.LLM`` (any :class:`ServedLLM`), or a zero-argument
    callable returning one, called on the service thread (``state`` is "loading" meanwhile;
    a failure leaves ``state == "failed"`` and ``error`` set). ``hardware``: an optional
    ``HardwareProfile`` whose memory bandwidth is shown beside the decode bandwidth.
    ``metrics_interval``: seconds between snapshots (also while idle); a step that finishes a
    request and every abort publish one at once, before the request's stream ends.
    ``window_s``: seconds the decode rates average over. ``predicted_peak``: the cost model's
    peak bytes per tier for the model's offloading policy (``ModelInfo.predicted_peak``).
    Listeners get every snapshot on the service thread: keep them quick (post a message).
    """

    def __init__(self, llm: ServedLLM | Callable[[], ServedLLM], *,
                 hardware: HardwareProfile | None = None, metrics_interval: float = 0.25,
                 window_s: float = 3.0, predicted_peak: dict[str, float] | None = None):
        self._loader: Callable[[], ServedLLM] | None = llm if callable(llm) else None
        self._llm: ServedLLM | None = None if callable(llm) else llm
        self.hardware = hardware
        self.predicted_peak = predicted_peak
        self.metrics_interval = metrics_interval
        self.state = "loading"  # "loading" | "ready" | "failed" | "closed"
        self.error: BaseException | None = None
        self.model_info: ModelInfo | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._batches: deque[BatchJob] = deque()
        self.batch_jobs: list[BatchJob] = []
        self.active_batch: BatchJob | None = None
        self._tracker = MetricsTracker(window_s)
        self._listeners: list[MetricsListener] = []
        self._snapshot = MetricsSnapshot(time.perf_counter(), "loading", None, None)
        self._last_publish = 0.0
        self._closing = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="localgen-engine", daemon=True)
        self._proc = None  # psutil.Process, made on the service thread at the first snapshot
        # the memory probe runs at most once a metrics_interval: a forced publish (a finished
        # or aborted request) refreshes the engine's counters and reuses the last probe
        self._memory_snap: MemorySnapshot | None = None
        self._memory_at = float("-inf")
        # readers to wake for the outputs routed since the last wake; on CUDA they wait until
        # the next step's GPU work is queued (``_defer_wakeups``)
        self._wakeups: Wakeups = {}
        self._defer_wakeups = False
        self._early: list[RequestOutput] = []  # outputs routed inside the step (_after_launch)

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
    def llm(self) -> ServedLLM | None:
        """The LLM (None while loading), for reading constant properties (tokenizer, limits)
        from other threads; never step it."""
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

    def call(self, fn: Callable[[ServedLLM], Any]) -> "queue.Queue":
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

    def add_metrics_listener(self, fn: MetricsListener) -> None:
        self._listeners.append(fn)

    def remove_metrics_listener(self, fn: MetricsListener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    # -- the service thread -------------------------------------------------------------------
    def _main(self) -> None:
        if not self._load():
            return
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the engine failed: end every stream with it
            self.error = e
            self._fail_pending(e)
        finally:
            self._shutdown()

    def _load(self) -> bool:
        """Load the model (when given a loader); False when that failed (reported, not raised)."""
        try:
            if self._loader is not None:
                self._llm = self._loader()
            assert self._llm is not None
            self.model_info = model_info(self._llm, self.predicted_peak)
            self._defer_wakeups = self._hook_after_launch(self._llm)
            self.state = "ready"
        except BaseException as e:  # noqa: BLE001 - reported to the caller, not raised here
            self.error, self.state = e, "failed"
            self._ready.set()
            self._publish(force=True)
            self._fail_pending(e)
            return False
        self._ready.set()
        self._publish(force=True)
        return True

    def _hook_after_launch(self, llm: ServedLLM) -> bool:
        """Where the device computes asynchronously (CUDA), overlap a step's host work with the
        next step's device work: the engine builds a step's outputs once the next step is
        queued (``Engine.overlap_outputs``), and they are routed and their readers woken there
        (``Engine.after_launch``). The readers' threads (the server's event loop encoding and
        sending each token) then run while the device computes instead of contending for the
        GIL with the launch. On the CPU the model's work is the host's, so outputs are built
        and woken at once. True when overlapped."""
        engine = getattr(llm, "engine", None)
        if engine is None or not hasattr(engine, "after_launch") or not self._device_async(llm):
            return False
        engine.overlap_outputs = True
        engine.after_launch = self._after_launch
        return True

    @staticmethod
    def _device_async(llm: ServedLLM) -> bool:
        return llm.device.type == "cuda"

    def _after_launch(self, outs: list[RequestOutput]) -> None:
        """The previous step's outputs, built while this step's device work runs: routed and
        woken now (``_step`` routes the rest of the step's outputs)."""
        self._early = outs
        if outs:
            self._publish(force=any(o.finished for o in outs))  # counted before a stream ends
            self._route(outs)
        self._wake()

    def _wake(self) -> None:
        wake(self._wakeups)

    def _loop(self) -> None:
        llm = self._llm
        assert llm is not None
        while not self._closing:
            idle = not (llm.has_unfinished() or self._batches)
            if idle:
                self._wake()  # no next step will
            self._drain(block=idle)
            if self._closing:
                break
            if self._batches:
                self._run_batch(self._batches.popleft())
            elif llm.has_unfinished():
                self._step()
            self._publish()

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
                self._admit(item[1], item[2])
            elif kind == "abort":
                self._abort_now(item[1])
            elif kind == "batch":
                self._batches.append(item[1])
            elif kind == "call":
                self._call(item[1], item[2])

    def _between_batch_steps(self) -> bool:
        """Serve the inbox during a batch; True when the service is closing."""
        self._drain(block=False)
        return self._closing

    def _admit(self, req: Request, stream: RequestStream) -> None:
        if self._closing:
            stream._push(ServiceClosed("the service is closing"))
            return
        self._streams[req.request_id] = stream
        try:
            self._llm.add_request(req)
        except Exception as e:  # ValueError, PromptTooLongError: the caller's to show
            self._streams.pop(req.request_id, None)
            stream._push(e)

    def _abort_now(self, request_id: str) -> None:
        out = self._llm.abort(request_id)
        if out is not None:
            self._publish(force=True)  # freed KV blocks show before the stream ends
            self._route([out])

    def _call(self, fn: Callable[[ServedLLM], Any], q: queue.Queue) -> None:
        try:
            q.put(fn(self._llm))
        except Exception as e:  # noqa: BLE001 - the caller's error, handed back on its queue
            q.put(e)

    def _step(self) -> list[RequestOutput]:
        outs = self._llm.step()
        early, self._early = self._early, []
        self._tracker.after_step(self._llm.metrics, outs, self.model_info, time.perf_counter())
        late = outs[len(early):]  # the step's outputs lead with those routed inside it
        self._publish(force=any(o.finished for o in late))  # counted before a stream ends
        self._route(late)
        return outs

    def _route(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # a batch request: run_batch reads it from step()'s return value
            if out.finished:
                del self._streams[out.request_id]
            stream._push(out, self._wakeups)
        if not self._defer_wakeups:
            self._wake()

    def _run_batch(self, job: BatchJob) -> None:
        if job.cancelled:
            job.state = "cancelled"
            job.mark_done(time.perf_counter())
            return
        job.state, job.started_at, self.active_batch = "running", time.perf_counter(), job

        def progress(p) -> None:
            job.progress = p
            if job.on_progress is not None:
                job.on_progress(job)

        engine = BatchEngine(self._llm, job, self._between_batch_steps, self._step)
        try:
            job.summary = run_batch(engine, job.in_path, job.out_path, progress=progress, **job.kwargs)
            job.state = "done"
        except BatchInterrupted as e:
            job.summary, job.state = e.summary, "cancelled"
        except Exception as e:  # noqa: BLE001 - a bad file or OUT path: the job's error
            job.error, job.state = e, "failed"
        finally:
            self.active_batch = None
            job.mark_done(time.perf_counter())

    def _fail_job(self, job: BatchJob, err: BaseException) -> None:
        job.error, job.state = err, "failed"
        job.mark_done(time.perf_counter())

    def _fail_pending(self, err: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "submit":
                item[2]._push(ServiceClosed(f"the engine is not running: {err}"))
            elif item[0] == "batch":
                self._fail_job(item[1], err)
            elif item[0] == "call":
                item[2].put(err)
        for stream in self._streams.values():
            stream._push(ServiceClosed(f"the engine stopped: {err}"))
        self._streams.clear()
        for job in self._batches:
            self._fail_job(job, err)
        self._batches.clear()

    def _shutdown(self) -> None:
        self._defer_wakeups = False
        self._wake()
        if self._llm is not None:
            for rid in list(self._streams):
                try:
                    out = self._llm.abort(rid)
                except Exception:  # noqa: BLE001 - a broken engine: the stream ends below
                    out = None
                if out is not None:
                    self._route([out])
        self._fail_pending(ServiceClosed("the service closed"))
        self.state = "closed"
        self._publish(force=True)

    def _publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last_publish < self.metrics_interval:
            return
        self._last_publish = now
        llm = self._llm
        snap = build_snapshot(now, self.state, self.model_info, self._memory(now),
                              llm.metrics if llm is not None else None, self._tracker, self.hardware)
        self._snapshot = snap
        for fn in list(self._listeners):
            try:
                fn(snap)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                pass

    def _memory(self, now: float) -> MemorySnapshot | None:
        if now - self._memory_at < self.metrics_interval:
            return self._memory_snap
        self._memory_at = now
        try:
            if self._proc is None:
                import psutil

                self._proc = psutil.Process()
            self._memory_snap = probe_memory(self._proc)
        except Exception:  # noqa: BLE001 - metrics must never stop the engine
            self._memory_snap = None
        return self._memory_snap
