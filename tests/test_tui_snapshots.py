"""Snapshots of the chat app's main screens at 80x24 (pytest-textual-snapshot), with a fake
service and fixed numbers. Review changes by eye: `pytest tests/test_tui_snapshots.py
--snapshot-update`, then open the report / the SVGs under tests/__snapshots__/."""

from __future__ import annotations

import pytest

from localgen.conversation import Conversation
from localgen.runtime.request import SamplingParams
from localgen.tui.chat import ChatApp
from tests.tui_fakes import FakeService, snapshot

pytest.importorskip("pytest_textual_snapshot")

ANSWER = ("The capital of France is **Paris**. In Python:\n\n```python\n"
          "print(\"Paris\")\n```\n\nAnything else?")


def app_with_answer(**snap_kw) -> ChatApp:
    svc = FakeService([ANSWER], snap=snapshot(**snap_kw))
    conv = Conversation(system="Be brief.", sampling=SamplingParams(temperature=0.7, top_p=0.95, max_tokens=256))
    return ChatApp(svc, conv)


async def steady(pilot) -> None:
    """No blinking cursors: a blink phase would differ from run to run."""
    await pilot.pause()
    for scr in pilot.app.screen_stack:
        for w in scr.query("Input, TextArea"):
            w.cursor_blink = False
    await pilot.pause()


def pressing(*keys):
    async def run(pilot) -> None:
        await pilot.press(*keys)
        await steady(pilot)

    return run


async def ask(pilot) -> None:
    await steady(pilot)
    await pilot.press(*"What is the capital of France?")
    await pilot.press("enter")
    def answered() -> bool:
        msgs = [m for m in pilot.app.screen.query("ChatMessage") if m.role == "assistant"]
        return bool(msgs) and msgs[-1].done

    for _ in range(200):
        await pilot.pause(0.02)
        if answered():
            break
    await pilot.pause(0.1)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def test_chat_screen(snap_compare):
    assert snap_compare(app_with_answer(), terminal_size=(80, 24), run_before=ask)


def test_chat_screen_with_gpu(snap_compare):
    assert snap_compare(app_with_answer(gpu=True, used=300), terminal_size=(100, 30), run_before=ask)


def test_sampling_modal(snap_compare):
    assert snap_compare(app_with_answer(), terminal_size=(80, 24), run_before=pressing("f3"))


def test_system_prompt_modal(snap_compare):
    assert snap_compare(app_with_answer(), terminal_size=(80, 24), run_before=pressing("f2"))


def test_batch_screen(snap_compare):
    async def before(pilot):
        await pilot.press("f5")
        await steady(pilot)

    assert snap_compare(app_with_answer(), terminal_size=(80, 24), run_before=before)


def test_model_failed_to_load(snap_compare):
    svc = FakeService(state="failed", error=FileNotFoundError("no model at /models/missing"))

    async def before(pilot):
        for _ in range(50):
            await pilot.pause(0.02)
            if pilot.app.screen.query("ChatMessage.error"):
                break
        await steady(pilot)

    assert snap_compare(ChatApp(svc), terminal_size=(80, 24), run_before=before)


def test_help_screen(snap_compare):
    assert snap_compare(app_with_answer(), terminal_size=(100, 30), run_before=pressing("f1"))
