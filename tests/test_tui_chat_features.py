"""The chat app's keys and dialogs, driven by Textual's pilot against the fake service: the
multi-line message box, the help screen, focus after every dialog, scrolling while typing,
saved chats (reopen, rename, delete, `chat --resume`), the confirmations, copy, the sampling
dialog against `generate`'s options, and the batch progress bar."""

from __future__ import annotations

import json
import time

import pytest
from textual import events
from textual.binding import Binding

from localgen.batch.runner import BatchProgress
from localgen.conversation import Conversation
from localgen.tui.chat import ChatApp, ChatScreen
from localgen.tui.chat_dialogs import (ConfirmScreen, CopyScreen, HelpScreen, HistoryScreen,
                                       RenameScreen)
from localgen.tui.chat_screens import (BatchScreen, SamplingScreen, SaveScreen, SAMPLING_FIELDS,
                                       SystemPromptScreen)
from localgen.tui.chat_widgets import ChatMessage, ConversationView, PromptInput
from localgen.tui.history import ChatStore
from tests.tui_fakes import FakeService

SIZE = (80, 24)
CODE_ANSWER = "Use this:\n\n```python\nprint('hi')\n```\n\nand then\n\n```sh\nls -l\n```\n"


async def wait_for(pilot, cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def prompt(app) -> PromptInput:
    return app.screen_stack[0].query_one(PromptInput)


async def send(pilot, text: str) -> None:
    app = pilot.app
    n = app.answers_streamed
    prompt(app).value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.answers_streamed == n + 1, what="the answer")
    await pilot.pause()


@pytest.mark.asyncio
async def test_pasted_lines_are_kept_whole_and_sent_as_one_message():
    svc = FakeService()
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        pasted = "first line\nsecond line\n    third, indented"
        app.post_message(events.Paste(pasted))  # as the terminal driver delivers a paste
        await pilot.pause()
        assert prompt(app).text == pasted  # Input kept only "first line"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.answers_streamed == 1)
        assert svc.requests[0].messages[-1]["content"] == pasted
        shown = [m for m in app.screen.query(ChatMessage) if m.role == "user"][0]
        assert shown.text == pasted
        assert str(shown.query_one(".body").render()).splitlines() == pasted.splitlines()
        assert prompt(app).text == ""


@pytest.mark.asyncio
async def test_ctrl_j_starts_a_new_line_and_enter_sends():
    svc = FakeService()
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a", "b", "ctrl+j", "c", "d")
        assert prompt(app).text == "ab\ncd" and svc.requests == []
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.answers_streamed == 1)
        assert svc.requests[0].messages[-1]["content"] == "ab\ncd"
        # up recalls the sent message; inside it, up moves between its lines first
        await pilot.press("up")
        assert prompt(app).text == "ab\ncd"
        assert prompt(app).cursor_location[0] == 1
        await pilot.press("up")
        assert prompt(app).cursor_location[0] == 0 and prompt(app).text == "ab\ncd"
        # keys arriving in one burst, as a terminal (or tmux send-keys) delivers them
        prompt(app).value = ""
        for key, char in (("x", "x"), ("ctrl+j", "\n"), ("y", "y")):
            app.post_message(events.Key(key, char))
        await pilot.pause(0.2)
        assert prompt(app).text == "x\ny"


@pytest.mark.asyncio
async def test_help_lists_every_key_binding():
    app = ChatApp(FakeService())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        rows = app.screen.rows
        described = {desc for _keys, desc, _where in rows}
        for b in ChatScreen.BINDINGS + ChatApp.BINDINGS + PromptInput.BINDINGS:
            assert b.description in described, f"{b.key} ({b.description}) is not in the help"
        keys = {k for keys, _d, _w in rows for k in keys.split(", ")}
        for key in ("f1", "f7", "ctrl+n", "ctrl+q", "ctrl+j", "pageup", "escape"):
            assert app.get_key_display(Binding(key, "")) in keys, key
        table = app.screen.query_one("#help-keys")
        assert table.row_count == len(rows)
        await pilot.press("escape")
        assert isinstance(app.screen, ChatScreen) and app.focused is prompt(app)
        # "?" opens the help only from an empty box; in a message it is a character
        await pilot.press("?")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("w", "h", "y", "?")
        assert isinstance(app.screen, ChatScreen) and prompt(app).text == "why?"


