"""Chat widgets mounted alone in a tiny host app, fed a fake stream: the model does not matter."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from localgen.service import RequestStream
from localgen.tui.chat_widgets import (AnswerStats, AnswerUpdate, ChatMessage, ConversationView,
                                       MemoryPanel, MetricsUpdated, PromptInput, ThroughputPanel,
                                       fmt_bytes, memory_lines, throughput_lines)
from tests.tui_fakes import output, snapshot

class Host(App):
    def __init__(self, *widgets):
        super().__init__()
        self.widgets = widgets

    def compose(self) -> ComposeResult:
        yield from self.widgets


@pytest.mark.asyncio
async def test_chat_message_streams_markdown_from_a_fake_stream():
    msg = ChatMessage("assistant")
    app = Host(msg)
    async with app.run_test() as pilot:
        stream = RequestStream("r1")
        pieces = ["Here", " is", " `code`:\n\n```python\nprint(1)\n```\n", " done"]
        acc = ""
        for i, p in enumerate(pieces):
            acc += p
            last = i == len(pieces) - 1
            stream._push(output("r1", acc, i + 1, delta=p, finished=last, reason="stop" if last else None,
                                prompt=40, cached=32))
        async for out in stream:  # the way the app consumes a service stream
            msg.post_message(AnswerUpdate(out, ttft_s=0.05, seconds=0.4))
        await pilot.pause()
        await pilot.pause()
        assert msg.done and msg.updates == 4
        assert msg.body.source == acc
        assert msg.query("MarkdownFence")  # the code block is a highlighted fence
        stats = str(msg.query_one(".stats").render())
        assert "4 tok" in stats and "TTFT 50 ms" in stats and "reused 32/40" in stats


@pytest.mark.asyncio
async def test_stopped_answer_keeps_its_text():
    msg = ChatMessage("assistant")
    async with Host(msg).run_test() as pilot:
        msg.post_message(AnswerUpdate(output("r", "partial", 1, delta="partial")))
        msg.post_message(AnswerUpdate(output("r", "partial", 1, finished=True, reason="abort")))
        await pilot.pause()
        await pilot.pause()
        assert msg.done and msg.body.source == "partial"
        assert "stopped" in str(msg.query_one(".stats").render())


@pytest.mark.asyncio
async def test_conversation_view_adds_and_clears():
    view = ConversationView("welcome")
    async with Host(view).run_test() as pilot:
        await view.add("user", "hi")
        await view.add("assistant", "hello")
        assert [m.role for m in view.messages] == ["user", "assistant"]
        await view.clear()
        await pilot.pause()
        assert view.messages == []


@pytest.mark.asyncio
async def test_prompt_history():
    inp = PromptInput()
    async with Host(inp).run_test() as pilot:
        inp.remember("first")
        inp.remember("second")
        inp.value = "draft"
        await pilot.press("up")
        assert inp.value == "second"
        await pilot.press("up", "up")
        assert inp.value == "first"
        await pilot.press("down", "down")
        assert inp.value == "draft"


@pytest.mark.asyncio
async def test_panels_render_snapshots():
    mem, tp = MemoryPanel(), ThroughputPanel()
    async with Host(mem, tp).run_test(size=(40, 30)) as pilot:
        for p in (mem, tp):
            p.post_message(MetricsUpdated(snapshot(gpu=True)))
        await pilot.pause()
        text = str(mem.render())
        assert "GPU0 3.0 GiB/80.0 GiB" in text and "torch 1.5 GiB" in text
        assert "KV   GPU 37/1456 blk" in text and "GPU 100%" in text
        assert tp.refreshes == 1
        assert list(tp.query_one("#tp-spark").data)[-1] == snapshot().decode_history[-1]
        assert "23.40/38.00 GB/s" in str(tp.query_one("#tp-bottom").render())


def test_formatting_without_gpu_and_before_load():
    lines = memory_lines(snapshot())
    assert lines[0] == "GPU  no GPU" and all(len(line) <= 30 for line in lines)
    assert memory_lines(None) == ["loading…"]
    top, bottom = throughput_lines(snapshot(), AnswerStats(60, 48, 10))
    assert top == ["decode  42.5 tok/s"] and "reused 48/60 prompt tok" in bottom
    assert all(len(line) <= 30 for line in top + bottom)
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(3 << 30) == "3.0 GiB"


def test_memory_panel_shows_the_predicted_peak_beside_the_measured_memory():
    """Under an offloading policy the panel adds the cost model's peak per tier under the GPU's
    and the process's measured memory (and disk when the policy uses it)."""
    from dataclasses import replace

    GiB = 1 << 30
    snap = snapshot(gpu=True)
    snap = replace(snap, model=replace(snap.model, predicted_peak={"gpu": 14.4 * GiB, "cpu": 36.5 * GiB,
                                                                   "disk": 2 * GiB}))
    lines = memory_lines(snap)
    assert lines[:3] == ["GPU0 3.0 GiB/80.0 GiB", "  torch 1.5 GiB alloc", "  pred  14.4 GiB peak"]
    assert lines[lines.index("RAM  proc 812.0 MiB") + 1] == "     pred 36.5 GiB peak"
    assert lines[-2:] == ["Disk offload 0 B", "     pred 2.0 GiB peak"]
    assert all(len(line) <= 30 for line in lines)
    assert not any("pred" in line for line in memory_lines(snapshot(gpu=True)))  # no policy

