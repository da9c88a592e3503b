"""`localgen batch IN.jsonl -o OUT.jsonl`: run a file of prompts, resumably.

Heavy imports (torch, the engine) happen inside functions so `localgen --help` stays fast.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import typer

from localgen.cli.offload_flags import OffloadFlags, offload_options, size_option, with_offload_flags

# Exit statuses of a run stopped by a signal, 128 + the signal's number as a shell reports them:
# 130 for Ctrl-C (SIGINT), 143 for SIGTERM, which supervisors (systemd, Kubernetes, `timeout`)
# read as "stopped on request" rather than as a failure of the command.
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class SigtermAsInterrupt:
    """Within ``with``, SIGTERM raises KeyboardInterrupt in the main thread, so ``kill PID``
    stops a command as cleanly as Ctrl-C. A second SIGTERM takes the default action (the
    process ends at once: whoever sends two wants it gone). The previous handler is restored at
    exit. ``received``: whether a SIGTERM came; :attr:`exit_status` is 143 then, else 130.
    Outside the main thread it does nothing (only the main thread may set handlers)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    @property
    def exit_status(self) -> int:
        return EXIT_SIGTERM if self.received else EXIT_SIGINT

    def __enter__(self) -> "SigtermAsInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def load_llm(
    model: str | None,
    *,
    kv_cache_memory: int | None = None,
    max_num_seqs: int = 64,
    dtype: str | None = None,
    device: str | None = None,
    **offload: Any,
) -> Any:
    """Load the engine (tests replace this function with a fake). ``offload``: policy,
    offload_dir, gpu_memory, cpu_memory for the offloading runtime (only passed when set)."""
    from localgen.cli.status import announce, stderr_status

    from localgen.models.sources import resolve_model

    # a missing or mistyped model fails here, before the runtime (torch) is imported
    source = resolve_model(model) if model is not None else None
    announce()
    from localgen.api import LLM

    if offload.get("policy") is not None:
        max_num_seqs = max(max_num_seqs, offload["policy"].bls)
    return LLM.load(source, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, dtype=dtype, device=device,
                    progress=stderr_status(), **offload)


