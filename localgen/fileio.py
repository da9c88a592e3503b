"""Crash-safe file writes for everything localgen saves whole (profiles, policies, transcripts,
results JSON, kernel hashes), and the check that an output folder can take them.

A file is written beside its final name as a hidden temp file, flushed and fsynced, renamed over
the old one with ``os.replace`` (atomic on POSIX and Windows), and then the folder is fsynced so
the rename itself survives a power cut. A crash at any moment leaves the old file or the new
one, never a truncated mix. The append-only batch output (``localgen.batch.jsonl_io``) has its own
line-by-line scheme and does not use this.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8",
                      mode: int | None = None) -> Path:
    """Replace ``path`` with ``text`` atomically; returns the path.

    ``mode``: permission bits of the written file (less the umask); None keeps an existing
    file's bits, else ``open()``'s default. The folder must exist. Raises OSError (its subclass
    for the errno) whose message names ``path``; the temp file is removed on any failure.
    """
    p = Path(path)
    data = text.encode(encoding)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}.tmp")
    try:
        old = _existing_mode(p) if mode is None else None
        bits = mode if mode is not None else 0o666 if old is None else old
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), bits)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if old is not None:
            os.chmod(tmp, old)  # the replaced file's bits exactly, not less the umask
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _naming(e, f"cannot write {p}") from e
        raise
    fsync_dir(p.parent)
    return p


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2,
                      mode: int | None = None) -> Path:
    """``obj`` as JSON (one trailing newline) into ``path`` through ``atomic_write_text``.

    Serialises first, so an object JSON cannot take (TypeError, ValueError) leaves the old file
    untouched. Raises as ``atomic_write_text`` otherwise.
    """
    return atomic_write_text(path, json.dumps(obj, indent=indent) + "\n", mode=mode)


def check_writable_dir(path: str | os.PathLike) -> None:
    """Make sure ``path`` is a folder this process can create files in, creating it (and its
    parents) if missing. Raises OSError (NotADirectoryError, PermissionError, ...) whose message
    names the folder and the reason."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"{p} is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _naming(e, f"cannot create the folder {p}") from e
    # access(2) also answers for a read-only mount (EROFS), which mode bits do not show
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write in the folder {p}: permission denied or read-only")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder so a rename in it is durable; a no-op where folders cannot be opened or
    synced (Windows, some network filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _existing_mode(p: Path) -> int | None:
    try:
        return p.stat().st_mode & 0o7777
    except OSError:
        return None


def _naming(e: OSError, what: str) -> OSError:
    """``e`` restated as ``what: reason``, of the same OSError subclass (by errno)."""
    reason = e.strerror or str(e)
    return OSError(e.errno, f"{what}: {reason}") if e.errno is not None else OSError(f"{what}: {reason}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
