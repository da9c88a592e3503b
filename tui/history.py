"""Saved conversations of `localgen chat`: one JSON file per chat in localgen's data folder,
written atomically after every answer, listed newest first, reopened, renamed and deleted.

Folder: ``$LOCALGEN_CHATS_DIR`` if set, else ``<user data dir>/localgen/chats`` (platformdirs'
convention, e.g. ``~/.local/share/localgen/chats`` on Linux). A file is
``{"id", "title", "created", "updated", "model", "system", "sampling", "turns"}`` — the
conversation's own JSON (``Conversation.to_json``) plus the first four keys.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from localgen.conversation import Conversation
from localgen.fileio import atomic_write_json

TITLE_CHARS = 60  # a title made from the first message keeps this many characters
_ID_RE = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$")


def chats_dir() -> Path:
    """Where conversations are saved (``$LOCALGEN_CHATS_DIR`` wins)."""
    env = os.environ.get("LOCALGEN_CHATS_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localgen", appauthor=False)) / "chats"


class ChatNotFoundError(LookupError):
    """No saved conversation has the id asked for (or none is saved at all)."""


@dataclass
class ChatEntry:
    """One saved conversation as the list shows it. ``created``/``updated``: Unix seconds."""

    id: str
    title: str
    created: float
    updated: float
    turns: int
    model: str
    path: Path


def new_chat_id(now: float | None = None) -> str:
    """``YYYYMMDD-HHMMSS-xxxx`` (local time, 4 random hex digits): sorts by creation time."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def title_from(conv: Conversation) -> str:
    """The first user message on one line, cut to ``TITLE_CHARS``; "(empty)" without one."""
    first = next((t.content for t in conv.turns if t.role == "user"), "")
    line = " ".join(first.split())
    return (line[:TITLE_CHARS - 1] + "…") if len(line) > TITLE_CHARS else (line or "(empty)")


class ChatStore:
    """The saved conversations in ``root`` (default :func:`chats_dir`; created on first save)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else chats_dir()

    def path(self, chat_id: str) -> Path:
        """The file of ``chat_id``; ValueError for an id that is not one of ours (a path, say)."""
        if not _ID_RE.match(chat_id):
            raise ValueError(f"not a chat id: {chat_id!r} (expected YYYYMMDD-HHMMSS-xxxx, "
                             "as `localgen chat` lists them)")
        return self.root / f"{chat_id}.json"

    def save(self, chat_id: str, conv: Conversation, title: str | None = None) -> Path:
        """Write ``conv`` as ``chat_id`` atomically; keeps the saved title and creation time
        unless ``title`` is given. Raises OSError naming the file."""
        p = self.path(chat_id)
        old = self._read(p) if p.is_file() else {}
        now = time.time()
        data = json.loads(conv.to_json())
        data = {"id": chat_id, "title": title or old.get("title") or title_from(conv),
                "created": old.get("created", now), "updated": now, **data}
        self.root.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(p, data)

    def load(self, chat_id: str) -> tuple[Conversation, ChatEntry]:
        """The conversation saved as ``chat_id`` and its entry. Raises ChatNotFoundError,
        ValueError for a file that is not a saved conversation (naming it)."""
        p = self.path(chat_id)
        if not p.is_file():
            raise ChatNotFoundError(f"no saved chat {chat_id!r} in {self.root}")
        data = self._read(p)
        try:
            conv = Conversation.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{p} is not a saved localgen chat: {e}") from None
        return conv, self._entry(p, data)

    def latest(self) -> str:
        """The id of the most recently updated conversation; ChatNotFoundError when none."""
        entries = self.list()
        if not entries:
            raise ChatNotFoundError(f"no saved chats in {self.root}")
        return entries[0].id

    def list(self) -> list[ChatEntry]:
        """Every readable saved conversation, most recently updated first (unreadable files are
        skipped: one bad file must not hide the others)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.glob("*.json"):
            if not _ID_RE.match(p.stem):
                continue
            try:
                out.append(self._entry(p, self._read(p)))
            except (OSError, ValueError):
                continue
        return sorted(out, key=lambda e: (e.updated, e.id), reverse=True)

    def rename(self, chat_id: str, title: str) -> None:
        """Give ``chat_id`` the title ``title`` (stripped, one line); ValueError if it is empty."""
        title = " ".join(title.split())
        if not title:
            raise ValueError("a chat's title cannot be empty")
        p = self.path(chat_id)
        if not p.is_file():
            raise ChatNotFoundError(f"no saved chat {chat_id!r} in {self.root}")
        data = self._read(p)
        data["title"] = title
        atomic_write_json(p, data)

    def delete(self, chat_id: str) -> None:
        """Remove ``chat_id``'s file; ChatNotFoundError if there is none."""
        p = self.path(chat_id)
        try:
            p.unlink()
        except FileNotFoundError:
            raise ChatNotFoundError(f"no saved chat {chat_id!r} in {self.root}") from None

    @staticmethod
    def _read(p: Path) -> dict:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p} is not a saved localgen chat")
        return data

    @staticmethod
    def _entry(p: Path, data: dict) -> ChatEntry:
        turns = data.get("turns") or []
        return ChatEntry(p.stem, str(data.get("title") or "(untitled)"), float(data.get("created", 0)),
                         float(data.get("updated", 0)), len(turns), str(data.get("model", "")), p)