@with_offload_flags
def batch(
    input: Path = typer.Argument(
        ..., exists=True, dir_okay=False, readable=True, metavar="IN.jsonl", help="Input JSONL: native {id, prompt|messages, ...} or OpenAI Batch API lines."
    ),
    output: Path = typer.Option(..., "--output", "-o", dir_okay=False, metavar="OUT.jsonl", help="Output JSONL; results are appended, ids already in it are skipped (resume)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model: local HF dir, hub id or GGUF path.", show_default="the embedded SmolLM2-135M-Instruct"),
    limit: Optional[int] = typer.Option(None, "--limit", min=0, help="Only the first N input lines."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Cap on generated tokens per line, and the value for lines that set none."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Temperature for lines that set none (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed for lines that set none."),
    raw: bool = typer.Option(False, "--raw", help="Send native \"prompt\" text as is instead of as a user turn through the chat template."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="KV cache size, e.g. 512MiB, 2GiB, 1.5GB.", show_default="sized from free memory"),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", min=1, help="Most sequences decoded together."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Compute dtype, e.g. float32, bfloat16.", show_default="chosen for the device"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...", show_default="best available"),
    progress_bar: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar (on stderr)."),
    offload: OffloadFlags = OffloadFlags(),
) -> None:
    """Generate answers for every line of IN.jsonl, appending one result per line to OUT.jsonl.

    Bad lines get an error record with their line number and the rest still run; the exit status is 1 when any line failed. Rerunning the same command resumes: lines whose id already has a result in OUT are skipped. One run writes an OUT at a time: a second one exits with status 1 before loading the model. SIGTERM stops it like Ctrl-C (exit status 143; 130 for Ctrl-C).

    Examples:

        localgen batch examples/prompts.jsonl -o out.jsonl

        localgen batch requests.jsonl -o results.jsonl --model HuggingFaceTB/SmolLM2-360M-Instruct --kv-cache-memory 2GiB
    """
    from rich.console import Console

    from localgen.batch.output_lock import OutputError, OutputLock
    from localgen.runtime.request import SamplingParams

    err = Console(stderr=True, highlight=False)
    kv_bytes = size_option(kv_cache_memory)
    if input.resolve() == output.resolve():
        raise typer.BadParameter("the output file must differ from the input file", param_hint="--output")
    defaults: dict[str, Any] = {}
    if temperature is not None:
        defaults["temperature"] = temperature
    if seed is not None:
        defaults["seed"] = seed
    try:
        SamplingParams(**defaults).validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None

    with SigtermAsInterrupt() as term:
        try:  # before anything heavy, so a second run on OUT (or an unwritable OUT) fails at once
            lock = OutputLock.acquire(output)
        except OutputError as e:
            err.print(f"error: {e}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        with lock:
            try:
                load_kw, _ = offload_options(model, offload, 512, max_tokens or 256,
                                             lambda m: err.print(m, markup=False))
                err.print(f"loading model {model or '(embedded default)'} ...")
                llm = load_llm(model, kv_cache_memory=kv_bytes, max_num_seqs=max_num_seqs, dtype=dtype,
                               device=device, **load_kw)
            except KeyboardInterrupt:
                err.print("[yellow]interrupted[/] while loading the model; nothing was written.")
                raise typer.Exit(term.exit_status) from None
            err.print(f"model {llm.model_name}, context {llm.max_model_len} tokens")
            run = dict(limit=limit, max_tokens=max_tokens, default_sampling=defaults, raw_prompts=raw,
                       max_in_flight=2 * max_num_seqs, output_lock=lock)
            summary, interrupted = _run_with_progress(llm, input, output, run, err if progress_bar else None)

    _print_summary(summary, output, err)
    if interrupted:
        err.print("[yellow]interrupted[/]: every result above is saved; rerun the same command to resume.")
        raise typer.Exit(term.exit_status)
    raise typer.Exit(1 if summary.failed else 0)


def _run_with_progress(llm: Any, input: Path, output: Path, options: dict[str, Any],
                       console: Any) -> tuple[Any, bool]:
    """``(summary, interrupted)`` of :func:`run_batch` under a progress bar on ``console``
    (None: no bar)."""
    from localgen.batch.runner import BatchInterrupted, run_batch

    bar = _ProgressBar(console) if console is not None else None
    try:
        if bar:
            bar.start()
        return run_batch(llm, input, output, progress=bar.update if bar else None, **options), False
    except BatchInterrupted as e:
        return e.summary, True
    finally:
        if bar:
            bar.stop()


def _print_summary(summary: Any, output: Path, err: Any) -> None:
    # a summary, like every command's: stderr (the results themselves are in OUT)
    typer.echo(
        f"done {summary.done}, skipped {summary.skipped_resume} (already done), "
        f"failed {summary.failed}, of {summary.total} lines; "
        f"{summary.tokens} tokens in {summary.seconds:.1f} s ({summary.tokens_per_s:.1f} tokens/s)",
        err=True,
    )
    if summary.failed:
        for e in summary.errors[:10]:
            err.print(f"  [red]line {e.line_no}[/]: {e.message}", markup=True, soft_wrap=True)
        if summary.failed > 10:
            err.print(f"  ... and {summary.failed - 10} more; error records are in {output}")


class _ProgressBar:
    """done/total, tokens/s and ETA on stderr."""

    def __init__(self, console: Any):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tps]:.1f} tok/s"),
            TextColumn("[red]{task.fields[failed]} failed" ),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._progress.add_task("batch", total=None, tps=0.0, failed=0)

    def start(self) -> None:
        self._progress.start()

    def stop(self) -> None:
        self._progress.stop()

    def update(self, p: Any) -> None:
        self._progress.update(self._task, total=p.total, completed=p.done + p.failed, tps=p.tokens_per_s, failed=p.failed)
