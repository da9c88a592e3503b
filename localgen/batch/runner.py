"""Run a JSONL file of jobs through the engine, appending each result as it finishes.

The engine is any :class:`BatchLLM` (``localgen.api.LLM``, the engine service's batch engine,
the tests' fakes). Jobs are submitted through a bounded window (the file is never tokenized up
front), the engine is stepped (continuous batching, Orca), and every finished request is written
to OUT at once (see :mod:`localgen.batch.jsonl_io` for the resume rule). One run writes an OUT
at a time (:class:`~localgen.batch.output_lock.OutputLock`), and input lines too long for the
model's context are rejected before they are parsed (:func:`line_byte_limit`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from localgen.batch.formats import Job, LineError, parse_lines
from localgen.batch.jsonl_io import (
    DEFAULT_MAX_LINE_BYTES,
    JsonlWriter,
    OutputState,
    error_identity,
    iter_input_lines,
    scan_output,
)
from localgen.batch.output_lock import OutputLock, lock_path
from localgen.runtime.request import PromptTooLongError, Request, RequestOutput


class EngineRates(Protocol):
    """The engine's counters, as far as progress reads them (``localgen.runtime.metrics.Metrics``)."""

    @property
    def generation_tokens_per_s(self) -> float: ...


class BatchLLM(Protocol):
    """The engine surface :func:`run_batch` drives (``localgen.api.LLM``). Lengths in tokens.

    ``max_prompt_bytes``: UTF-8 bytes of prompt text past which a prompt cannot fit
    ``token_limit`` (None or 0: no such bound is known; lines get ``DEFAULT_MAX_LINE_BYTES``).
    ``metrics.generation_tokens_per_s`` (0 when unknown) is the throughput progress shows.
    """

    model_name: str

    @property
    def max_model_len(self) -> int: ...

    @property
    def token_limit(self) -> int: ...

    @property
    def max_prompt_bytes(self) -> int | None: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def metrics(self) -> EngineRates: ...

    def add_request(self, req: Request) -> str: ...

    def abort(self, request_id: str) -> Any: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...


@dataclass
class BatchProgress:
    """A snapshot for progress displays. ``total`` counts the jobs this run has to do (input
    lines within ``limit`` minus those already done in OUT); ``done + failed`` of them are over."""

    total: int
    done: int
    failed: int
    skipped_resume: int
    tokens: int  # completion tokens generated so far this run (including unfinished requests)
    elapsed: float  # seconds
    tokens_per_s: float  # generation throughput (engine's own figure when it publishes one)


