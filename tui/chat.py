"""`localgen chat`: the Textual chat app (conversation, input with history, memory and
throughput panels, stop / new chat / system prompt / sampling / save / batch).

The app never touches the engine: it talks to a :class:`~localgen.tui.service_seam.ChatService`
(``localgen.service.EngineService``; tests pass a fake), whose thread runs the model. Answers arrive as
``RequestOutput``s through the request's async stream and are posted to the answer's widget as
:class:`AnswerUpdate` messages; metrics snapshots arrive as :class:`MetricsUpdated` messages.
"""

from __future__ import annotations

import asyncio
import time

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from localgen.conversation import Conversation
from localgen.service import MetricsSnapshot, RequestStream
from localgen.tui.chat_dialogs import ConfirmScreen, CopyScreen, HelpScreen, HistoryScreen, binding_rows
from localgen.tui.chat_screens import (BatchScreen, SamplingScreen, SaveScreen, SystemPromptScreen,
                                       default_transcript_path)
from localgen.tui.chat_widgets import (AnswerStats, AnswerUpdate, ChatMessage, ConversationView,
                                       LastAnswer, MemoryPanel, MetricsUpdated, PromptInput,
                                       ThroughputPanel)
from localgen.tui.history import ChatStore, new_chat_id
from localgen.tui.service_seam import BatchJobView, ChatService

WELCOME = ("Type a message and press Enter (Ctrl+J: new line). Esc stops an answer; ↑/↓ recall "
           "earlier messages; F1 lists every key.")


