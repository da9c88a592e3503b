"""llama.cpp's own measuring tools as the same-run peer: ``llama-bench`` (batch-1 decode ``tg``
and prefill ``pp``) and ``llama-batched-bench`` (``B`` sequences decoding together), run as
subprocesses on the same GGUF file with the same prompt and generation lengths.

The binaries come from ``--llama-cpp-bin`` (a folder or one of the tools), else ``$LLAMA_CPP_BIN``,
else ``PATH``; ``../shared/tools/build-llama-cpp.sh`` builds them (CPU or ``--cuda``). Output
formats: ``llama-bench -o json`` (a list of tests with ``n_prompt``, ``n_gen``, ``avg_ts``,
``model_size``) and ``llama-batched-bench --output-format jsonl`` (one object per test with
``pp``, ``tg``, ``pl``, ``speed_pp``, ``speed_tg``), as llama.cpp's tools/ print them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

BIN_ENV = "LLAMA_CPP_BIN"


class PeerError(RuntimeError):
    """A llama.cpp tool was not found, failed, or printed nothing this module can read."""


@dataclass(frozen=True)
class PeerRun:
    """One llama.cpp measurement: ``batch`` sequences, tokens/s of prefill and decode, the
    model's resident weight bytes as llama-bench reports them (None from batched-bench)."""

    batch: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    weight_bytes: int | None = None


def find_tool(name: str, where: str | os.PathLike | None = None) -> Path | None:
    """The llama.cpp tool ``name`` (e.g. ``llama-bench``): from ``where``, else
    ``$LLAMA_CPP_BIN``, else ``PATH``; None when absent. ``where`` (or the variable) is a folder
    holding the tool, or a binary: the tool itself when it is named ``name``, else a sibling named
    ``name`` (a folder's other tool), else the binary as given (a renamed build)."""
    for base in (where, os.environ.get(BIN_ENV)):
        if not base:
            continue
        p = Path(base).expanduser()
        if p.is_dir():
            p = p / name
        elif p.name != name and _executable(p.parent / name):
            p = p.parent / name
        if _executable(p):
            return p
    found = shutil.which(name)
    return Path(found) if found else None


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def run_tool(cmd: list[str], timeout: float, *, stderr: bool = False) -> str:
    """A tool's stdout (with its stderr after it when ``stderr``). Raises PeerError when it
    fails or runs past ``timeout`` seconds, with the last lines it printed."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise PeerError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PeerError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {' / '.join(tail)}")
    return proc.stdout + (proc.stderr if stderr else "")


def _common(gguf: str, threads: int, gpu: bool) -> list[str]:
    return ["-m", str(gguf), "-t", str(threads), "-ngl", "99" if gpu else "0"]


def parse_llama_bench(text: str) -> tuple[float, float, int]:
    """(prefill tokens/s, decode tokens/s, model bytes) from ``llama-bench -o json`` output.
    Raises PeerError when a test is missing."""
    try:
        tests = json.loads(text[text.index("["):])
    except ValueError as e:
        raise PeerError(f"llama-bench printed no JSON list: {text[:200]!r}") from e
    pp = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    tg = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not pp or not tg:
        raise PeerError("llama-bench's JSON lacks a pp or a tg test")
    return float(pp[0]["avg_ts"]), float(tg[0]["avg_ts"]), int(tg[0].get("model_size", 0))


def parse_batched_bench(text: str) -> dict[int, tuple[float, float]]:
    """``{B: (prefill tokens/s, decode tokens/s)}`` from ``llama-batched-bench --output-format
    jsonl`` output (other lines are ignored). Raises PeerError when there is none."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            out[int(row["pl"])] = (float(row["speed_pp"]), float(row["speed_tg"]))
    if not out:
        raise PeerError("llama-batched-bench printed no result line")
    return out


def run_peer(gguf: str | os.PathLike, batches: list[int], prompt_len: int, gen_len: int, *,
             threads: int, gpu: bool, where: str | os.PathLike | None = None, repeat: int = 3,
             timeout: float = 1800.0) -> list[PeerRun]:
    """llama.cpp on ``gguf``: ``llama-bench`` for batch 1 (``-p prompt_len -n gen_len``,
    ``repeat`` runs averaged) and ``llama-batched-bench`` for the larger batches (a prompt of
    ``prompt_len`` tokens per sequence, ``gen_len`` generated; ``-c`` fits them all). ``gpu``
    offloads every layer (``-ngl 99``). Raises PeerError naming the tool that is missing or
    failed."""
    runs = []
    if 1 in batches:
        tool = find_tool("llama-bench", where)
        if tool is None:
            raise PeerError(f"llama-bench not found (give --llama-cpp-bin or set {BIN_ENV})")
        text = run_tool([str(tool), *_common(gguf, threads, gpu), "-p", str(prompt_len),
                     "-n", str(gen_len), "-r", str(repeat), "-o", "json"], timeout)
        pp, tg, size = parse_llama_bench(text)
        runs.append(PeerRun(1, pp, tg, size))
    many = [b for b in batches if b > 1]
    if many:
        tool = find_tool("llama-batched-bench", where)
        if tool is None:
            raise PeerError(f"llama-batched-bench not found (give --llama-cpp-bin or set {BIN_ENV})")
        ctx = max(many) * (prompt_len + gen_len) + 256
        text = run_tool([str(tool), *_common(gguf, threads, gpu), "-c", str(ctx), "-b", "2048",
                     "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
                     "-npl", ",".join(map(str, many)), "--output-format", "jsonl"], timeout)
        for b, (pp, tg) in sorted(parse_batched_bench(text).items()):
            runs.append(PeerRun(b, pp, tg))
    return runs
