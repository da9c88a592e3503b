"""Saved chats: the store's files, and `localgen chat --resume / --chat / --list` (the app
itself does not open: ChatApp.run is replaced and the service is a fake)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from localgen.cli import chat_cmd
from localgen.cli.main import app as cli
from localgen.conversation import Conversation
from localgen.runtime.request import SamplingParams
from localgen.tui.history import ChatNotFoundError, ChatStore, title_from
from tests.tui_fakes import FakeService


def conversation(question: str, answer: str = "ok", **kw) -> Conversation:
    conv = Conversation(**kw)
    conv.ask(question)
    conv.record_answer(None, answer)
    return conv


def test_save_load_round_trip_keeps_every_field(tmp_path):
    store = ChatStore(tmp_path)
    conv = conversation("What is 2+2?", "4", system="be terse",
                        sampling=SamplingParams(temperature=0.2, top_k=5, stop=("END",), max_tokens=9))
    store.save("20261125-101010-abcd", conv)
    back, entry = store.load("20261125-101010-abcd")
    assert back == conv
    assert entry.title == "What is 2+2?" and entry.turns == 2


def test_list_is_newest_first_and_skips_foreign_or_broken_files(tmp_path):
    store = ChatStore(tmp_path)
    store.save("20261125-101010-aaaa", conversation("old"))
    store.save("20261125-111111-bbbb", conversation("new"))
    (tmp_path / "20261125-121212-cccc.json").write_text("{not json")
    (tmp_path / "notes.json").write_text("{}")
    assert [e.title for e in store.list()] == ["new", "old"]
    assert store.latest() == "20261125-111111-bbbb"
    with pytest.raises(ValueError, match="not valid JSON"):
        store.load("20261125-121212-cccc")


def test_rename_delete_and_bad_ids(tmp_path):
    store = ChatStore(tmp_path)
    cid = "20261125-101010-abcd"
    store.save(cid, conversation("x" * 100))
    assert store.list()[0].title == "x" * 59 + "…"  # cut to TITLE_CHARS
    store.rename(cid, "  two\nwords ")
    store.save(cid, conversation("x" * 100, "again"))  # a later save keeps the given title
    assert store.list()[0].title == "two words"
    with pytest.raises(ValueError, match="empty"):
        store.rename(cid, "   ")
    with pytest.raises(ValueError, match="not a chat id"):
        store.load("../../etc/passwd")
    store.delete(cid)
    assert store.list() == []
    with pytest.raises(ChatNotFoundError):
        store.delete(cid)
    with pytest.raises(ChatNotFoundError):
        store.latest()
    assert title_from(Conversation()) == "(empty)"


@pytest.fixture
def opened(monkeypatch, tmp_path):
    """The ChatApp each `localgen chat` run would open (not run)."""
    monkeypatch.setenv("LOCALGEN_CHATS_DIR", str(tmp_path / "chats"))
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    apps = []
    monkeypatch.setattr(chat_cmd, "make_service", lambda model, **kw: FakeService())
    from localgen.tui import chat

    monkeypatch.setattr(chat.ChatApp, "run", lambda self: apps.append(self))
    return apps


def test_chat_resume_reopens_the_latest_or_the_one_named(opened, tmp_path):
    store = ChatStore(tmp_path / "chats")
    store.save("20261125-101010-aaaa", conversation("first chat", system="old system"))
    store.save("20261125-111111-bbbb", conversation("second chat"))
    r = CliRunner().invoke(cli, ["chat", "--resume"])
    assert r.exit_code == 0, r.output
    app = opened[-1]
    assert app.chat_id == "20261125-111111-bbbb"
    assert app.conversation.turns[0].content == "second chat" and not app.unsaved
    r = CliRunner().invoke(cli, ["chat", "--chat", "20261125-101010-aaaa", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    app = opened[-1]
    assert app.conversation.turns[0].content == "first chat"
    assert app.conversation.system == "old system" and app.conversation.sampling.temperature == 0
    r = CliRunner().invoke(cli, ["chat", "--list"])
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].startswith("20261125-111111-bbbb") and lines[0].endswith("second chat")
    assert len(lines) == 2


def test_chat_resume_errors_name_the_problem(opened, tmp_path):
    r = CliRunner().invoke(cli, ["chat", "--resume"])
    assert r.exit_code == 2 and "no saved chats in" in r.output and opened == []
    r = CliRunner().invoke(cli, ["chat", "--chat", "20261125-000000-ffff"])
    assert r.exit_code == 2 and "no saved chat '20261125-000000-ffff'" in r.output
    r = CliRunner().invoke(cli, ["chat", "--chat", "latest-one"])
    assert r.exit_code == 2 and "not a chat id" in r.output
