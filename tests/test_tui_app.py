"""`localgen chat` app driven by Textual's pilot: a fake service for the controls, a real tiny
model for streaming, stop, live panels and batch-beside-chat, and the embedded default once."""

from __future__ import annotations

import json
import time

import pytest

from localgen.api import LLM
from localgen.conversation import Conversation
from localgen.runtime.request import SamplingParams
from localgen.service import EngineService
from localgen.tui.chat import ChatApp
from localgen.tui.chat_dialogs import ConfirmScreen
from localgen.tui.chat_screens import BatchScreen, SamplingScreen, SaveScreen, SystemPromptScreen
from localgen.tui.chat_widgets import ChatMessage, MemoryPanel, ThroughputPanel
from tests.tiny_models import make_hf_model
from tests.tui_fakes import FakeService, snapshot

SIZE = (80, 24)


async def wait_for(pilot, cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def answers(app) -> list[ChatMessage]:
    return [m for m in app.screen_stack[0].query(ChatMessage) if m.role == "assistant"]


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


# -- with a fake service ------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_fake_answer_is_recorded_and_shown():
    svc = FakeService(["Hello! **Paris** is the capital."])
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "hi there")
        await wait_for(pilot, lambda: app.answers_streamed == 1)
        await pilot.pause()
        msg = answers(app)[0]
        await wait_for(pilot, lambda: msg.done)
        assert msg.body.source == "Hello! **Paris** is the capital."
        assert [t.role for t in app.conversation.turns] == ["user", "assistant"]
        req = svc.requests[0]
        assert req.priority.name == "INTERACTIVE" and req.messages[-1]["content"] == "hi there"
        # metrics pushed by the service reach the panels
        svc.emit(snapshot(decode=77.0))
        await pilot.pause()
        assert "77.0 tok/s" in str(app.screen.query_one("#tp-top").render())
        # second turn carries the history
        await type_and_send(pilot, "and again")
        await wait_for(pilot, lambda: app.answers_streamed == 2)
        assert [m["role"] for m in svc.requests[1].messages] == ["user", "assistant", "user"]
    assert svc.closed


@pytest.mark.asyncio
async def test_fake_stop_new_chat_and_busy_guard():
    svc = FakeService(hold=True)
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "tell me")
        await wait_for(pilot, lambda: app.current is not None)
        stream = app.current
        svc.feed(stream, "partial answer so", finish=False)
        await wait_for(pilot, lambda: answers(app)[0].text == "partial answer so")
        await type_and_send(pilot, "another")  # refused while answering
        assert len(svc.requests) == 1
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.current is None)
        assert svc.aborted == [stream.request_id]
        assert app.conversation.turns[-1].finish_reason == "abort"
        assert app.conversation.turns[-1].content == "partial answer so"
        await pilot.press("ctrl+n")  # not saved (no store): the app asks first
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await wait_for(pilot, lambda: app.conversation.turns == [] and answers(app) == [])


