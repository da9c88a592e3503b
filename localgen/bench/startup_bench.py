"""`localgen bench startup`: how long a new user waits, and how much RAM the command holds.

Each run is a fresh process, timed from its start: `localgen generate PROMPT --max-tokens 1`
(time to its first byte on stdout — the first token, streamed and flushed — and to its exit) and
llama.cpp's `llama-simple -m GGUF -n 1 PROMPT` on the same file (its stdout is block-buffered in
a pipe, so only its exit time is comparable). Peak RSS is the child's ``ru_maxrss`` from
``os.wait4``. The first localgen run starts with an empty tokenizer cache (a new user's first
command); the following runs reuse it, as every later command does. Ratios are localgen over
llama-simple, measured in the same run. `localgen chat` is started on a pseudo-terminal of 80x24
and timed until its message box is drawn and until its status bar says ``ready`` (the model
loaded: the first moment a question typed gets an answer). Before the first run localgen's modules
are byte-compiled where they are installed (`compile_package`), as installing a wheel with pip
does: under ``PYTHONDONTWRITEBYTECODE`` an editable install would otherwise compile every one of
them from source at each start (``--no-bytecode`` times that).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from localgen.bench.llama_cpp_peer import find_tool

TARGET_FIRST_TOKEN_S = 3.0
TARGET_PEAK_RSS = 600 * 10**6  # bytes
TARGET_CHAT_READY_S = 4.0
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
    chat: list[ChatRun] = field(default_factory=list)
    # the machine's 1-minute load average before the first run and after the last (None where the
    # platform has none): other processes on the cores stretch every time here
    load_average: tuple[float, float] | None = None
    bytecode_compiled: bool = False  # localgen's modules byte-compiled before the runs

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


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


@dataclass
class ChatRun:
    """`localgen chat` in a pseudo-terminal of 80x24: seconds until its message box is drawn
    (None: never within the limit) and until its status bar says the model is ``ready``."""

    input_shown_s: float | None
    ready_s: float | None
    peak_rss: int


def time_chat(cmd: list[str], env: dict[str, str] | None = None, limit_s: float = 300.0) -> ChatRun:
    """Start ``cmd`` (the chat app) on a pseudo-terminal, watch its screen output for the message
    box's placeholder and the word ``ready``, then quit it (Ctrl+Q; killed if still running)."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env={**(env or os.environ), "TERM": "xterm-256color"},
                            start_new_session=True)
    os.close(slave)
    usage = None  # set once reaped (os.wait4 keeps the child's rusage; Popen.poll would not)

    def exited() -> bool:
        nonlocal usage
        if usage is None:
            pid, _, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                usage = ru
        return usage is not None

    shown = ready = None
    seen = ""
    try:
        while ready is None and time.perf_counter() - t0 < limit_s and not exited():
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            seen = (seen + _ANSI.sub("", chunk.decode("utf-8", "replace")))[-4096:]
            now = time.perf_counter() - t0
            if shown is None and "Message (Enter" in seen:
                shown = now
            if shown is not None and re.search(r"\bready\b", seen):
                ready = now
        if not exited():
            os.write(master, b"\x11")  # Ctrl+Q
        deadline = time.perf_counter() + 10
        while not exited() and time.perf_counter() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    time.sleep(0.1)
    finally:
        if not exited():
            os.killpg(proc.pid, signal.SIGKILL)
            usage = os.wait4(proc.pid, 0)[2]
        proc.returncode = 0  # reaped above: Popen must not wait for it
        os.close(master)
    return ChatRun(shown, ready, usage.ru_maxrss * 1024)


def chat_cmd(model: str | None) -> list[str]:
    return [sys.executable, "-c", _LOCALGEN, "chat"] + (["--model", model] if model else [])


def localgen_cmd(model: str | None, prompt: str) -> list[str]:
    cmd = [sys.executable, "-c", _LOCALGEN, "generate", prompt, "--max-tokens", "1",
           "--temperature", "0"]
    return cmd + (["--model", model] if model else [])


