"""Reading batch input and appending results durably, with resume.

Input: UTF-8 with or without a BOM, LF or CRLF line endings; blank lines are skipped but line
numbers stay those of the file (1-based), so error records point at the line an editor shows.
Lines are read with a byte cap: a longer line is skipped to its newline without being held in
memory and becomes a bad line (see :func:`iter_input_lines`).

One run writes OUT at a time: see :mod:`localgen.batch.output_lock`.

Resume rule ("appends nothing twice, loses nothing"):

- A job is **done** when OUT holds a *success* record for its key (native ``id`` /
  OpenAI ``custom_id``). Done jobs are skipped on a rerun; nothing else is.
- *Error* records do **not** make a job done: after the line is fixed, a rerun runs it and
  appends its success record (a later success record for a key supersedes earlier error
  records for it; the old error record stays, OUT is only ever appended to).
- An error record is not written again when OUT already holds an identical one (same key, line
  number and message): a rerun over a still-bad line appends nothing. It still counts as failed.
- The error record of a *duplicate* line (an id or custom_id already used on an earlier line)
  carries no key of its own (``id`` / ``custom_id`` null) and names the id in ``duplicate_of``,
  so neither a rerun nor a reader takes it for the first line's result.
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
from typing import IO, Any, Iterator

from localgen.batch.formats import NATIVE, OPENAI, LineError

_BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 16 * 2**20  # the input line cap when the engine states no prompt limit
_CHUNK = 1 << 16  # bytes read at a time: a line longer than this is read in pieces


def iter_input_lines(
    path: str | os.PathLike[str],
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    limit_note: str = "",
) -> Iterator[tuple[int, str | LineError]]:
    """Yield ``(line_no, text)`` for each non-blank line (1-based file line numbers).

    A line that is not valid UTF-8 yields a :class:`LineError` in place of its text; so does a
    line of more than ``max_line_bytes`` bytes (its line ending not counted), which is skipped to
    its newline a chunk at a time, so no more than about ``max_line_bytes`` bytes of one line are
    ever held. ``limit_note`` is appended to that error's message to say where the cap comes
    from. Raises ValueError if ``max_line_bytes`` < 1 and OSError if IN cannot be read.
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes={max_line_bytes} must be >= 1")
    with open(path, "rb") as f:
        if f.read(len(_BOM)) != _BOM:
            f.seek(0)
        line_no = 0
        while (line := _next_line(f, max_line_bytes)) is not None:
            line_no += 1
            raw, size = line
            if raw is None:
                message = f"too long: {size} bytes, over the {max_line_bytes}-byte limit for one line{limit_note}"
                yield line_no, LineError(line_no, message)
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, LineError(line_no, f"not valid UTF-8 (byte {e.start + 1})")
                continue
            if text.strip():
                yield line_no, text


def _next_line(f: IO[bytes], cap: int) -> tuple[bytes | None, int] | None:
    """``(bytes, size)`` of the next line without its line ending, or None at the end of the
    file. A line of more than ``cap`` bytes gives ``(None, size)``: it is read past a chunk at a
    time, and dropped as soon as it is over, so at most about ``cap`` bytes of it are held."""
    parts: list[bytes] | None = []
    size, tail = 0, b""
    while chunk := f.readline(_CHUNK):
        size += len(chunk)
        tail = (tail + chunk)[-2:]
        if parts is not None:
            parts.append(chunk)
            if size > cap + 2:  # over even with a CRLF
                parts = None
        if chunk.endswith(b"\n"):
            break
    if size == 0:
        return None
    length = size - (2 if tail == b"\r\n" else 1 if tail.endswith(b"\n") else 0)
    if parts is None or length > cap:
        return None, length
    return b"".join(parts).rstrip(b"\r\n"), length


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
