"""A process of its own for the batch tests that race, kill or signal a run.

    python batch_child.py run IN OUT [--step-s S] [--gate FILE] [--ready FILE]
    python batch_child.py cli IN OUT [...]          # `localgen batch IN -o OUT --no-progress`
    python batch_child.py generate PROMPT [...]     # `localgen generate PROMPT --raw`

Every mode runs against :class:`PacedLLM`, the fake engine of test_batch_fakes.py slowed down:
each step takes ``--step-s`` seconds, the first one waits until the file ``--gate`` exists (at
most 20 s) and creates the file ``--ready``. ``run`` calls run_batch and exits 0, or 1 with the
error on stderr when OUT is locked, or 130 when interrupted; the CLI modes exit as the CLI does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_batch_fakes import FakeLLM  # noqa: E402

_GATE_WAIT_S = 20.0


class PacedLLM(FakeLLM):
    """FakeLLM whose steps take ``step_s`` seconds; the first waits for ``gate``, makes ``ready``."""

    def __init__(self, *, step_s: float = 0.0, gate: str | None = None, ready: str | None = None, **kw):
        super().__init__(**kw)
        self.step_s, self.gate, self.ready = step_s, gate, ready

    def step(self):
        if self.ready:
            Path(self.ready).touch()
            self.ready = None
        if self.gate:
            deadline = time.monotonic() + _GATE_WAIT_S
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
            self.gate = None
        time.sleep(self.step_s)
        return super().step()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "cli", "generate"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--step-s", type=float, default=0.0)
    ap.add_argument("--gate")
    ap.add_argument("--ready")
    opts = ap.parse_args(argv)

    def make(model=None, **kw) -> PacedLLM:
        return PacedLLM(step_s=opts.step_s, gate=opts.gate, ready=opts.ready, max_model_len=64, max_num_seqs=4)

    if opts.mode == "run":
        from localgen.batch import BatchInterrupted, run_batch
        from localgen.batch.output_lock import OutputError

        try:
            run_batch(make(), opts.args[0], opts.args[1], max_in_flight=8)
        except OutputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except BatchInterrupted:
            return 130
        return 0

    from localgen.cli import batch_cmd, generate_cmd
    from localgen.cli.main import app

    batch_cmd.load_llm = make
    generate_cmd.load_llm = make
    batch_cmd.offload_options = lambda *a, **kw: ({}, None)  # no offloading flags; spares importing torch
    if opts.mode == "cli":
        cmd = ["batch", opts.args[0], "-o", opts.args[1], "--no-progress", "--max-num-seqs", "4"]
    else:
        cmd = ["generate", opts.args[0], "--raw", "--max-tokens", "1000"]
    try:
        app(cmd, prog_name="localgen")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
