"""RequestStream: the outputs of one request, handed from the engine thread to any reader.

The engine thread pushes each ``RequestOutput`` (or the request's error); a reader on any thread
iterates them blocking, or with ``async for`` on any event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Iterator, Protocol

from localgen.runtime.request import RequestOutput

__all__ = ["Aborter", "RequestStream", "ServiceClosed", "Wakeups", "wake"]

# event loop -> the events of the streams waiting on it
Wakeups = dict[asyncio.AbstractEventLoop, list[asyncio.Event]]


def wake(wakeups: Wakeups) -> None:
    """Set the waiting events, one ``call_soon_threadsafe`` per event loop however many streams
    wait on it: each call writes that loop's self-pipe (a system call, and a GIL handoff to the
    loop's thread), so a decode step that advances 16 streams pays for one, not 16. Empties
    ``wakeups``."""
    for loop, events in wakeups.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # that loop is closed; nobody waits there any more
            pass
    wakeups.clear()


def _set_all(events: list[asyncio.Event]) -> None:
    for ev in events:
        ev.set()


class Aborter(Protocol):
    """What a stream asks to stop its request: the service that runs it."""

    def abort(self, request_id: str) -> None: ...


class ServiceClosed(RuntimeError):
    """The service shut down before the request finished (or before it could be submitted)."""


class RequestStream:
    """The outputs of one request, in order, readable from any thread.

    Iterate it (blocking) or ``async for`` it (any event loop); both end after the finished
    output. A request the engine refused (bad sampling values, prompt too long) or a service
    that closed raises its exception from the iteration; it is also in ``error``.
    ``ttft`` is the time from the service's ``submit`` to the first generated token
    (queueing included), in seconds.
    """

    def __init__(self, request_id: str, service: Aborter | None = None):
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
    def _push(self, item: RequestOutput | BaseException, wakeups: Wakeups | None = None) -> None:
        """Hand ``item`` to the readers. ``wakeups``: where to add the waiting readers' events
        for the caller to ``wake`` later (with other streams'); None: wake them now."""
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
        pending: Wakeups = {} if wakeups is None else wakeups
        for loop, ev in waiters:
            pending.setdefault(loop, []).append(ev)
        if wakeups is None:
            wake(pending)

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
