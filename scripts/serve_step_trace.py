"""Where a served decode step's time goes: `localgen serve` with each engine step's phases
timestamped, driven by `localgen bench serve`'s streaming clients.

    python scripts/serve_step_trace.py --model FILE.gguf --concurrency 16 [--emulate-step-ms 7.3]

The server runs in a child process (this script with ``--serve``) whose engine records, per
step: schedule (step start to the runner), launch (the runner queuing the model's work),
after_launch (building the previous step's outputs and the service's hook: routing them and
waking their readers), wait (sampling, which waits for the device), advance (tokens; outputs
where they are not overlapped) and service (the
service thread's work from one step's end to the next step's start: routing, metrics, inbox).
A decode step's period is the sum; its device time is hidden behind the phases that run while
the device computes (after_launch, wait). The summary prints each phase's median over the
decode steps that ran with ``--concurrency`` sequences, beside the clients' inter-token p50.

``--emulate-step-ms``: replace the model by a stand-in device whose every step takes that long
(the runner returns at once; sampling sleeps until the step is due, GIL released, and the
service overlaps outputs as it does on CUDA): the host's share of a GPU server on a CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout: localgen beside

PHASES = ("schedule", "launch", "after_launch", "wait", "advance", "service")


def _install_trace(trace: list[dict], emulate_ms: float | None) -> None:
    """Wrap Engine.step, the runner, the after_launch hook and sampling of every engine built
    from now on in this process."""
    import torch

    import localgen.runtime.engine as engine_mod
    from localgen.runtime.engine import Engine
    from localgen.service.engine_service import EngineService

    real_sample, real_init, real_step = engine_mod.sample, Engine.__init__, Engine.step
    cur: dict = {}

    def init(self, *a, **k):
        real_init(self, *a, **k)
        run = self.runner.run
        standin = torch.zeros(256, self.model.cfg.vocab_size)

        def traced_run(seqs, is_prefill):
            cur["run_start"] = time.perf_counter()
            if emulate_ms is not None:  # greedy picks an ordinary word
                out = standin[:len(seqs)]
                out[:, 1000 + (len(trace) - 1) % 64] = 0.0
                out[:, 1000 + len(trace) % 64] = 1.0
            else:
                out = run(seqs, is_prefill)
            cur["run_end"] = time.perf_counter()
            cur["batch"], cur["prefill"] = len(seqs), is_prefill
            return out

        self.runner.run = traced_run

    def sample(*a, **k):
        out = real_sample(*a, **k)
        if emulate_ms is not None:  # the stand-in's argmax ran on the host: due after it
            due = cur["run_end"] + emulate_ms / 1000
            time.sleep(max(0.0, due - time.perf_counter()))
        cur["sample_end"] = time.perf_counter()
        return out

    def step(self):
        cur.clear()
        cur["step_start"] = time.perf_counter()
        out = real_step(self)
        cur["step_end"] = time.perf_counter()
        if "run_start" in cur:
            trace.append(dict(cur))
        return out

    real_hook = EngineService._hook_after_launch

    def hook(self, llm):
        overlapped = real_hook(self, llm)
        engine = getattr(llm, "engine", None)
        inner = getattr(engine, "after_launch", None)
        if inner is not None:
            def traced(outs):
                inner(outs)
                cur["after_launch_end"] = time.perf_counter()
            engine.after_launch = traced
        return overlapped

    if emulate_ms is not None:  # the service treats the stand-in as the asynchronous device
        EngineService._device_async = staticmethod(lambda llm: True)
    Engine.__init__, Engine.step, engine_mod.sample = init, step, sample
    EngineService._hook_after_launch = hook


def serve_main(args: list[str], trace_path: str, emulate_ms: float | None) -> None:
    trace: list[dict] = []
    _install_trace(trace, emulate_ms)

    def dump(*_):
        Path(trace_path).write_text(json.dumps(trace))
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    from localgen.cli.main import app

    try:
        app(args, prog_name="localgen")
    finally:
        dump()


def phases(trace: list[dict], batch: int) -> dict[str, float]:
    """Median seconds of each phase over the decode steps of ``batch`` sequences."""
    rows = []
    for a, b in zip(trace, trace[1:]):
        if a["prefill"] or a["batch"] != batch or "sample_end" not in a:
            continue
        al = a.get("after_launch_end", a["run_end"])
        rows.append(dict(schedule=a["run_start"] - a["step_start"],
                         launch=a["run_end"] - a["run_start"], after_launch=al - a["run_end"],
                         wait=a["sample_end"] - al, advance=a["step_end"] - a["sample_end"],
                         service=b["step_start"] - a["step_end"],
                         period=b["step_start"] - a["step_start"]))
    if not rows:
        return {}
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["steps"] = len(rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=None, help="default: 4 x concurrency")
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--emulate-step-ms", type=float, default=None)
    p.add_argument("--json", help="write the phases and the clients' ITL here")
    p.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve is not None:  # the child: the traced server
        trace_path, *rest = a.serve
        serve_main(rest, trace_path, a.emulate_step_ms)
        return
    from localgen.bench.serve_bench import ServerProcess, drive, free_port, percentile

    c = a.concurrency
    with tempfile.TemporaryDirectory(prefix="localgen-step-trace-") as tmp:
        trace_path, port = Path(tmp) / "trace.json", free_port()
        cmd = [sys.executable, __file__] + (["--emulate-step-ms", str(a.emulate_step_ms)]
                                            if a.emulate_step_ms is not None else [])
        cmd += ["--serve", str(trace_path), "serve", "--port", str(port), "--max-num-seqs",
                str(max(64, c)), "--served-model-name", "bench", "--log-level", "warning"]
        cmd += ["--model", a.model] if a.model else []
        with ServerProcess(cmd, port, Path(tmp) / "server.log") as srv:
            asyncio.run(drive(srv.base_url, "bench", 1, 1, a.prompt_words, a.max_tokens))
            timings, secs, errors = asyncio.run(drive(srv.base_url, "bench", c, a.requests or 4 * c,
                                                      a.prompt_words, a.max_tokens, offset=7919))
        trace = json.loads(trace_path.read_text())
    if errors:
        print(f"{len(errors)} errors; the first: {errors[0]}")
    gaps = sorted(g for t in timings for g in t.gaps)
    res = {"concurrency": c, "emulate_step_ms": a.emulate_step_ms, "errors": len(errors),
           "itl_p50_s": percentile(gaps, 0.5), "phases_s": phases(trace, c)}
    ph = res["phases_s"]
    print(f"C={c}: client ITL p50 {res['itl_p50_s'] * 1e3:.3f} ms, {len(errors)} errors; "
          f"median decode step of {c} ({ph.get('steps', 0)} steps), ms:")
    print("  " + "  ".join(f"{k} {ph[k] * 1e3:.3f}" for k in PHASES + ("period",) if k in ph))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
