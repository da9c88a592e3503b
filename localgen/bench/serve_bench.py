"""`localgen bench serve`: `localgen serve` under concurrent streaming clients, beside llama.cpp's
`llama-server` on the same GGUF, measured in the same run.

Each side runs as its own process on 127.0.0.1. For every concurrency level C, C clients each
send streamed ``/v1/completions`` requests back to back (closed loop) until the level's
requests are done: a prompt of ``prompt_words`` distinct words (its token count, from the
server's usage, is reported), ``max_tokens`` output tokens with ``ignore_eos`` so every request
generates exactly that many, greedy. Measured per level: time to first token (TTFT, from sending
the request to the first streamed text), inter-token latency (ITL, the gaps between streamed
text chunks), and output tokens per second of the level's wall time. llama-server is restarted
per level with ``--parallel C`` (its slots, continuous batching on); localgen serves all levels
from one process with ``--max-num-seqs`` at least the largest C.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from localgen.bench.llama_cpp_peer import find_tool

_LOCALGEN = "import sys; from localgen.cli.main import app; sys.exit(app(prog_name='localgen'))"
LEVELS = (1, 4, 16, 64)


@dataclass
class RequestTiming:
    ttft: float | None  # seconds from sending to the first streamed text
    gaps: list[float]  # seconds between consecutive streamed text chunks
    output_tokens: int
    prompt_tokens: int | None


@dataclass
class LevelResult:
    """One server at one concurrency level. Latencies in seconds."""

    server: str
    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    prompt_tokens: float | None  # mean per request, from the server's usage
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    errors: int = 0
    first_error: str | None = None  # the first failed request's exception, for the report

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class ServeBenchResult:
    model: str
    gguf: str | None
    prompt_words: int
    max_tokens: int
    levels: tuple[int, ...]
    localgen: list[LevelResult] = field(default_factory=list)
    llama_server: list[LevelResult] = field(default_factory=list)
    llama_server_path: str | None = None
    dtype: str | None = None  # localgen serve's --dtype; None: its default
    prefill_graphs: bool = True  # localgen serve's --prefill-graphs

    def to_json(self) -> dict:
        out = asdict(self)
        for side in ("localgen", "llama_server"):
            for row, obj in zip(out[side], getattr(self, side)):
                row["tokens_per_s"] = obj.tokens_per_s
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(server: str, concurrency: int, timings: list[RequestTiming], seconds: float,
              errors: int = 0, first_error: str | None = None) -> LevelResult:
    ttfts = [t.ttft for t in timings if t.ttft is not None]
    gaps = [g for t in timings for g in t.gaps]
    prompts = [t.prompt_tokens for t in timings if t.prompt_tokens is not None]
    return LevelResult(server, concurrency, len(timings), seconds,
                       sum(t.output_tokens for t in timings),
                       sum(prompts) / len(prompts) if prompts else None,
                       percentile(ttfts, 0.5), percentile(ttfts, 0.99),
                       percentile(gaps, 0.5), percentile(gaps, 0.99), errors, first_error)


# common English nouns: about one token each in the usual BPE vocabularies
_WORDS = ("time year people way day man thing woman life child world school state family student "
          "group country problem hand part place case week company system program question work "
          "government number night point home water room mother area money story fact month lot "
          "right study book eye job word business issue side kind head house service friend father "
          "power hour game line end member law car city community name president team minute idea "
          "body information back parent face level office door health person art war history party "
          "result change morning reason research girl moment air teacher force education").split()


def prompt_text(i: int, words: int) -> str:
    """A prompt of ``words`` common words that differs from request to request from its first
    word on (no prefix cache helps either side)."""
    n = len(_WORDS)
    return " ".join(_WORDS[(i + k * (1 + i % (n - 1))) % n] for k in range(words))


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks, usage = 0, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            if not any(c.get("text") for c in obj.get("choices") or ()):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last, chunks = now, chunks + 1
    out_tokens = usage.get("completion_tokens", chunks) if usage else chunks
    return RequestTiming(None if first is None else first - t0, gaps, out_tokens,
                         usage.get("prompt_tokens") if usage else None)


async def drive(base_url: str, model: str, concurrency: int, requests: int, prompt_words: int,
                max_tokens: int, timeout_s: float = 600.0, offset: int = 0
                ) -> tuple[list[RequestTiming], float, list[str]]:
    """``requests`` streamed completions, ``concurrency`` at a time; ``(timings, wall seconds,
    one line per failed request)``."""
    import httpx

    todo = iter(range(requests))
    timings: list[RequestTiming] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            for i in todo:
                try:
                    timings.append(await one_request(client, base_url + "/v1/completions", model,
                                                     prompt_text(offset + i, prompt_words), max_tokens))
                except Exception as e:  # noqa: BLE001 - counted and reported, the level goes on
                    errors.append(f"{type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return timings, time.perf_counter() - t0, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command run until the context ends; ready once ``GET /health`` answers 200."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, ready_timeout_s: float = 900):
        self.cmd, self.port, self.log_path, self.timeout = cmd, port, log_path, ready_timeout_s
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "ServerProcess":
        import httpx

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode} before it was "
                                   f"ready; its log: {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.cmd[0]} was not ready in {self.timeout:.0f} s; its log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def localgen_cmd(model: str | None, port: int, max_num_seqs: int,
                 dtype: str | None = None, prefill_graphs: bool = True) -> list[str]:
    cmd = [sys.executable, "-c", _LOCALGEN, "serve", "--port", str(port), "--max-num-seqs",
           str(max_num_seqs), "--max-pending", str(max(256, 4 * max_num_seqs)),
           "--served-model-name", "bench", "--log-level", "warning"]
    cmd += [] if prefill_graphs else ["--no-prefill-graphs"]
    return cmd + (["--model", model] if model else []) + (["--dtype", dtype] if dtype else [])


def llama_server_cmd(binary: Path, gguf: Path, port: int, parallel: int, ctx_per_slot: int,
                     gpu: bool = False) -> list[str]:
    """llama-server with ``parallel`` slots of ``ctx_per_slot`` tokens; ``gpu``: every layer on
    the GPU (``-ngl 99``), as `localgen serve` runs where CUDA is present."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--cont-batching", "-c", str(parallel * ctx_per_slot),
            "-t", str(os.cpu_count() or 1), "--alias", "bench"] + (["-ngl", "99"] if gpu else [])


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _level(base_url: str, name: str, c: int, requests: int, prompt_words: int, max_tokens: int,
           log: Callable[[str], None]) -> LevelResult:
    # one request first: lazy initialisation stays out of the measurement
    asyncio.run(drive(base_url, "bench", 1, 1, prompt_words, max_tokens, offset=10**6 + c))
    timings, secs, errors = asyncio.run(drive(base_url, "bench", c, requests, prompt_words,
                                              max_tokens, offset=c * 1000))
    res = summarize(name, c, timings, secs, len(errors), errors[0] if errors else None)
    log(f"  {name} C={c}: {res.tokens_per_s:.1f} tok/s, {len(errors)} errors"
        + (f" (first: {errors[0][:300]})" if errors else ""))
    return res


