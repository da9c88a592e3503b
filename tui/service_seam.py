"""ChatService: what the chat app asks of the engine service, as a Protocol.

``localgen.service.EngineService`` is the implementation; the tests' fake service implements the
same surface. The app reads only these members, so it never reaches the engine itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol, Sequence

from localgen.runtime.request import Request
from localgen.service import MetricsSnapshot, ModelInfo, RequestStream


class BatchJobView(Protocol):
    """A batch job as the batch screen shows it (``localgen.service.BatchJob``)."""

    job_id: str
    in_path: str
    out_path: str
    state: str  # "queued" | "running" | "done" | "failed" | "cancelled"
    progress: Any  # localgen.batch.BatchProgress, None before the first step
    summary: Any  # localgen.batch.BatchSummary, None until the job ends
    error: BaseException | None


class ChatService(Protocol):
    """The engine service's surface the chat app uses (``localgen.service.EngineService``)."""

    state: str  # "loading" | "ready" | "failed" | "closed"
    error: BaseException | None
    model_info: ModelInfo | None

    @property
    def started(self) -> bool: ...

    @property
    def batch_jobs(self) -> Sequence[BatchJobView]: ...

    def start(self) -> Any: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...

    def metrics(self) -> MetricsSnapshot: ...

    def add_metrics_listener(self, fn: Callable[[MetricsSnapshot], None]) -> None: ...

    def remove_metrics_listener(self, fn: Callable[[MetricsSnapshot], None]) -> None: ...

    def submit(self, request: Request) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def submit_batch(self, in_path: str | os.PathLike, out_path: str | os.PathLike, *,
                     on_progress: Callable[[Any], None] | None = None,
                     on_done: Callable[[Any], None] | None = None,
                     **run_batch_kwargs: Any) -> BatchJobView: ...