@dataclass
class BatchSummary:
    """The outcome of one :func:`run_batch`.

    ``total``: non-blank input lines considered (within ``limit``); ``done``: results written
    this run; ``skipped_resume``: jobs already done in OUT; ``failed``: bad lines (including
    ones whose identical error record OUT already held); ``tokens``: completion tokens of the
    results written; ``seconds``: wall time.
    """

    total: int
    done: int
    skipped_resume: int
    failed: int
    tokens: int
    seconds: float
    prompt_tokens: int = 0
    interrupted: bool = False
    errors: list[LineError] = field(default_factory=list)  # the first few, for display

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or another KeyboardInterrupt) during :func:`run_batch`; ``summary`` says what was
    written before it. Everything reported done is on disk; rerun the same command to resume."""

    def __init__(self, summary: BatchSummary):
        super().__init__("batch interrupted")
        self.summary = summary


ProgressCallback = Callable[[BatchProgress], None]
_MAX_ERRORS_KEPT = 20
# A line's other fields (id, sampling, message wrappers, metadata a data set carries) beside its
# prompt text, in bytes.
_LINE_ALLOWANCE = 64 * 2**10
# JSON text per byte of prompt, at worst: a \uXXXX escape is 6 bytes for one byte of text.
_ESCAPE_FACTOR = 6


def line_byte_limit(llm: BatchLLM, max_line_bytes: int | None = None) -> tuple[int, str]:
    """``(cap, note)``: the most bytes one input line may have, and why (for the error message).

    ``max_line_bytes`` wins when given. Otherwise, from the engine's ``max_prompt_bytes`` (the
    most UTF-8 bytes of prompt text that can fit its context): a line holding a prompt that fits
    is at most ``6 × max_prompt_bytes`` of JSON-escaped text plus 64 KiB of other fields.
    When it is None: ``DEFAULT_MAX_LINE_BYTES`` (16 MiB).
    """
    if max_line_bytes is not None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes={max_line_bytes} must be >= 1")
        return max_line_bytes, ""
    prompt_bytes = llm.max_prompt_bytes
    if prompt_bytes is None or prompt_bytes <= 0:
        return DEFAULT_MAX_LINE_BYTES, ""
    note = f": the model's context of {llm.token_limit} tokens holds at most {prompt_bytes} bytes of prompt"
    return prompt_bytes * _ESCAPE_FACTOR + _LINE_ALLOWANCE, note


def _limited(it: Iterator[tuple[int, Any]], limit: int | None) -> Iterator[tuple[int, Any]]:
    return it if limit is None else itertools.islice(it, limit)


def _jobs(
    in_path: str | os.PathLike[str], limit: int | None, line_cap: tuple[int, str]
) -> Iterator[Job | LineError]:
    """Jobs and bad lines of the first ``limit`` non-blank input lines, in file order.

    One :func:`parse_lines` stream sees every line (it keeps the duplicate-id state); a line
    that is not UTF-8 or longer than ``line_cap`` (bytes, note) goes through it as a placeholder
    and comes out as its own error.
    """
    undecodable: dict[int, LineError] = {}
    lines = iter_input_lines(in_path, max_line_bytes=line_cap[0], limit_note=line_cap[1])

    def texts() -> Iterator[tuple[int, str]]:
        for line_no, text in _limited(lines, limit):
            if isinstance(text, LineError):
                undecodable[line_no] = text
                yield line_no, ""  # parses as a LineError, swapped for the real one below
            else:
                yield line_no, text

    for item in parse_lines(texts()):
        if isinstance(item, LineError) and item.line_no in undecodable:
            yield undecodable.pop(item.line_no)
        else:
            yield item


def run_batch(
    llm: BatchLLM,
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    max_tokens: int | None = None,
    default_sampling: dict[str, Any] | None = None,
    raw_prompts: bool = False,
    max_in_flight: int | None = None,
    progress: ProgressCallback | None = None,
    max_line_bytes: int | None = None,
    output_lock: OutputLock | None = None,
) -> BatchSummary:
    """Generate a result for every job of IN and append it to OUT.

    ``limit``: only the first ``limit`` non-blank input lines (good or bad) are considered.
    ``max_tokens``: caps every job's max_tokens (and is the default where a line sets none).
    ``default_sampling``: SamplingParams fields for jobs that do not set them (e.g.
    ``{"temperature": 0.0, "seed": 1}``). ``raw_prompts``: send native ``prompt`` text as is
    instead of as a user chat turn. ``max_in_flight``: most jobs queued in the engine at once
    (default 2 × ``llm.max_num_seqs``, at least 16). ``progress`` is called after every engine step
    and every result. ``max_line_bytes``: the cap on one input line's bytes (default: from
    ``llm.max_prompt_bytes``, see :func:`line_byte_limit`); a longer line is a bad line, skipped
    unread. ``output_lock``: OUT's lock when the caller already holds it (the CLI takes it before
    loading the model); without it the run takes its own and drops it at the end.

    Returns a :class:`BatchSummary`; a KeyboardInterrupt aborts the queued requests and is
    re-raised as :class:`BatchInterrupted` carrying the summary so far. Raises
    :class:`~localgen.batch.output_lock.OutputLocked` when another run is writing OUT,
    :class:`~localgen.batch.output_lock.OutputError` when OUT cannot be written, ValueError for a
    bad argument.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    line_cap = line_byte_limit(llm, max_line_bytes)
    if output_lock is not None and not (output_lock.held and output_lock.path == lock_path(out_path)):
        raise ValueError(f"output_lock must be a held lock on {out_path}, not on {output_lock.out_path}")
    held = OutputLock.acquire(out_path) if output_lock is None else contextlib.nullcontext(output_lock)
    with held:
        return _run_locked(llm, in_path, out_path, limit, max_tokens, default_sampling, raw_prompts,
                           max_in_flight, progress, line_cap)


def _run_locked(llm: BatchLLM, in_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                limit: int | None, max_tokens: int | None, default_sampling: dict[str, Any] | None,
                raw_prompts: bool, max_in_flight: int | None, progress: ProgressCallback | None,
                line_cap: tuple[int, str]) -> BatchSummary:
    """:func:`run_batch` once OUT is locked."""
    t0 = time.perf_counter()
    try:
        state, total, todo = _plan(in_path, out_path, limit, line_cap)
    except KeyboardInterrupt:  # before any job ran: nothing was written
        seconds = time.perf_counter() - t0
        empty = BatchSummary(total=0, done=0, skipped_resume=0, failed=0, tokens=0, seconds=seconds, interrupted=True)
        raise BatchInterrupted(empty) from None
    options = dict(defaults=default_sampling, max_tokens_cap=max_tokens, raw_prompts=raw_prompts)
    run = _BatchRun(llm, out_path, state, total, todo, t0, progress, options)
    return run.run(_jobs(in_path, limit, line_cap), max_in_flight or max(2 * llm.max_num_seqs, 16))