class BatchProgressed(Message):
    def __init__(self, job: BatchJobView):
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
    # priority: the message box (a TextArea) has bindings of its own for some of these keys
    BINDINGS = [
        Binding("f1", "help", "Help", priority=True),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New", priority=True),
        Binding("f2", "system", "System", show=False, priority=True),
        Binding("f3", "sampling", "Sampling", priority=True),
        Binding("f4", "save", "Export", show=False, priority=True),
        Binding("f5", "batch", "Batch", priority=True),
        Binding("f6", "copy", "Copy", show=False, priority=True),
        Binding("f7", "history", "Chats", priority=True),
        Binding("pageup", "scroll_conversation(-1)", "Scroll the conversation up", show=False,
                priority=True),
        Binding("pagedown", "scroll_conversation(1)", "Scroll the conversation down", show=False,
                priority=True),
        Binding("ctrl+home", "scroll_conversation(-1000)", "Top of the conversation", show=False,
                priority=True),
        Binding("ctrl+end", "scroll_conversation(1000)", "End of the conversation", show=False,
                priority=True),
    ]

    def compose(self) -> ComposeResult:
        yield Static("", id="status")
        with Horizontal(id="main"):
            yield ConversationView(WELCOME, id="conversation")
            with VerticalScroll(id="side"):
                yield MemoryPanel(id="memory")
                yield ThroughputPanel(id="throughput")
        yield PromptInput(placeholder="Message (Enter sends, Ctrl+J new line, F1 help)", id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        self.app.update_status()
        snap = self.app.last_snapshot or self.app.service.metrics()
        self.query_one(MemoryPanel).show(snap)
        self.query_one(ThroughputPanel).show(snap)
        if self.app.conversation.turns:  # a reopened chat (`chat --resume`)
            await self.app.show_conversation()

    def on_screen_resume(self) -> None:
        # back from any dialog or the batch screen: typing goes to the message box again
        self.query_one(PromptInput).focus()

    def action_scroll_conversation(self, pages: int) -> None:
        view = self.query_one(ConversationView)
        if abs(pages) >= 1000:
            view.scroll_home(animate=False) if pages < 0 else view.scroll_end(animate=False)
        else:
            view.scroll_to(y=view.scroll_y + pages * max(1, view.scrollable_content_region.height - 1),
                           animate=False)

    # -- actions (delegated to the app, which owns the conversation) ----------------------------
    def action_stop(self) -> None:
        self.app.stop_answer()

    def action_help(self) -> None:
        self.app.show_help()

    def on_prompt_input_help_requested(self, _msg: PromptInput.HelpRequested) -> None:
        self.app.show_help()

    def action_new_chat(self) -> None:
        self.app.request_new_chat()

    def action_copy(self) -> None:
        self.app.copy_answer()

    def action_history(self) -> None:
        self.app.show_history()

    def action_system(self) -> None:
        self.app.edit_system()

    def action_sampling(self) -> None:
        self.app.edit_sampling()

    def action_save(self) -> None:
        self.app.save_transcript()

    def action_batch(self) -> None:
        self.app.show_batch()

    @on(PromptInput.Submitted, "#prompt")
    async def send(self, event: PromptInput.Submitted) -> None:
        await self.app.ask(event.value)


class ChatApp(App):
    """The chat app around a started-or-not EngineService (``service.start()`` on mount).

    ``store``: where conversations are saved after every answer (None: not saved); ``chat_id``:
    the saved conversation ``conversation`` came from (a new id is made at the first save).
    """

    TITLE = "localgen chat"
    BINDINGS = [Binding("ctrl+q", "request_quit", "Quit", priority=True)]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, service: ChatService, conversation: Conversation | None = None, *,
                 model_label: str = "", close_service: bool = True, store: ChatStore | None = None,
                 chat_id: str | None = None):
        super().__init__()
        self.service = service
        self.conversation = conversation or Conversation()
        self.model_label = model_label
        self.close_service = close_service
        self.store, self.chat_id = store, chat_id
        self.saved_turns = len(self.conversation.turns) if chat_id else 0
        self.current: RequestStream | None = None  # the stream of the answer being generated
        self.current_widget: ChatMessage | None = None
        self.last_snapshot: MetricsSnapshot | None = None
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
        if not self.service.started:
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
        info = self.service.model_info
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
        state, info = svc.state, svc.model_info
        name = self.model_label or (info.name if info else "")
        parts = [name or "model"]
        if info is not None:
            parts.append(info.device)
        parts.append({"loading": "loading model…", "ready": "ready", "failed": "model failed to load",
                      "closed": "closed"}.get(state, state))
        s = self.conversation.sampling
        parts.append(f"T={s.temperature:g} p={s.top_p:g} max={s.max_tokens}" + (f" seed={s.seed}" if s.seed is not None else ""))
        jobs = self.running_jobs()
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
        state = self.service.state
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
    async def _stream_answer(self, stream: RequestStream, widget: ChatMessage) -> None:
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
            self.autosave()
        finally:
            if self.current is stream:
                self.current, self.current_widget = None, None

    def stop_answer(self) -> None:
        if self.current is not None:
            self.service.abort(self.current.request_id)

    async def new_chat(self) -> None:
        """Stop any answer and start an empty conversation (the old one stays saved)."""
        self.stop_answer()
        if self.current is not None:
            await self.workers.wait_for_complete([w for w in self.workers if w.group == "answer"])
        self.conversation = Conversation(system=self.conversation.system,
                                         sampling=self.conversation.sampling)
        self.chat_id, self.saved_turns = None, 0
        await self.q("#conversation", ConversationView).clear()
        self.notify("New chat")

    async def show_conversation(self) -> None:
        """Draw ``self.conversation``'s turns (a reopened chat) in place of what is shown."""
        view = self.q("#conversation", ConversationView)
        await view.clear()
        await view.query("#welcome").remove()
        for t in self.conversation.turns:
            if t.role == "system":
                continue
            w = await view.add(t.role, t.content)
            if t.role == "assistant":
                await w.finish(AnswerStats(t.prompt_tokens, t.cached_prompt_tokens, t.completion_tokens,
                                           t.ttft_s, t.seconds, t.finish_reason).line())
        view.scroll_end(animate=False)
        self.update_status()

    # -- saved conversations -----------------------------------------------------------------
    @property
    def unsaved(self) -> bool:
        """Whether turns would be lost: some are not in the store (or there is no store)."""
        asked = 1 if self.current is not None else 0  # the question of the answer in flight
        return len(self.conversation.turns) - asked > self.saved_turns

    def autosave(self) -> None:
        if self.store is None or not self.conversation.turns:
            return
        try:
            self.chat_id = self.chat_id or new_chat_id()
            self.store.save(self.chat_id, self.conversation)
        except OSError as e:
            self.notify(f"Could not save the chat: {e}", severity="error")
            return
        self.saved_turns = len(self.conversation.turns)

    def at_risk(self) -> list[str]:
        """What leaving this conversation now would throw away, in words (empty: nothing)."""
        out = []
        if self.current is not None:
            out.append("the answer being generated")
        if self.unsaved:
            out.append("this conversation (it is not saved)")
        return out

    def running_jobs(self) -> list[BatchJobView]:
        return [j for j in self.service.batch_jobs if j.state in ("queued", "running")]

    def confirm(self, question: str, then, yes: str = "Yes") -> None:
        """Ask ``question``; run ``then()`` (sync or async) on yes."""
        async def done(ok: bool | None) -> None:
            if ok:
                result = then()
                if asyncio.iscoroutine(result):
                    await result

        self.push_screen(ConfirmScreen(question, yes=yes), done)

    def request_new_chat(self) -> None:
        lost = self.at_risk()
        if not lost:
            self.run_worker(self.new_chat(), exclusive=False)
            return
        self.confirm(f"Start a new chat? This discards {' and '.join(lost)}.", self.new_chat,
                     yes="New chat")

    def action_request_quit(self) -> None:
        lost = self.at_risk()
        jobs = self.running_jobs()
        if jobs:
            lost.append(f"{len(jobs)} batch job{'s' if len(jobs) > 1 else ''} still running "
                        "(`localgen batch` resumes a cut-short file)")
        if not lost:
            self.exit()
            return
        if isinstance(self.screen, ConfirmScreen):
            return
        self.confirm(f"Quit? This discards {' and '.join(lost)}.", self.exit, yes="Quit")

    # -- dialogs ------------------------------------------------------------------------------
    def show_help(self) -> None:
        self.push_screen(HelpScreen(binding_rows(self.screen_stack[0])))

    def copy_answer(self) -> None:
        last = next((t for t in reversed(self.conversation.turns) if t.role == "assistant"), None)
        if last is None or not last.content:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.push_screen(CopyScreen(last.content))

    def show_history(self) -> None:
        if self.store is None:
            self.notify("Chats are not being saved in this session.", severity="warning")
            return

        def chosen(chat_id: str | None) -> None:
            if chat_id and chat_id != self.chat_id:
                lost = self.at_risk()
                if lost:
                    self.confirm(f"Open that chat? This discards {' and '.join(lost)}.",
                                 lambda: self.open_chat(chat_id), yes="Open")
                else:
                    self.run_worker(self.open_chat(chat_id))

        self.push_screen(HistoryScreen(self.store, self.chat_id), chosen)

    async def open_chat(self, chat_id: str) -> None:
        """Replace the conversation with the saved ``chat_id`` (its sampling and system prompt)."""
        try:
            conv, _entry = self.store.load(chat_id)
        except (OSError, LookupError, ValueError) as e:
            self.notify(f"Could not open the chat: {e}", severity="error")
            return
        self.stop_answer()
        if self.current is not None:
            await self.workers.wait_for_complete([w for w in self.workers if w.group == "answer"])
        self.conversation, self.chat_id, self.saved_turns = conv, chat_id, len(conv.turns)
        await self.show_conversation()
        self.notify(f"Opened {chat_id}")

    # -- modals ---------------------------------------------------------------------------------
    def edit_system(self) -> None:
        def done(text: str | None) -> None:
            if text is not None:
                self.conversation.system = text
                self.notify("System prompt set" if text else "System prompt cleared")
                if self.chat_id:
                    self.autosave()

        self.push_screen(SystemPromptScreen(self.conversation.system), done)

    def edit_sampling(self) -> None:
        def done(sp) -> None:
            if sp is not None:
                self.conversation.sampling = sp
                self.update_status()
                if self.chat_id:
                    self.autosave()

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

    def submit_batch(self, in_path, out_path) -> BatchJobView:
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
