"""Load status on stderr while a command loads its model (`LLM.load(progress=...)`).

On a terminal it is one line, rewritten in place and erased when the model is ready (or by
`clear` before an error), so what follows starts on a clean line. When stderr is not a terminal
(a pipe, a log file) nothing is written: logs keep only results, summaries and errors.
"""

from __future__ import annotations

import shutil
import sys
from typing import Callable, TextIO

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line


def stderr_status(stream: TextIO | None = None) -> Callable[[str], None]:
    """A ``progress`` callback for ``LLM.load`` that writes to ``stream`` (default stderr)."""
    out = stream or sys.stderr
    live = out.isatty()

    def show(line: str) -> None:
        if not live:
            return
        width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
        ready = line.endswith(" s)") and " loaded (" in line
        out.write(CLEAR_LINE + ("" if ready else line[:width]))
        out.flush()

    return show


def announce(stream: TextIO | None = None) -> None:
    """The first status line, before the runtime (torch) is imported: the slowest import."""
    stderr_status(stream)("starting the runtime (importing torch)")


def clear(stream: TextIO | None = None) -> None:
    """Erase a status line left on a terminal (an error is about to be printed)."""
    out = stream or sys.stderr
    if out.isatty():
        out.write(CLEAR_LINE)
        out.flush()
