"""Load status on stderr while a command loads its model (`LLM.load(progress=...)`).

On a terminal it is one line, rewritten in place and erased when the model is ready, so the
answer that follows starts on a clean line. Otherwise (a pipe, a log file) each stage is one
line and the byte counts in between are left out.
"""

from __future__ import annotations

import shutil
import sys
from typing import Callable, TextIO


def stderr_status(stream: TextIO | None = None) -> Callable[[str], None]:
    """A ``progress`` callback for ``LLM.load`` that writes to ``stream`` (default stderr)."""
    out = stream or sys.stderr
    live = out.isatty()

    def show(line: str) -> None:
        if live:
            width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
            ready = line.endswith(" s)") and " loaded (" in line
            out.write("\r\x1b[K" + ("" if ready else line[:width]))
        elif not line.startswith("loading weights:"):
            out.write(line + "\n")
        out.flush()

    return show


def announce(stream: TextIO | None = None) -> None:
    """The first status line, before the runtime (torch) is imported: the slowest import."""
    stderr_status(stream)("starting the runtime (importing torch)")
