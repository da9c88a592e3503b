"""`localgen bench startup`: how long a new user waits, and how much RAM the command holds.

Each run is a fresh process, timed from its start: `localgen generate PROMPT --max-tokens 1`
(time to its first byte on stdout — the first token, streamed and flushed — and to its exit) and
llama.cpp's `llama-simple -m GGUF -n 1 PROMPT` on the same file (its stdout is block-buffered in
a pipe, so only its exit time is comparable). Peak RSS is the child's ``ru_maxrss`` from
``os.wait4``. The first localgen run starts with an empty tokenizer cache (a new user's first
command); the following runs reuse it, as every later command does. Ratios are localgen over
llama-simple, measured in the same run.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

TARGET_FIRST_TOKEN_S = 3.0
TARGET_PEAK_RSS = 600 * 10**6  # bytes
_LOCALGEN = "import sys; from localgen.cli.main import app; sys.exit(app(prog_name='localgen'))"


@dataclass
class ProcessRun:
    """One timed process: seconds to its first stdout byte (None: it wrote none) and to its
    exit, its peak resident set in bytes, and its exit status."""

    first_output_s: float | None
    exit_s: float
    peak_rss: int
    status: int


@dataclass
class StartupResult:
    model: str
    prompt: str
    first_run: ProcessRun | None = None  # localgen with an empty tokenizer cache
    localgen: list[ProcessRun] = field(default_factory=list)
    llama_simple: list[ProcessRun] = field(default_factory=list)
    llama_simple_path: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def time_process(cmd: list[str], env: dict[str, str] | None = None) -> ProcessRun:
    """Run ``cmd`` to its end with stdout piped and stderr discarded; see `ProcessRun`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, env=env)
    first = None
    if proc.stdout.read(1):
        first = time.perf_counter() - t0
    proc.stdout.read()
    proc.stdout.close()
    _, wstatus, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(wstatus)  # reaped here: Popen must not wait
    return ProcessRun(first, elapsed, usage.ru_maxrss * 1024, proc.returncode)


def find_llama_simple(given: str | os.PathLike | None = None) -> Path | None:
    """``llama-simple`` from ``given`` or ``$LLAMA_CPP_BIN`` (the binary or its folder), else
    from PATH; None when absent."""
    for cand in (given, os.environ.get("LLAMA_CPP_BIN")):
        if not cand:
            continue
        p = Path(cand).expanduser()
        p = p / "llama-simple" if p.is_dir() else p
        if p.is_file() and os.access(p, os.X_OK):
            return p
    found = shutil.which("llama-simple")
    return Path(found) if found else None


def localgen_cmd(model: str | None, prompt: str) -> list[str]:
    cmd = [sys.executable, "-c", _LOCALGEN, "generate", prompt, "--max-tokens", "1",
           "--temperature", "0"]
    return cmd + (["--model", model] if model else [])


def run(model: str | None, gguf: Path | None, prompt: str = "hi", repeat: int = 3,
        llama_cpp_bin: str | None = None,
        log: Callable[[str], None] = lambda m: None) -> StartupResult:
    """Time ``repeat`` warm runs of each side plus localgen's first run; ``gguf`` is the file
    llama-simple loads (None: llama-simple is skipped)."""
    res = StartupResult(model=model or "embedded", prompt=prompt)
    simple = find_llama_simple(llama_cpp_bin) if gguf is not None else None
    res.llama_simple_path = str(simple) if simple else None
    with tempfile.TemporaryDirectory(prefix="localgen-startup-") as tmp:
        env = {**os.environ, "LOCALGEN_CACHE_DIR": tmp}
        log("localgen, first run (empty tokenizer cache)…")
        res.first_run = time_process(localgen_cmd(model, prompt), env)
        for i in range(repeat):  # interleaved, so both sides see the same machine load
            log(f"run {i + 1}/{repeat}: localgen…")
            res.localgen.append(time_process(localgen_cmd(model, prompt), env))
            if simple is not None:
                log(f"run {i + 1}/{repeat}: llama-simple…")
                res.llama_simple.append(time_process([str(simple), "-m", str(gguf), "-n", "1", prompt]))
    return res


def median(runs: list[ProcessRun], key: str) -> float | None:
    values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
    return statistics.median(values) if values else None


def report(res: StartupResult) -> list[str]:
    """The result as lines: medians per side, ratios, the targets."""
    def row(name: str, runs: list[ProcessRun]) -> str:
        ft, ex, rss = median(runs, "first_output_s"), median(runs, "exit_s"), median(runs, "peak_rss")
        first = f"{ft:6.2f} s" if ft is not None and name.startswith("localgen") else "     -  "
        bad = [r.status for r in runs if r.status != 0]
        return (f"{name:<24} first token {first}   exit {ex:6.2f} s   peak RSS "
                f"{rss / 1e6:7.1f} MB" + (f"   (exit status {bad})" if bad else ""))

    lines = [f"model {res.model}, prompt {res.prompt!r}, medians of {len(res.localgen)} runs"]
    if res.first_run is not None:
        lines.append(row("localgen (first run)", [res.first_run]))
    lines.append(row("localgen", res.localgen))
    if res.llama_simple:
        lines.append(row("llama-simple", res.llama_simple))
        lg_exit, ls_exit = median(res.localgen, "exit_s"), median(res.llama_simple, "exit_s")
        lg_rss, ls_rss = median(res.localgen, "peak_rss"), median(res.llama_simple, "peak_rss")
        lines.append(f"ratio localgen / llama-simple: exit {lg_exit / ls_exit:.1f}x, "
                     f"peak RSS {lg_rss / ls_rss:.1f}x")
    else:
        lines.append("llama-simple: not run (no GGUF model, or no binary: --llama-cpp-bin DIR or "
                     "LLAMA_CPP_BIN)")
    ft, rss = median(res.localgen, "first_output_s"), median(res.localgen, "peak_rss")
    lines.append(f"targets: first token <= {TARGET_FIRST_TOKEN_S:.0f} s: "
                 f"{'met' if ft is not None and ft <= TARGET_FIRST_TOKEN_S else 'missed'}; "
                 f"peak RSS <= {TARGET_PEAK_RSS / 1e6:.0f} MB: "
                 f"{'met' if rss is not None and rss <= TARGET_PEAK_RSS else 'missed'}")
    return lines