@pytest.mark.asyncio
async def test_focus_returns_to_the_message_box_after_every_dialog(tmp_path):
    svc = FakeService([CODE_ANSWER])
    app = ChatApp(svc, store=ChatStore(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "code please")
        for key, screen in (("f1", HelpScreen), ("f2", SystemPromptScreen), ("f3", SamplingScreen),
                            ("f4", SaveScreen), ("f5", BatchScreen), ("f6", CopyScreen),
                            ("f7", HistoryScreen)):
            app.set_focus(None)  # wherever focus was before, after the dialog it is in the box
            await pilot.press(key)
            await pilot.pause()
            assert isinstance(app.screen, screen), (key, app.screen)
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, ChatScreen), key
            assert app.focused is prompt(app), (key, app.focused)
            await pilot.press("x")  # the next keystroke lands in the box
            assert prompt(app).text == "x", key
            prompt(app).value = ""
        # closed with a button instead of a key
        await pilot.press("f2")
        await pilot.click("#cancel")
        await pilot.pause()
        assert app.focused is prompt(app)


@pytest.mark.asyncio
async def test_page_keys_and_the_wheel_scroll_the_conversation_while_typing():
    long = "\n\n".join(f"Paragraph {i} of a long answer." for i in range(40))
    app = ChatApp(FakeService([long]))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "tell me a lot")
        view = app.screen.query_one(ConversationView)
        await wait_for(pilot, lambda: view.max_scroll_y > 20 and view.scroll_y == view.max_scroll_y,
                       what="the view to follow the answer to its end")
        await pilot.press("h", "i")  # typing, the box focused
        bottom = view.scroll_y
        await pilot.press("pageup")
        await pilot.pause()
        assert view.scroll_y < bottom and app.focused is prompt(app)
        up = view.scroll_y
        await pilot.press("pageup")
        await pilot.pause()
        assert view.scroll_y < up
        await pilot.press("pagedown", "pagedown")
        await pilot.pause()
        assert view.scroll_y == bottom
        await pilot.press("ctrl+home")
        await pilot.pause()
        assert view.scroll_y == 0
        view.post_message(events.MouseScrollDown(view, 5, 5, 0, 1, 0, False, False, False))
        await pilot.pause(0.3)
        assert view.scroll_y > 0 and app.focused is prompt(app)
        assert prompt(app).text == "hi"  # nothing typed was lost


@pytest.mark.asyncio
async def test_chats_are_saved_reopened_renamed_and_deleted(tmp_path):
    store = ChatStore(tmp_path)
    svc = FakeService(["Paris.", "Berlin.", "Rome."])
    app = ChatApp(svc, store=store)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "Capital of France?")
        first = app.chat_id
        saved = json.loads((tmp_path / f"{first}.json").read_text())
        assert [t["content"] for t in saved["turns"]] == ["Capital of France?", "Paris."]
        assert saved["title"] == "Capital of France?"
        await send(pilot, "And Germany?")
        assert len(json.loads((tmp_path / f"{first}.json").read_text())["turns"]) == 4

        await pilot.press("ctrl+n")  # saved: nothing to lose, no question
        await pilot.pause()
        assert isinstance(app.screen, ChatScreen) and app.conversation.turns == []
        await send(pilot, "Capital of Italy?")
        second = app.chat_id
        assert second != first and [e.id for e in store.list()] == [second, first]

        await pilot.press("f7")
        assert isinstance(app.screen, HistoryScreen)
        await pilot.press("down")  # the older chat
        await pilot.press("r")
        assert isinstance(app.screen, RenameScreen)
        app.screen.query_one("#rename-title").value = "Geography"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen)
        assert {e.id: e.title for e in store.list()}[first] == "Geography"
        await pilot.press("enter")  # open it
        await wait_for(pilot, lambda: app.chat_id == first)
        await pilot.pause()
        assert [t.content for t in app.conversation.turns] == ["Capital of France?", "Paris.",
                                                                "And Germany?", "Berlin."]
        shown = [m.text if m.role == "user" else m.body.source for m in app.screen.query(ChatMessage)]
        assert shown == ["Capital of France?", "Paris.", "And Germany?", "Berlin."]
        assert app.focused is prompt(app)

        await pilot.press("f7")
        await pilot.press("down")  # the older one again: opening a chat does not change it
        entry = app.screen._selected()
        assert entry.id == first and entry.title == "Geography"
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen)
        assert [e.id for e in store.list()] == [second]
        assert not (tmp_path / f"{first}.json").exists()