def run(model: str | None, gguf: Path | None, *, levels=LEVELS, prompt_words: int = 128,
        max_tokens: int = 64, requests_per_level: int | None = None,
        llama_server: str | None = None, log: Callable[[str], None] = lambda m: None,
        dtype: str | None = None, peer_ctx: int | None = None,
        prefill_graphs: bool = True) -> ServeBenchResult:
    """Both servers at each level; ``requests_per_level`` None: 2 x C, at least 8. ``gguf``:
    the file llama-server loads (None: the peer is skipped); ``dtype``: localgen serve's
    ``--dtype`` (None: its default); ``peer_ctx``: llama-server's tokens per slot (None: room
    for a prompt of about two tokens a word and the output); ``prefill_graphs``: localgen serve's
    ``--prefill-graphs``. Where CUDA is present (localgen serve's device then), llama-server runs
    with every layer on the GPU."""
    levels = tuple(sorted(levels))
    # file and tool names, not this machine's paths: the result is kept beside the docs
    res = ServeBenchResult(model or "embedded", gguf.name if gguf else None, prompt_words,
                           max_tokens, levels, dtype=dtype, prefill_graphs=prefill_graphs)
    binary = find_tool("llama-server", llama_server) if gguf is not None else None
    res.llama_server_path = binary.name if binary else None
    count = (lambda c: requests_per_level) if requests_per_level else (lambda c: max(8, 2 * c))
    with tempfile.TemporaryDirectory(prefix="localgen-bench-serve-") as tmp:
        port = free_port()
        log(f"localgen serve (port {port})…")
        with ServerProcess(localgen_cmd(model, port, max(64, max(levels)), dtype, prefill_graphs), port,
                           Path(tmp) / "localgen.log") as srv:
            for c in levels:
                res.localgen.append(_level(srv.base_url, "localgen", c, count(c), prompt_words,
                                           max_tokens, log))
        if binary is not None:
            ctx = peer_ctx or 2 * prompt_words + max_tokens + 64  # a word is about one token
            gpu = _cuda_present()
            for c in levels:
                port = free_port()
                log(f"llama-server --parallel {c} (port {port})…")
                with ServerProcess(llama_server_cmd(binary, gguf, port, c, ctx, gpu), port,
                                   Path(tmp) / f"llama-server-{c}.log") as srv:
                    res.llama_server.append(_level(srv.base_url, "llama-server", c, count(c),
                                                   prompt_words, max_tokens, log))
    return res


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def report(res: ServeBenchResult) -> list[str]:
    prompt = next((r.prompt_tokens for r in res.localgen if r.prompt_tokens), None)
    lines = [f"model {res.model}{f' ({res.dtype})' if res.dtype else ''}: prompt {res.prompt_words} words"
             f"{f' ({prompt:.0f} tokens)' if prompt else ''}, {res.max_tokens} output tokens a "
             f"request (ignore_eos, greedy), streamed /v1/completions",
             f"{'C':>3} {'server':13} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'TTFT p50':>9} "
             f"{'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)"]
    peers = {r.concurrency: r for r in res.llama_server}
    for r in res.localgen:
        rows = [r] + ([peers[r.concurrency]] if r.concurrency in peers else [])
        for x in rows:
            lines.append(f"{x.concurrency:>3} {x.server:13} {x.requests:>5} {x.errors:>4} "
                         f"{x.tokens_per_s:>10.1f} {_ms(x.ttft_p50):>9} {_ms(x.ttft_p99):>8} "
                         f"{_ms(x.itl_p50):>8} {_ms(x.itl_p99):>8}")
        p = peers.get(r.concurrency)
        if p is not None:
            lines.append(f"{'':>3} {'ratio':13} {'':>5} {'':>4} {_ratio(r.tokens_per_s, p.tokens_per_s):>10} "
                         f"{_ratio(r.ttft_p50, p.ttft_p50):>9} {_ratio(r.ttft_p99, p.ttft_p99):>8} "
                         f"{_ratio(r.itl_p50, p.itl_p50):>8} {_ratio(r.itl_p99, p.itl_p99):>8}")
    if not res.llama_server:
        lines.append("no llama-server peer: give --llama-server PATH (or set LLAMA_CPP_BIN) and a "
                     "GGUF model")
    else:
        lines.append("ratios are localgen / llama-server: above 1 is better for tok/s, below 1 for "
                     "latencies (targets: C=16 tok/s >= 1.5x with ITL p50 <= 1x; C=1 TTFT and ITL "
                     "p50 <= 1.1x)")
    return lines
