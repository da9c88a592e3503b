"""Reading batch input and appending results durably, with resume.

Input: UTF-8 with or without a BOM, LF or CRLF line endings; blank lines are skipped but line
numbers stay those of the file (1-based), so error records point at the line an editor shows.

Resume rule ("appends nothing twice, loses nothing"):

- A job is **done** when OUT holds a *success* record for its key (native ``id`` /
  OpenAI ``custom_id``). Done jobs are skipped on a rerun; nothing else is.
- *Error* records do **not** make a job done: after the line is fixed, a rerun runs it and
  appends its success record (a later success record for a key supersedes earlier error
  records for it; the old error record stays, OUT is only ever appended to).
- An error record is not written again when OUT already holds an identical one (same key, line
  number and message): a rerun over a still-bad line appends nothing. It still counts as failed.
- A crash mid-write can leave a last line without its newline. If that tail is not a complete
  JSON object it is cut off (it was never a result); if it is complete, only the newline is
  added. Either way the next record starts on a fresh line. Other unreadable lines are ignored.
- Each record is written as one line, then flushed and fsync'ed before the next one, so a result
  that was reported done is on disk.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from localgen.batch.formats import NATIVE, OPENAI, LineError

_BOM = b"\xef\xbb\xbf"


def iter_input_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str | LineError]]:
    """Yield ``(line_no, text)`` for each non-blank line (1-based file line numbers).

    A line that is not valid UTF-8 yields a :class:`LineError` in place of its text.
    """
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            raw = raw.rstrip(b"\r\n")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, LineError(line_no, f"not valid UTF-8 (byte {e.start + 1})")
                continue
            if text.strip():
                yield line_no, text


def record_key(rec: dict[str, Any]) -> tuple[str, Any] | None:
    """The job key of a *success* record, or None for error records / foreign objects."""
    if "custom_id" in rec:
        if rec.get("error") is None and isinstance(rec.get("response"), dict):
            return (OPENAI, rec["custom_id"])
        return None
    if "error" not in rec and "text" in rec and "id" in rec:
        key = rec["id"]
        return (NATIVE, key) if isinstance(key, (str, int)) else None
    return None


def error_identity(rec: dict[str, Any]) -> tuple[Any, ...] | None:
    """What makes two error records the same error (ignores the random OpenAI record id)."""
    if "custom_id" in rec:
        err = rec.get("error")
        if isinstance(err, dict):
            return (OPENAI, rec["custom_id"], err.get("message"))
        return None
    if isinstance(rec.get("error"), str):
        key = rec.get("id")
        return (NATIVE, key if isinstance(key, (str, int)) or key is None else repr(key), rec.get("line"), rec["error"])
    return None


@dataclass
class OutputState:
    """What an existing OUT file already holds."""

    done: set[tuple[str, Any]] = field(default_factory=set)
    errors: set[tuple[Any, ...]] = field(default_factory=set)
    unreadable_lines: int = 0  # complete lines that are not JSON objects (ignored)
    repaired_tail: bool = False  # a partial last line was cut off / given its newline


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def scan_output(path: str | os.PathLike[str], *, repair: bool = True) -> OutputState:
    """Read OUT (if it exists) for resume, and repair a truncated last line (see module doc)."""
    state = OutputState()
    p = Path(path)
    if not p.exists():
        return state
    with open(p, "rb") as f:
        for raw in f:
            complete = raw.endswith(b"\n")
            rec = _parse_record(raw.strip())
            if not complete:  # the last line, without its newline
                if rec is None and raw.strip():
                    if repair:
                        _cut_tail(p)
                    state.repaired_tail = True
                    break
                if raw.strip() and repair:
                    with open(p, "ab") as a:
                        a.write(b"\n")
                        a.flush()
                        os.fsync(a.fileno())
                    state.repaired_tail = True
            if rec is None:
                if raw.strip():
                    state.unreadable_lines += 1
                continue
            key = record_key(rec)
            if key is not None:
                state.done.add(key)
                continue
            ident = error_identity(rec)
            if ident is not None:
                state.errors.add(ident)
    return state


def _cut_tail(p: Path) -> None:
    """Truncate the file after its last newline (drops a partially written last record)."""
    with open(p, "r+b") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        pos = size
        chunk = 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            buf = f.read(pos - start)
            i = buf.rfind(b"\n")
            if i >= 0:
                f.truncate(start + i + 1)
                break
            pos = start
        else:
            f.truncate(0)
        f.flush()
        os.fsync(f.fileno())


class JsonlWriter:
    """Appends one JSON record per line; each write is flushed and fsync'ed."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        data = json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
