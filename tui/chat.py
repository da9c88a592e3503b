"""`localgen chat`: the Textual chat app (conversation, input with history, memory and
throughput panels, stop / new chat / system prompt / sampling / save / batch).

The app never touches the engine: it talks to an ``localgen.service.EngineService`` (or any
object with its surface — tests pass a fake), whose thread runs the model. Answers arrive as
``RequestOutput``s through the request's async stream and are posted to the answer's widget as
:class:`AnswerUpdate` messages; metrics snapshots arrive as :class:`MetricsUpdated` messages.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from localgen.conversation import Conversation
from localgen.tui.chat_screens import (BatchScreen, SamplingScreen, SaveScreen, SystemPromptScreen,
                              default_transcript_path)
from localgen.tui.chat_widgets import (AnswerUpdate, ChatMessage, ConversationView, LastAnswer,
                              MemoryPanel, MetricsUpdated, PromptInput, ThroughputPanel)

WELCOME = ("Type a message and press Enter. Esc stops an answer; ↑/↓ recall earlier messages.")


class BatchProgressed(Message):
    def __init__(self, job: Any):
        super().__init__()
        self.job = job


class EngineState(Message):
    """The service finished loading (``error`` None) or failed to."""

    def __init__(self, error: BaseException | None):
        super().__init__()
        self.error = error


class ChatScreen(Screen):
    DEFAULT_CSS = """
    ChatScreen #status { height: 1; background: $panel; padding: 0 1; }
    ChatScreen #main { height: 1fr; }
    ChatScreen #side { width: 32; border-left: vkey $primary; }
    ChatScreen #prompt { dock: bottom; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("f2", "system", "System"),
        Binding("f3", "sampling", "Sampling"),
        Binding("f4", "save", "Save"),
        Binding("f5", "batch", "Batch"),
    ]

    def compose(self) -> ComposeResult:
        yield Static("", id="status")
        with Horizontal(id="main"):
            yield ConversationView(WELCOME, id="conversation")
            with VerticalScroll(id="side"):
                yield MemoryPanel(id="memory")
                yield ThroughputPanel(id="throughput")
        yield PromptInput(placeholder="Message (Enter to send)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        self.app.update_status()
        snap = self.app.last_snapshot or self.app.service.metrics()
        self.query_one(MemoryPanel).show(snap)
        self.query_one(ThroughputPanel).show(snap)

    # -- actions (delegated to the app, which owns the conversation) ----------------------------
    def action_stop(self) -> None:
        self.app.stop_answer()

    async def action_new_chat(self) -> None:
        await self.app.new_chat()

    def action_system(self) -> None:
        self.app.edit_system()

    def action_sampling(self) -> None:
        self.app.edit_sampling()

    def action_save(self) -> None:
        self.app.save_transcript()

    def action_batch(self) -> None:
        self.app.show_batch()

    @on(Input.Submitted, "#prompt")
    async def send(self, event: Input.Submitted) -> None:
        await self.app.ask(event.value)


class ChatApp(App):
    """The chat app around a started-or-not EngineService (``service.start()`` on mount)."""

    TITLE = "localgen chat"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, service: Any, conversation: Conversation | None = None, *,
                 model_label: str = "", close_service: bool = True):
        super().__init__()
        self.service = service
        self.conversation = conversation or Conversation()
        self.model_label = model_label
        self.close_service = close_service
        self.current: Any = None  # the stream of the answer being generated
        self.current_widget: ChatMessage | None = None
        self.last_snapshot: Any = None
        self.answers_streamed = 0
        self._batch_posted: dict[str, float] = {}
        self._listener = lambda snap: self.post_message(MetricsUpdated(snap))

    def get_default_screen(self) -> Screen:
        return ChatScreen()

    def q(self, selector: str, kind=None):
        scr = self.screen_stack[0]
        return scr.query_one(selector, kind) if kind else scr.query_one(selector)

    async def on_mount(self) -> None:
        self.install_screen(BatchScreen(self.service), name="batch")
        self.service.add_metrics_listener(self._listener)
        if not getattr(self.service, "started", True):
            self.service.start()
        self.post_message(MetricsUpdated(self.service.metrics()))
        self._wait_ready()

    @work(thread=True, exit_on_error=False)
    def _wait_ready(self) -> None:
        try:
            self.service.wait_ready()
            err = None
        except BaseException as e:  # noqa: BLE001 - shown in the conversation
            err = e
        self.post_message(EngineState(err))

    async def on_engine_state(self, msg: EngineState) -> None:
        info = getattr(self.service, "model_info", None)
        if info is not None and not self.conversation.model:
            self.conversation.model = info.name
        self.update_status()
        self.on_metrics_updated(MetricsUpdated(self.service.metrics()))
        if msg.error is not None:
            view = self.q("#conversation", ConversationView)
            await view.query("#welcome").remove()
            w = await view.add("error", "")
            await w.finish("")
            w.body.update(f"**Could not load the model.**\n\n`{type(msg.error).__name__}`: "
                          f"{msg.error}\n\nPick another one with `localgen chat --model PATH` "
                          "(a GGUF file, a Hugging Face directory or a cached hub id); "
                          "`localgen models` lists what is available.")

    async def on_unmount(self) -> None:
        self.service.remove_metrics_listener(self._listener)
        if self.current is not None:
            self.service.abort(self.current.request_id)
        if self.close_service:
            await asyncio.to_thread(self.service.close)

    # -- status and panels --------------------------------------------------------------------
    def update_status(self) -> None:
        svc = self.service
        state = getattr(svc, "state", "ready")
        info = getattr(svc, "model_info", None)
        name = self.model_label or (info.name if info else "")
        parts = [name or "model"]
        if info is not None:
            parts.append(info.device)
        parts.append({"loading": "loading model…", "ready": "ready", "failed": "model failed to load",
                      "closed": "closed"}.get(state, state))
        s = self.conversation.sampling
        parts.append(f"T={s.temperature:g} p={s.top_p:g} max={s.max_tokens}" + (f" seed={s.seed}" if s.seed is not None else ""))
        jobs = [j for j in getattr(svc, "batch_jobs", []) if j.state in ("queued", "running")]
        if jobs:
            p = jobs[0].progress
            parts.append(f"batch {p.done}/{p.total}" if p else "batch queued")
        try:
            self.q("#status", Static).update(" · ".join(parts))
        except Exception:  # noqa: BLE001 - not composed yet
            pass

    def on_metrics_updated(self, msg: MetricsUpdated) -> None:
        self.last_snapshot = msg.snapshot
        try:
            self.q("#memory", MemoryPanel).show(msg.snapshot)
            self.q("#throughput", ThroughputPanel).show(msg.snapshot)
        except Exception:  # noqa: BLE001 - screen not composed yet
            pass

    def on_last_answer(self, msg: LastAnswer) -> None:
        panel = self.q("#throughput", ThroughputPanel)
        panel.last = msg.stats
        panel.show(panel.snapshot)

    # -- chat -----------------------------------------------------------------------------------
    async def ask(self, text: str) -> None:
        text = text.strip()
        prompt = self.q("#prompt", PromptInput)
        if not text:
            return
        if self.current is not None:
            self.notify("An answer is still being generated: Esc stops it.", severity="warning")
            return
        state = getattr(self.service, "state", "ready")
        if state != "ready":
            self.notify("The model is still loading." if state == "loading" else
                        "The model is not loaded; see the message above.", severity="error")
            return
        prompt.remember(text)
        prompt.value = ""
        view = self.q("#conversation", ConversationView)
        await view.add("user", text)
        widget = await view.add("assistant")
        req = self.conversation.ask(text)
        self.current = self.service.submit(req)
        self.current_widget = widget
        self._stream_answer(self.current, widget)

    @work(group="answer", exit_on_error=False)
    async def _stream_answer(self, stream: Any, widget: ChatMessage) -> None:
        t0 = stream.submitted_at
        try:
            async for out in stream:
                end = stream.finished_at if out.finished and stream.finished_at else time.perf_counter()
                widget.post_message(AnswerUpdate(out, stream.ttft, end - t0))
        except Exception as e:  # noqa: BLE001 - the engine refused it (e.g. prompt too long)
            self.conversation.drop_unanswered()
            await widget.finish(f"error: {e}")
            self.notify(str(e), severity="error")
        else:
            self.conversation.record_answer(stream.final, ttft_s=stream.ttft,
                                            seconds=(stream.finished_at or time.perf_counter()) - t0)
            self.answers_streamed += 1
        finally:
            if self.current is stream:
                self.current, self.current_widget = None, None

    def stop_answer(self) -> None:
        if self.current is not None:
            self.service.abort(self.current.request_id)

    async def new_chat(self) -> None:
        self.stop_answer()
        if self.current is not None:
            await self.workers.wait_for_complete([w for w in self.workers if w.group == "answer"])
        self.conversation.clear()
        await self.q("#conversation", ConversationView).clear()
        self.notify("New chat")

    # -- modals ---------------------------------------------------------------------------------
    def edit_system(self) -> None:
        def done(text: str | None) -> None:
            if text is not None:
                self.conversation.system = text
                self.notify("System prompt set" if text else "System prompt cleared")

        self.push_screen(SystemPromptScreen(self.conversation.system), done)

    def edit_sampling(self) -> None:
        def done(sp) -> None:
            if sp is not None:
                self.conversation.sampling = sp
                self.update_status()

        self.push_screen(SamplingScreen(self.conversation.sampling), done)

    def save_transcript(self) -> None:
        def done(path: str | None) -> None:
            if not path:
                return
            try:
                written = self.conversation.save(path)
            except OSError as e:
                self.notify(f"Could not save: {e}", severity="error")
                return
            self.notify("Saved " + " and ".join(str(p) for p in written))

        self.push_screen(SaveScreen(default_transcript_path()), done)

    # -- batch ----------------------------------------------------------------------------------
    def show_batch(self) -> None:
        self.push_screen("batch")

    def submit_batch(self, in_path, out_path) -> Any:
        post = self.post_message

        def progressed(job) -> None:  # on the engine thread: throttle to ~10 messages/s
            now = time.monotonic()
            if now - self._batch_posted.get(job.job_id, 0.0) >= 0.1:
                self._batch_posted[job.job_id] = now
                post(BatchProgressed(job))

        return self.service.submit_batch(in_path, out_path, on_progress=progressed,
                                         on_done=lambda job: post(BatchProgressed(job)))

    def on_batch_progressed(self, msg: BatchProgressed) -> None:
        self.get_screen("batch").refresh_job(msg.job)
        self.update_status()