class _BatchRun:
    """One run's state: the jobs in the engine, the summary, OUT's writer and known results."""

    def __init__(self, llm: BatchLLM, out_path: str | os.PathLike[str], state: OutputState,
                 total: int, todo: int, t0: float, progress: ProgressCallback | None,
                 request_options: dict[str, Any]):
        """``request_options``: the keyword arguments of ``Job.to_request`` beside the id."""
        self.llm, self.state, self.todo, self.t0, self.progress = llm, state, todo, t0, progress
        self.model = llm.model_name
        self.run_tag = uuid.uuid4().hex[:8]
        self.summary = BatchSummary(total=total, done=0, skipped_resume=0, failed=0, tokens=0, seconds=0.0)
        self.inflight: dict[str, Job] = {}
        self.live_tokens: dict[str, int] = {}
        self.request_options = request_options
        self.writer = JsonlWriter(out_path)

    def run(self, items: Iterator[Job | LineError], window: int) -> BatchSummary:
        """Keep up to ``window`` jobs in the engine and step it until every job has a result."""
        summary = self.summary
        try:
            self._loop(items, window)
        except KeyboardInterrupt:
            summary.interrupted = True
            _abort_all(self.llm, self.inflight)
            summary.seconds = time.perf_counter() - self.t0
            self.writer.close()
            raise BatchInterrupted(summary) from None
        except BaseException:
            _abort_all(self.llm, self.inflight)
            self.writer.close()
            raise
        self.writer.close()
        summary.seconds = time.perf_counter() - self.t0
        self.report()
        return summary

    def _loop(self, items: Iterator[Job | LineError], window: int) -> None:
        exhausted = False
        while True:
            exhausted = exhausted or self._fill(items, window)
            if not self.inflight:
                if exhausted:
                    return
                continue
            self._step()
            self.report()

    def _fill(self, items: Iterator[Job | LineError], window: int) -> bool:
        """Parse lines and queue jobs until ``window`` are in the engine; True once IN is read."""
        while len(self.inflight) < window:
            item = next(items, None)
            if item is None:
                return True
            if isinstance(item, LineError):
                self.fail(item)
            elif item.done_key in self.state.done:
                self.summary.skipped_resume += 1
            else:
                self.submit(item)
        return False

    def _step(self) -> None:
        outputs = self.llm.step()
        for out in outputs:
            if out.request_id not in self.inflight:
                continue  # someone else's request sharing the engine
            if out.finished:
                self.finish(out)
            else:
                self.live_tokens[out.request_id] = out.completion_tokens
        if not outputs and self.inflight and not self.llm.has_unfinished():
            raise RuntimeError(
                f"the engine has no unfinished requests but {len(self.inflight)} batch results never arrived"
            )

    def report(self) -> None:
        if self.progress is None:
            return
        summary = self.summary
        elapsed = time.perf_counter() - self.t0
        generated = summary.tokens + sum(self.live_tokens.values())
        tps = generated / elapsed if elapsed > 0 else 0.0
        engine_tps = self.llm.metrics.generation_tokens_per_s
        if engine_tps > 0:
            tps = float(engine_tps)
        self.progress(BatchProgress(total=self.todo, done=summary.done, failed=summary.failed,
                                    skipped_resume=summary.skipped_resume, tokens=generated,
                                    elapsed=elapsed, tokens_per_s=tps))

    def fail(self, err: LineError) -> None:
        summary = self.summary
        summary.failed += 1
        if len(summary.errors) < _MAX_ERRORS_KEPT:
            summary.errors.append(err)
        rec = err.record()
        ident = error_identity(rec)
        if ident in self.state.errors:  # the same error is already in OUT: do not append it twice
            return
        self.writer.write(rec)
        self.state.errors.add(ident)

    def submit(self, job: Job) -> None:
        rid = f"batch-{self.run_tag}-{job.line_no}"
        try:
            self.llm.add_request(job.to_request(rid, **self.request_options))
        except PromptTooLongError as e:
            self.fail(LineError(job.line_no, f"prompt too long for the model's context "
                                f"({self.llm.max_model_len} tokens): {e}", key=job.key, format=job.format))
            return
        except ValueError as e:
            self.fail(LineError(job.line_no, str(e), key=job.key, format=job.format))
            return
        self.inflight[rid] = job
        self.live_tokens[rid] = 0

    def finish(self, out: RequestOutput) -> None:
        job = self.inflight.pop(out.request_id)
        self.live_tokens.pop(out.request_id, None)
        if out.finish_reason == "abort":
            self.fail(LineError(job.line_no, "generation was aborted by the engine", key=job.key, format=job.format))
            return
        with _interrupts_deferred():
            self.writer.write(job.result_record(out, self.model, created=int(time.time())))
            self.state.done.add(job.done_key)
            self.summary.done += 1
        self.summary.tokens += out.completion_tokens
        self.summary.prompt_tokens += out.prompt_tokens


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held pending for the block (POSIX; elsewhere a no-op): a result that is
    written is also counted, so an interrupted run's "done N" equals the lines it saved."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _plan(in_path: str | os.PathLike[str], out_path: str | os.PathLike[str], limit: int | None,
          line_cap: tuple[int, str]) -> tuple[OutputState, int, int]:
    """``(OUT's state, input lines, jobs to do)``: reads OUT (repairing a truncated last line)
    and makes a first pass over IN, JSON only, no tokenization."""
    state = scan_output(out_path)
    total = skipped = 0
    for item in _jobs(in_path, limit, line_cap):
        total += 1
        if isinstance(item, Job) and item.done_key in state.done:
            skipped += 1
    return state, total, total - skipped


def _abort_all(llm: BatchLLM, inflight: dict[str, Job]) -> None:
    for rid in list(inflight):
        try:
            llm.abort(rid)
        except Exception:  # best effort: the engine may be the thing that failed
            pass
    inflight.clear()
