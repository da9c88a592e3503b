"""Run a JSONL file of jobs through the engine, appending each result as it finishes.

The engine is any object with the ``localgen.api.LLM`` surface used here: ``add_request``,
``step``, ``abort``, ``has_unfinished``, ``model_name`` and optionally ``metrics`` and
``max_num_seqs``. Jobs are submitted through a bounded window (the file is never tokenized up
front), the engine is stepped (continuous batching, Orca), and every finished request is written
to OUT at once (see :mod:`localgen.batch.jsonl_io` for the resume rule).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from localgen.batch.formats import Job, LineError, parse_lines
from localgen.batch.jsonl_io import JsonlWriter, error_identity, iter_input_lines, scan_output
from localgen.runtime.request import PromptTooLongError, RequestOutput


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


def _limited(it: Iterator[tuple[int, Any]], limit: int | None) -> Iterator[tuple[int, Any]]:
    return it if limit is None else itertools.islice(it, limit)


def _jobs(in_path: str | os.PathLike[str], limit: int | None) -> Iterator[Job | LineError]:
    """Jobs and bad lines of the first ``limit`` non-blank input lines, in file order.

    One :func:`parse_lines` stream sees every line (it keeps the duplicate-id state); a line
    that is not UTF-8 goes through it as a placeholder and comes out as its decoding error.
    """
    undecodable: dict[int, LineError] = {}

    def texts() -> Iterator[tuple[int, str]]:
        for line_no, text in _limited(iter_input_lines(in_path), limit):
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
    llm: Any,
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    max_tokens: int | None = None,
    default_sampling: dict[str, Any] | None = None,
    raw_prompts: bool = False,
    max_in_flight: int | None = None,
    progress: ProgressCallback | None = None,
) -> BatchSummary:
    """Generate a result for every job of IN and append it to OUT.

    ``limit``: only the first ``limit`` non-blank input lines (good or bad) are considered.
    ``max_tokens``: caps every job's max_tokens (and is the default where a line sets none).
    ``default_sampling``: SamplingParams fields for jobs that do not set them (e.g.
    ``{"temperature": 0.0, "seed": 1}``). ``raw_prompts``: send native ``prompt`` text as is
    instead of as a user chat turn. ``max_in_flight``: most jobs queued in the engine at once
    (default 2 × ``llm.max_num_seqs``, or 128). ``progress`` is called after every engine step
    and every result. Returns a :class:`BatchSummary`; a KeyboardInterrupt aborts the queued
    requests and is re-raised as :class:`BatchInterrupted` carrying the summary so far.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    t0 = time.perf_counter()
    state = scan_output(out_path)  # also repairs a truncated last line

    # Pass 1 (JSON only, no tokenization): how many jobs are there and how many are done.
    total = skipped_planned = 0
    for item in _jobs(in_path, limit):
        total += 1
        if isinstance(item, Job) and item.done_key in state.done:
            skipped_planned += 1
    todo = total - skipped_planned

    window = max_in_flight or max(2 * int(getattr(llm, "max_num_seqs", 64) or 64), 16)
    model = str(getattr(llm, "model_name", "unknown"))
    run_tag = uuid.uuid4().hex[:8]
    summary = BatchSummary(total=total, done=0, skipped_resume=0, failed=0, tokens=0, seconds=0.0)
    inflight: dict[str, Job] = {}
    live_tokens: dict[str, int] = {}

    def report() -> None:
        if progress is None:
            return
        elapsed = time.perf_counter() - t0
        generated = summary.tokens + sum(live_tokens.values())
        tps = generated / elapsed if elapsed > 0 else 0.0
        metrics = getattr(llm, "metrics", None)
        engine_tps = getattr(metrics, "generation_tokens_per_s", None) if metrics is not None else None
        if isinstance(engine_tps, (int, float)) and engine_tps > 0:
            tps = float(engine_tps)
        progress(
            BatchProgress(
                total=todo,
                done=summary.done,
                failed=summary.failed,
                skipped_resume=summary.skipped_resume,
                tokens=generated,
                elapsed=elapsed,
                tokens_per_s=tps,
            )
        )

    writer = JsonlWriter(out_path)

    def fail(err: LineError) -> None:
        summary.failed += 1
        if len(summary.errors) < _MAX_ERRORS_KEPT:
            summary.errors.append(err)
        rec = err.record()
        ident = error_identity(rec)
        if ident in state.errors:  # the same error is already in OUT: do not append it twice
            return
        writer.write(rec)
        state.errors.add(ident)

    def submit(job: Job) -> None:
        rid = f"batch-{run_tag}-{job.line_no}"
        try:
            req = job.to_request(rid, defaults=default_sampling, max_tokens_cap=max_tokens, raw_prompts=raw_prompts)
            llm.add_request(req)
        except PromptTooLongError as e:
            ctx = getattr(llm, "max_model_len", None)
            where = f" ({ctx} tokens)" if ctx else ""
            fail(LineError(job.line_no, f"prompt too long for the model's context{where}: {e}", key=job.key, format=job.format))
            return
        except ValueError as e:
            fail(LineError(job.line_no, str(e), key=job.key, format=job.format))
            return
        inflight[rid] = job
        live_tokens[rid] = 0

    def finish(out: RequestOutput) -> None:
        job = inflight.pop(out.request_id)
        live_tokens.pop(out.request_id, None)
        if out.finish_reason == "abort":
            fail(LineError(job.line_no, "generation was aborted by the engine", key=job.key, format=job.format))
            return
        writer.write(job.result_record(out, model, created=int(time.time())))
        state.done.add(job.done_key)
        summary.done += 1
        summary.tokens += out.completion_tokens
        summary.prompt_tokens += out.prompt_tokens

    items = _jobs(in_path, limit)
    exhausted = False
    try:
        while True:
            # Fill the window: parse lines and queue jobs until `window` are in the engine.
            while not exhausted and len(inflight) < window:
                item = next(items, None)
                if item is None:
                    exhausted = True
                elif isinstance(item, LineError):
                    fail(item)
                elif item.done_key in state.done:
                    summary.skipped_resume += 1
                else:
                    submit(item)
            if not inflight:
                if exhausted:
                    break
                continue
            outputs = llm.step()
            for out in outputs:
                if out.request_id not in inflight:
                    continue  # someone else's request sharing the engine
                if out.finished:
                    finish(out)
                else:
                    live_tokens[out.request_id] = out.completion_tokens
            if not outputs and inflight and not llm.has_unfinished():
                raise RuntimeError(
                    f"the engine has no unfinished requests but {len(inflight)} batch results never arrived"
                )
            report()
    except KeyboardInterrupt:
        summary.interrupted = True
        _abort_all(llm, inflight)
        summary.seconds = time.perf_counter() - t0
        writer.close()
        raise BatchInterrupted(summary) from None
    except BaseException:
        _abort_all(llm, inflight)
        writer.close()
        raise
    writer.close()
    summary.seconds = time.perf_counter() - t0
    report()
    return summary


def _abort_all(llm: Any, inflight: dict[str, Job]) -> None:
    for rid in list(inflight):
        try:
            llm.abort(rid)
        except Exception:  # best effort: the engine may be the thing that failed
            pass
    inflight.clear()