def compile_package() -> bool:
    """Byte-compile localgen's modules in every folder it is installed from (its package, and
    in an editable install the kernels' and the TUI's folders), into their ``__pycache__``
    folders, as pip does for a wheel. False when a module could not be compiled or written."""
    import compileall
    import importlib.util

    folders: list[str] = []
    for name in ("localgen", "localgen.kernels", "localgen.tui"):
        spec = importlib.util.find_spec(name)
        folders += list(spec.submodule_search_locations or ()) if spec is not None else []
    return all([bool(compileall.compile_dir(f, quiet=2)) for f in dict.fromkeys(folders)])


def run(model: str | None, gguf: Path | None, prompt: str = "hi", repeat: int = 3,
        llama_cpp_bin: str | None = None, chat: bool = True, bytecode: bool = True,
        log: Callable[[str], None] = lambda m: None) -> StartupResult:
    """Time ``repeat`` warm runs of each side plus localgen's first run, and with ``chat`` as
    many warm starts of `localgen chat`; ``gguf`` is the file llama-simple loads (None:
    llama-simple is skipped); ``bytecode``: `compile_package` first."""
    res = StartupResult(model=model or "embedded", prompt=prompt)
    if bytecode:
        log("byte-compiling localgen's modules…")
        res.bytecode_compiled = compile_package()
    load_before = _load_average()
    simple = find_tool("llama-simple", llama_cpp_bin) if gguf is not None else None
    res.llama_simple_path = simple.name if simple else None  # the tool, not this machine's path
    with tempfile.TemporaryDirectory(prefix="localgen-startup-") as tmp:
        env = {**os.environ, "LOCALGEN_CACHE_DIR": tmp, "LOCALGEN_CHATS_DIR": tmp}
        log("localgen, first run (empty tokenizer cache)…")
        res.first_run = time_process(localgen_cmd(model, prompt), env)
        for i in range(repeat):  # interleaved, so both sides see the same machine load
            log(f"run {i + 1}/{repeat}: localgen…")
            res.localgen.append(time_process(localgen_cmd(model, prompt), env))
            if simple is not None:
                log(f"run {i + 1}/{repeat}: llama-simple…")
                res.llama_simple.append(time_process([str(simple), "-m", str(gguf), "-n", "1", prompt]))
            if chat:
                log(f"run {i + 1}/{repeat}: localgen chat…")
                res.chat.append(time_chat(chat_cmd(model), env))
    load_after = _load_average()
    if load_before is not None and load_after is not None:
        res.load_average = (load_before, load_after)
    return res


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return None


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:6.2f} s"


def median(runs: list, key: str) -> float | None:
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

    lines = [f"model {res.model}, prompt {res.prompt!r}, medians of {len(res.localgen)} runs, "
             f"localgen's modules {'byte-compiled first' if res.bytecode_compiled else 'as found'}"]
    if res.load_average is not None:
        lines.append(f"machine load (1-minute average) {res.load_average[0]:.2f} before, "
                     f"{res.load_average[1]:.2f} after, on {os.cpu_count()} CPUs")
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
    if res.chat:
        shown, ready = median(res.chat, "input_shown_s"), median(res.chat, "ready_s")
        lines.append(f"{'localgen chat':<24} message box {_s(shown)}   model ready {_s(ready)}   peak RSS "
                     f"{median(res.chat, 'peak_rss') / 1e6:7.1f} MB   (target: ready <= "
                     f"{TARGET_CHAT_READY_S:.0f} s: "
                     f"{'met' if ready is not None and ready <= TARGET_CHAT_READY_S else 'missed'})")
    ft, rss = median(res.localgen, "first_output_s"), median(res.localgen, "peak_rss")
    lines.append(f"targets: first token <= {TARGET_FIRST_TOKEN_S:.0f} s: "
                 f"{'met' if ft is not None and ft <= TARGET_FIRST_TOKEN_S else 'missed'}; "
                 f"peak RSS <= {TARGET_PEAK_RSS / 1e6:.0f} MB: "
                 f"{'met' if rss is not None and rss <= TARGET_PEAK_RSS else 'missed'}")
    return lines