@pytest.mark.asyncio
async def test_fake_modals_system_sampling_save(tmp_path):
    svc = FakeService()
    conv = Conversation(system="be brief")
    app = ChatApp(svc, conv)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        assert isinstance(app.screen, SystemPromptScreen)
        app.screen.query_one("TextArea").text = "You are a pirate."
        await pilot.click("#save")
        await pilot.pause()
        assert conv.system == "You are a pirate."

        await pilot.press("f3")
        assert isinstance(app.screen, SamplingScreen)
        app.screen.query_one("#temperature").value = "abc"
        await pilot.click("#ok")
        await pilot.pause()
        assert "temperature must be a number" in str(app.screen.query_one("#sampling-error").render())
        for fid, v in (("temperature", "0"), ("top_p", "0.5"), ("max_tokens", "17"), ("seed", "3")):
            app.screen.query_one(f"#{fid}").value = v
        await pilot.pause(0.6)  # two quick clicks would be a double click
        await pilot.click("#ok")
        await pilot.pause()
        assert (conv.sampling.temperature, conv.sampling.top_p, conv.sampling.max_tokens, conv.sampling.seed) == (0.0, 0.5, 17, 3)
        assert "T=0 p=0.5 max=17 seed=3" in str(app.screen.query_one("#status").render())

        await type_and_send(pilot, "hi")
        await wait_for(pilot, lambda: app.answers_streamed == 1)
        assert svc.requests[0].messages[0] == {"role": "system", "content": "You are a pirate."}
        assert svc.requests[0].sampling.max_tokens == 17

        await pilot.press("f4")
        assert isinstance(app.screen, SaveScreen)
        app.screen.query_one("#save-path").value = str(tmp_path / "chat")
        await pilot.press("enter")
        await pilot.pause()
    md, js = (tmp_path / "chat.md").read_text(), json.loads((tmp_path / "chat.json").read_text())
    assert "## You" in md and "**System:** You are a pirate." in md
    assert js["turns"][1]["role"] == "assistant" and js["sampling"]["seed"] == 3


@pytest.mark.asyncio
async def test_load_failure_is_explained():
    svc = FakeService(state="failed", error=FileNotFoundError("no model at /nope"))
    app = ChatApp(svc)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: any(m.role == "error" for m in app.screen.query(ChatMessage)))
        await pilot.pause()
        err = [m for m in app.screen.query(ChatMessage) if m.role == "error"][0]
        assert "Could not load the model" in err.body.source and "/nope" in err.body.source
        await type_and_send(pilot, "hi")
        assert svc.requests == []


# -- with a real tiny model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tui"), "smollm")


def real_service(model_dir, metrics_interval: float = 0.1, step_delay: float = 0.0) -> EngineService:
    """The tiny model on the service thread. ``step_delay`` slows each engine step (a slower
    machine), so the test's keys land while generation is still running on any CI box."""

    def load():
        llm = LLM.load(str(model_dir), device="cpu", kv_cache_memory=1 << 22)
        if step_delay:
            step = llm.step

            def slow_step():
                time.sleep(step_delay)
                return step()

            llm.step = slow_step
        return llm

    return EngineService(load, metrics_interval=metrics_interval)


@pytest.mark.asyncio
async def test_real_model_streams_and_panels_update(model_dir):
    # many refreshes even in a fast answer: a 48-token answer of the tiny model can finish within
    # two 20 ms refreshes on a quick CPU path, so each step is held to at least 10 ms
    svc = real_service(model_dir, metrics_interval=0.02, step_delay=0.01)
    conv = Conversation(sampling=SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    app = ChatApp(svc, conv)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: svc.state == "ready")
        mem, tp = app.screen.query_one(MemoryPanel), app.screen.query_one(ThroughputPanel)
        shown = []  # what the panels displayed, as they displayed it
        for panel in (mem, tp):
            orig = panel.show
            panel.show = lambda snap, _orig=orig, _p=panel: (shown.append((_p, snap)), _orig(snap))[-1]
        await type_and_send(pilot, "hello world")
        await wait_for(pilot, lambda: app.answers_streamed == 1, what="the answer")
        await pilot.pause(0.1)
        msg = answers(app)[0]
        during = [snap for p, snap in shown if p is mem and snap.num_running >= 1]
        assert len(during) >= 2, "the memory panel did not refresh during generation"
        assert any(s.kv_blocks_used > 0 for s in during)
        assert any(snap.decode_tokens_per_s > 0 for p, snap in shown if p is tp and snap.num_running >= 1)
        assert "tok/s" in str(tp.query_one("#tp-top").render())
        assert msg.updates >= 10  # streamed in pieces, not at the end
        assert app.conversation.turns[-1].completion_tokens == 48
        # turn 2 reuses the prefix of turn 1
        conv.sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        await type_and_send(pilot, "one two three")
        await wait_for(pilot, lambda: app.current is None and len(conv.turns) != 3, what="turn 2")
        assert app.answers_streamed == 2, conv.turns
        assert app.conversation.turns[-1].cached_prompt_tokens >= 16
        assert "reused" in str(tp.query_one("#tp-bottom").render())