@pytest.mark.asyncio
async def test_new_chat_and_quit_ask_before_discarding():
    svc = FakeService(hold=True)
    app = ChatApp(svc)  # no store: nothing is saved
    async with app.run_test(size=SIZE) as pilot:
        prompt(app).value = "tell me"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current is not None)
        svc.feed(app.current, "half an", finish=False)
        await pilot.press("ctrl+n")
        assert isinstance(app.screen, ConfirmScreen)
        assert "answer being generated" in str(app.screen.query_one("#question").render())
        await pilot.press("n")
        await pilot.pause()
        assert app.current is not None and svc.aborted == [] and len(app.conversation.turns) == 1
        assert app.focused is prompt(app)

        await pilot.press("ctrl+q")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")  # Esc is no
        await pilot.pause()
        assert app.is_running and isinstance(app.screen, ChatScreen)

        await pilot.press("escape")  # stop the answer: the conversation is still unsaved
        await wait_for(pilot, lambda: app.current is None)
        await pilot.press("ctrl+n")
        assert "not saved" in str(app.screen.query_one("#question").render())
        await pilot.click("#yes")
        await wait_for(pilot, lambda: app.conversation.turns == [])

        # a running batch job: quitting asks, yes quits
        svc.submit_batch("in.jsonl", "out.jsonl").state = "running"
        await pilot.press("ctrl+q")
        assert isinstance(app.screen, ConfirmScreen)
        assert "batch job" in str(app.screen.query_one("#question").render())
        await pilot.press("y")
        await wait_for(pilot, lambda: not app.is_running, what="the app to quit")


@pytest.mark.asyncio
async def test_quit_without_anything_to_lose_does_not_ask(tmp_path):
    app = ChatApp(FakeService(), store=ChatStore(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running, what="the app to quit")


@pytest.mark.asyncio
async def test_copy_the_answer_or_one_code_block():
    app = ChatApp(FakeService([CODE_ANSWER]))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f6")
        assert isinstance(app.screen, ChatScreen)  # nothing to copy yet: a notice, no dialog
        await send(pilot, "code")
        await pilot.press("f6")
        assert isinstance(app.screen, CopyScreen)
        assert len(app.screen.choices) == 3  # the answer and its two code blocks
        await pilot.press("enter")
        await pilot.pause()
        assert app.clipboard == CODE_ANSWER
        await pilot.press("f6", "down", "down", "enter")
        await pilot.pause()
        assert app.clipboard == "ls -l\n" and app.focused is prompt(app)


@pytest.mark.asyncio
async def test_sampling_dialog_covers_every_generate_option(tmp_path):
    import typer.main

    from localgen.cli.main import app as cli
    from localgen.runtime.request import SamplingParams

    gen = typer.main.get_command(cli).commands["generate"]
    sampling_opts = {p.name for p in gen.params} & set(SamplingParams.__dataclass_fields__)
    in_dialog = {fid for fid, _l, _k in SAMPLING_FIELDS} | {"stop"}
    assert sampling_opts <= in_dialog, sampling_opts - in_dialog
    assert {"json_schema", "json_object"} <= {p.name for p in gen.params}  # the JSON answers field

    schema = tmp_path / "point.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"x": {"type": "integer"}},
                                  "required": ["x"]}))
    conv = Conversation()
    app = ChatApp(FakeService(), conv)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        scr = app.screen
        values = {"temperature": "0.3", "top_p": "0.9", "top_k": "40", "min_p": "0.05",
                  "repetition_penalty": "1.1", "max_tokens": "64", "seed": "7",
                  "response_format": str(schema)}
        for fid, v in values.items():
            scr.query_one(f"#{fid}").value = v
        scr.query_one("#stop").text = "END\n###"
        scr.query_one("#top_k").value = "forty"
        scr.action_ok()
        await pilot.pause()
        assert "top-k must be a whole number, got 'forty'" in str(scr.query_one("#sampling-error").render())
        scr.query_one("#top_k").value = "40"
        scr.action_ok()
        await pilot.pause()
        s = conv.sampling
        assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens, s.seed,
                s.stop) == (0.3, 0.9, 40, 0.05, 1.1, 64, 7, ("END", "###"))
        assert s.response_format["type"] == "json_schema"
        assert s.response_format["json_schema"]["schema"]["required"] == ["x"]
        assert app.focused is prompt(app)


