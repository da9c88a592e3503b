"""One writer per batch output: an exclusive lock beside OUT for the whole run.

:class:`OutputLock` holds an exclusive ``flock`` on ``OUT.lock`` beside OUT; the file's text (pid,
host, start time) only names the owner in the error a second run gets. The kernel drops the lock
when its process dies, so a lock file left by a killed run never blocks.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked against each other
    fcntl = None  # type: ignore[assignment]



class OutputError(RuntimeError):
    """OUT cannot be written: its folder cannot be made, the file is not writable, or another
    run holds its lock (:class:`OutputLocked`). The message is one line naming the path."""


class OutputLocked(OutputError):
    """Another process holds OUT's lock. ``owner``: what its lock file says (``pid``, ``host``,
    ``started``; empty when it could not be read)."""

    def __init__(self, message: str, owner: dict[str, Any]):
        super().__init__(message)
        self.owner = owner


def lock_path(out_path: str | os.PathLike[str]) -> Path:
    """The lock file of OUT: ``OUT.lock`` beside it (``out.jsonl`` -> ``out.jsonl.lock``), beside
    the file a symlink points to, so that two names for one OUT share one lock."""
    return Path(os.path.realpath(out_path) + ".lock")


class OutputLock:
    """An exclusive, non-blocking ``flock`` on OUT's lock file, held until :meth:`release`, the
    end of a ``with`` block, or the end of the process. Take one with :meth:`acquire`."""

    _MAX_TRIES = 50  # a lock file unlinked under us is retried; bounded so acquire never hangs

    def __init__(self, out_path: Path, path: Path, fd: int):
        self.out_path = out_path
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, out_path: str | os.PathLike[str], command: str = "localgen batch") -> "OutputLock":
        """Make OUT's folder if missing, lock OUT, and check that OUT can be appended to.

        ``command`` names this run in the error a second run gets. Raises :class:`OutputLocked`
        when another process holds the lock and :class:`OutputError` when the folder or OUT is
        not writable (OUT itself is neither created nor changed).
        """
        out = Path(out_path)
        path = lock_path(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot make the folder of {out}: {e.strerror or e}") from None
        lock = cls(out, path, cls._lock_fd(out, path))
        try:
            lock._write_owner(command)
            _check_appendable(out)
        except BaseException:
            lock.release()
            raise
        return lock

    @classmethod
    def _lock_fd(cls, out: Path, path: Path) -> int:
        for _ in range(cls._MAX_TRIES):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OutputError(f"cannot write {out}: cannot create its lock file {path}: {e.strerror or e}") from None
            if fcntl is None:
                return fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                owner = _read_owner(path)
                raise OutputLocked(_locked_message(out, owner), owner) from None
            # The owner before us may have unlinked the file as it released it: then we hold a
            # lock nobody else can see, so start again on the file now at that path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
        raise OutputError(f"cannot lock {out}: its lock file {path} keeps being replaced")

    def _write_owner(self, command: str) -> None:
        assert self._fd is not None
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": command}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(owner) + "\n").encode("utf-8"), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock and remove the lock file (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still locked: see _lock_fd for a run that opened it before
        except OSError:
            pass
        os.close(self._fd)  # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _check_appendable(out: Path) -> None:
    if out.is_dir():
        raise OutputError(f"cannot write {out}: it is a folder")
    if not out.exists():
        return  # its folder took the lock file, so OUT can be created there
    try:
        os.close(os.open(out, os.O_WRONLY | os.O_APPEND))
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None


def _read_owner(path: Path) -> dict[str, Any]:
    # The owner writes its pid right after locking; give it a moment if we looked in between.
    for _ in range(20):
        try:
            owner = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(owner, dict):
                return owner
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass
        time.sleep(0.005)
    return {}


def _locked_message(out: Path, owner: dict[str, Any]) -> str:
    who = str(owner.get("command") or "another localgen batch")
    if "pid" in owner:
        who += f", pid {owner['pid']}"
        if owner.get("host") and owner["host"] != socket.gethostname():
            who += f" on {owner['host']}"
        if owner.get("started"):
            who += f" (started {owner['started']})"
    return f"{out} is being written by {who}; wait for it to finish or use another output file (-o)"
