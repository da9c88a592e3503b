"""Batch jobs inside the service: a JSONL file run by ``localgen.batch.run_batch`` on the
service's thread, at ``Priority.BATCH``, while chat requests keep arriving.

``run_batch`` drives a :class:`BatchEngine`, whose ``step()`` first serves the service's queue,
so an interactive request submitted mid-batch joins the next step and the scheduler admits it
first (``Priority.INTERACTIVE``; FineInfer, He et al. 2024, §3.3).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from localgen.runtime.metrics import Metrics
from localgen.runtime.request import Priority, Request, RequestOutput
from localgen.service.served import ServedLLM

__all__ = ["BatchCancelled", "BatchEngine", "BatchJob"]

_job_ids = itertools.count(1)


class BatchJob:
    """One JSONL batch run inside the service. ``state``: "queued" -> "running" -> "done" |
    "failed" | "cancelled". ``progress`` is the latest :class:`localgen.batch.BatchProgress`,
    ``summary`` the :class:`localgen.batch.BatchSummary` once it ends; times are perf_counter
    seconds."""

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

    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called (the job may still be stopping)."""
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def mark_done(self, now: float) -> None:
        """End the job at ``now`` (its ``state`` already set): wake waiters, tell ``on_done``."""
        self.finished_at = now
        self._done.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the engine
                pass


class BatchCancelled(KeyboardInterrupt):
    """Raised inside run_batch's loop to stop it; run_batch aborts its requests and re-raises
    it as BatchInterrupted (with the summary so far)."""


class BatchEngine:
    """What run_batch drives (a ``localgen.batch.runner.BatchLLM``): the LLM's surface, where ``step()`` first calls ``between_steps``
    (the service serving its queue; True when the service is closing) and then ``step``
    (the service's step, which routes chat outputs and records metrics)."""

    def __init__(self, llm: ServedLLM, job: BatchJob, between_steps: Callable[[], bool],
                 step: Callable[[], list[RequestOutput]]):
        self._llm, self._job = llm, job
        self._between_steps, self._step = between_steps, step
        self.model_name = llm.model_name
        self.max_model_len = llm.max_model_len
        self.token_limit = llm.token_limit
        self.max_prompt_bytes = llm.max_prompt_bytes  # the line cap, as `localgen batch` has it
        self.max_num_seqs = llm.max_num_seqs

    @property
    def metrics(self) -> Metrics:
        return self._llm.metrics

    def add_request(self, req: Request) -> str:
        req.priority = Priority.BATCH
        return self._llm.add_request(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self._llm.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._llm.has_unfinished()

    def step(self) -> list[RequestOutput]:
        closing = self._between_steps()
        if self._job.cancelled or closing:
            raise BatchCancelled()
        return self._step()