@pytest.mark.asyncio
async def test_real_model_stop_mid_answer(model_dir):
    svc = real_service(model_dir, step_delay=0.02)
    conv = Conversation(sampling=SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    app = ChatApp(svc, conv)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: svc.state == "ready")
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.current is not None and app.current.completion_tokens >= 2)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.current is None)
        turn = app.conversation.turns[-1]
        assert turn.finish_reason == "abort" and 0 < turn.completion_tokens < 200
        used = svc.call(lambda llm: (llm.has_unfinished(), llm.metrics.kv_blocks_used)).get(timeout=10)
        assert used == (False, 0)  # the stopped answer's blocks are free


@pytest.mark.asyncio
async def test_batch_screen_runs_jsonl_while_chat_answers_first(model_dir, tmp_path):
    n = 12
    src = tmp_path / "jobs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"one two three four {i}",
                                       "max_tokens": 200, "temperature": 0, "ignore_eos": True}) + "\n"
                           for i in range(n)))
    svc = real_service(model_dir, step_delay=0.02)
    conv = Conversation(sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    app = ChatApp(svc, conv)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: svc.state == "ready")
        await pilot.press("f5")
        assert isinstance(app.screen, BatchScreen)
        app.screen.query_one("#batch-in").value = str(src)
        await pilot.click("#batch-submit")
        job = svc.batch_jobs[0]
        await wait_for(pilot, lambda: job.progress is not None and job.progress.tokens > 0, what="batch start")
        await pilot.press("escape")  # back to the chat while the batch runs
        streams, submit = [], svc.submit
        svc.submit = lambda req: (streams.append(submit(req)), streams[-1])[-1]
        app.screen.query_one("#prompt").value = "hello"
        await pilot.press("enter")
        await wait_for(pilot, lambda: streams, what="chat submitted")
        stream = streams[0]
        await wait_for(pilot, lambda: app.answers_streamed == 1, what="chat answer")
        if job.state == "running":
            assert "batch" in str(app.screen.query_one("#status").render())
        await pilot.press("f5")
        await wait_for(pilot, lambda: job.state == "done", timeout=120, what="batch end")
        await pilot.pause(0.3)
        row = app.screen.rows[job.job_id]
        assert "done: 12 written" in str(row.query_one(".job-stats").render())
        assert stream.first_token_at < job.finished_at, (job.started_at, stream.submitted_at, stream.first_token_at, job.finished_at)
    out = src.with_name("jobs.out.jsonl")
    assert len(out.read_text().splitlines()) == n


@pytest.mark.asyncio
async def test_embedded_default_model_answers(monkeypatch):
    """The real model through the app. The exact (expanded float32) weights: the packed CPU
    kernel's 8-bit activations move this greedy answer's first token, a near tie (0.08 logits)."""
    from localgen.models.sources import embedded_gguf_path

    monkeypatch.setenv("LOCALGEN_GGUF_PACKED", "0")
    try:
        embedded_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"embedded model not installed: {e}")
    svc = EngineService(lambda: LLM.load(kv_cache_memory=64 << 20), metrics_interval=0.2)
    conv = Conversation(sampling=SamplingParams(temperature=0.0, max_tokens=24))
    app = ChatApp(svc, conv)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: svc.state != "loading", timeout=180, what="model load")
        assert svc.state == "ready", svc.error
        await type_and_send(pilot, "What is the capital of France?")
        await wait_for(pilot, lambda: app.answers_streamed == 1, timeout=120)
        await pilot.pause(0.2)
        text = answers(app)[0].body.source
        assert "Paris" in text, text