@pytest.mark.asyncio
async def test_batch_progress_bar_moves_while_the_chat_is_shown(tmp_path):
    src = tmp_path / "jobs.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    svc = FakeService()
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        app.screen.query_one("#batch-in").value = str(src)
        await pilot.click("#batch-submit")
        job = svc.batch_jobs[0]
        bar = app.screen.rows[job.job_id].query_one("ProgressBar")
        await pilot.press("escape")
        job.state = "running"  # tokens flow before any request is done: the bar pulses
        job.progress = BatchProgress(total=4, done=0, failed=0, skipped_resume=0, tokens=5,
                                     elapsed=0.5, tokens_per_s=10.0)
        job.on_progress(job)
        await pilot.pause(0.15)
        assert bar.total is None
        seen = []
        for done in range(1, 5):
            job.state = "running"
            job.progress = BatchProgress(total=4, done=done, failed=0, skipped_resume=0,
                                         tokens=10 * done, elapsed=float(done), tokens_per_s=10.0)
            job.on_progress(job)  # from the engine thread in the app
            await pilot.pause(0.15)  # the app passes on at most ten updates a second
            seen.append(bar.percentage)
            if done == 2:
                assert "batch 2/4" in str(app.screen.query_one("#status").render())
        assert seen == [0.25, 0.5, 0.75, 1.0]
        await pilot.press("f5")
        assert "running: 4/4 done" in str(app.screen.rows[job.job_id].query_one(".job-stats").render())


@pytest.mark.asyncio
async def test_a_resumed_chat_is_shown_and_continues_in_its_file(tmp_path):
    store = ChatStore(tmp_path)
    conv = Conversation()
    conv.ask("Capital of France?")
    conv.record_answer(None, "**Paris**.")
    store.save("20261125-101010-abcd", conv)
    loaded, _ = store.load("20261125-101010-abcd")
    svc = FakeService(["Berlin."])
    app = ChatApp(svc, loaded, store=store, chat_id="20261125-101010-abcd")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        msgs = list(app.screen.query(ChatMessage))
        assert [(m.role, m.text) for m in msgs] == [("user", "Capital of France?"),
                                                    ("assistant", "**Paris**.")]
        assert msgs[1].done and not app.screen.query("#welcome")
        await send(pilot, "And Germany?")
        assert [m["content"] for m in svc.requests[0].messages] == ["Capital of France?", "**Paris**.",
                                                                     "And Germany?"]
    again, _ = store.load("20261125-101010-abcd")
    assert [t.content for t in again.turns][-2:] == ["And Germany?", "Berlin."]
