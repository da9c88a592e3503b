"""Widgets of `localgen chat`, each usable alone: mount it in any app and feed it messages.

- :class:`ChatMessage` — one turn; an assistant turn streams Markdown from :class:`AnswerUpdate`
  messages (one per engine output) and ends with a stats line.
- :class:`ConversationView` — the scrolling list of turns.
- :class:`PromptInput` — the multi-line message box, with history (up/down).
- :class:`MemoryPanel`, :class:`ThroughputPanel` — render a ``localgen.service.MetricsSnapshot``
  posted to them as :class:`MetricsUpdated`.

They read plain data (RequestOutput, MetricsSnapshot); none touches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Markdown, Sparkline, Static, TextArea

from localgen.runtime.request import RequestOutput
from localgen.service import MetricsSnapshot

# ------------------------------------------------------------------------------------------
# Formatting (pure; tested alone)
# ------------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_ms(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def fmt_gbs(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e9:.2f}"


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """The fenced and indented code blocks of ``markdown`` as ``(language, code)`` in order
    (language "" when the fence names none), parsed by markdown-it as Textual renders them."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(markdown)
    return [((t.info or "").split(" ")[0], t.content) for t in tokens if t.type in ("fence", "code_block")]


@dataclass
class AnswerStats:
    """What the panels and the answer's footer show about one finished (or running) answer."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    seconds: float | None = None
    finish_reason: str | None = None

    def line(self) -> str:
        parts = [f"{self.completion_tokens} tok"]
        if self.seconds and self.completion_tokens > 1:
            parts.append(f"{self.completion_tokens / self.seconds:.1f} tok/s")
        if self.ttft_s is not None:
            parts.append(f"TTFT {fmt_ms(self.ttft_s)}")
        parts.append(f"reused {self.cached_prompt_tokens}/{self.prompt_tokens} prompt tok")
        if self.finish_reason == "abort":
            parts.append("stopped")
        elif self.finish_reason == "length":
            parts.append("max tokens")
        return " · ".join(parts)


def memory_lines(snap: MetricsSnapshot | None) -> list[str]:
    """The memory panel's text for a MetricsSnapshot (≤ 28 columns a line; None: loading)."""
    if snap is None or snap.memory is None:
        return ["loading…" if snap is None or snap.state == "loading" else "no data"]
    mem, info = snap.memory, snap.model
    pred = (info.predicted_peak if info is not None else None) or {}
    lines: list[str] = []
    if mem.gpus:
        for i, g in enumerate(mem.gpus):
            tot = f"{fmt_bytes(g.used_bytes)}/{fmt_bytes(g.total_bytes)}"
            lines.append(f"GPU{i} {tot}")
            lines.append(f"  torch {fmt_bytes(g.torch_allocated_bytes)} alloc")
            if i == 0 and "gpu" in pred:  # the policy's compute GPU
                lines.append(f"  pred  {fmt_bytes(pred['gpu'])} peak")
    else:
        lines.append(f"GPU  {mem.gpu_note or 'no GPU'}")
    lines.append(f"RAM  proc {fmt_bytes(mem.process_rss_bytes)}")
    if "cpu" in pred:
        lines.append(f"     pred {fmt_bytes(pred['cpu'])} peak")
    lines.append(f"     sys {fmt_bytes(mem.system_used_bytes)}/{fmt_bytes(mem.system_total_bytes)}")
    for t in snap.kv_tiers:
        pct = 100 * t.blocks_used / t.blocks_total if t.blocks_total else 0
        lines.append(f"KV   {t.name} {t.blocks_used}/{t.blocks_total} blk {pct:.0f}%")
    if info is not None:
        lines.append(f"Wts  {fmt_bytes(info.weight_bytes)} {info.dtype}")
        lines.append(f"     GPU {info.weights_gpu_share:.0%} CPU {info.weights_cpu_share:.0%} "
                     f"disk {info.weights_disk_share:.0%}")
    lines.append(f"Disk offload {fmt_bytes(mem.offload_disk_bytes)}")
    if pred.get("disk"):
        lines.append(f"     pred {fmt_bytes(pred['disk'])} peak")
    return lines


def throughput_lines(snap: MetricsSnapshot | None, last: AnswerStats | None = None) -> tuple[list[str], list[str]]:
    """Text above and below the sparkline of the throughput panel."""
    if snap is None or snap.model is None:
        return (["decode   –"], ["loading…" if snap is None or snap.state == "loading" else snap.state])
    top = [f"decode  {fmt_rate(snap.decode_tokens_per_s)} tok/s"]
    bw = f"bw {fmt_gbs(snap.decode_bandwidth)}"
    bw += f"/{fmt_gbs(snap.bandwidth_limit)} GB/s" if snap.bandwidth_limit else " GB/s (no limit)"
    bottom = [
        f"prefill {fmt_rate(snap.prefill_tokens_per_s)} tok/s",
        f"TTFT    {fmt_ms(snap.ttft_last_s)}",
        f"lat p50 {fmt_ms(snap.token_latency_p50_s)} p90 {fmt_ms(snap.token_latency_p90_s)}",
        f"run {snap.num_running} · queued {snap.num_waiting}",
        bw,
    ]
    if last is not None:
        bottom.append(f"reused {last.cached_prompt_tokens}/{last.prompt_tokens} prompt tok")
    return top, bottom


# ------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------
class AnswerUpdate(Message):
    """One engine output for the answer being streamed (``ttft_s``: set once known)."""

    def __init__(self, output: RequestOutput, ttft_s: float | None = None, seconds: float | None = None):
        super().__init__()
        self.output, self.ttft_s, self.seconds = output, ttft_s, seconds


class AnswerFailed(Message):
    def __init__(self, error: str):
        super().__init__()
        self.error = error


class MetricsUpdated(Message):
    """A new ``MetricsSnapshot`` for the panels."""

    def __init__(self, snapshot: MetricsSnapshot):
        super().__init__()
        self.snapshot = snapshot


class LastAnswer(Message):
    def __init__(self, stats: AnswerStats):
        super().__init__()
        self.stats = stats


# ------------------------------------------------------------------------------------------
# Conversation
# ------------------------------------------------------------------------------------------
class ChatMessage(Vertical):
    """One turn. Assistant turns stream: post :class:`AnswerUpdate` messages to it."""

    DEFAULT_CSS = """
    ChatMessage { height: auto; margin: 0 0 1 0; padding: 0 1; }
    ChatMessage .role { text-style: bold; height: 1; }
    ChatMessage.user .role { color: $accent; }
    ChatMessage.assistant .role { color: $success; }
    ChatMessage.error .role { color: $error; }
    ChatMessage Markdown { margin: 0; padding: 0; }
    ChatMessage .stats { color: $text-muted; height: auto; }
    """

    def __init__(self, role: str, text: str = "", **kw):
        super().__init__(classes=role, **kw)
        self.role, self.text = role, text
        self.stats: AnswerStats | None = None
        self.done = role != "assistant"
        self._stream = None
        self.updates = 0

    def compose(self) -> ComposeResult:
        label = {"user": "You", "assistant": "Assistant", "error": "Error"}.get(self.role, self.role)
        yield Static(label, classes="role")
        if self.role == "user":  # what was typed, as typed: its line breaks and brackets kept
            yield Static(self.text, classes="body", markup=False)
        else:
            yield Markdown(self.text, classes="body")
        yield Static("", classes="stats")

    @property
    def body(self) -> Markdown:
        """The Markdown of an assistant or error turn (a user turn is plain text: ``text``)."""
        return self.query_one(Markdown)

    async def on_answer_update(self, msg: AnswerUpdate) -> None:
        msg.stop()
        out = msg.output
        self.updates += 1
        if self._stream is None and not self.done:
            self._stream = Markdown.get_stream(self.body)
        if out.text_delta and self._stream is not None:
            await self._stream.write(out.text_delta)
        self.text = out.text
        self.stats = AnswerStats(out.prompt_tokens, out.cached_prompt_tokens, out.completion_tokens,
                                 msg.ttft_s, msg.seconds, out.finish_reason)
        if out.finished:
            await self.finish()
        self.post_message(LastAnswer(self.stats))

    async def finish(self, note: str | None = None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.done = True
        text = note or (self.stats.line() if self.stats else "")
        self.query_one(".stats", Static).update(text)


class ConversationView(VerticalScroll):
    """The turns of the chat; follows the newest text while the user has not scrolled up."""

    DEFAULT_CSS = """
    ConversationView { height: 1fr; }
    ConversationView #welcome { color: $text-muted; padding: 0 1; }
    """

    def __init__(self, welcome: str = "", **kw):
        super().__init__(**kw)
        self.welcome = welcome

    def compose(self) -> ComposeResult:
        if self.welcome:
            yield Static(self.welcome, id="welcome")

    def on_mount(self) -> None:
        self.anchor()  # stay at the newest text as it streams, until the user scrolls up

    async def add(self, role: str, text: str = "") -> ChatMessage:
        msg = ChatMessage(role, text)
        await self.mount(msg)
        self.anchor()
        return msg

    async def clear(self) -> None:
        await self.query(ChatMessage).remove()

    @property
    def messages(self) -> list[ChatMessage]:
        return list(self.query(ChatMessage))


class PromptInput(TextArea):
    """The message box: several lines, Enter sends, Ctrl+J (or Shift+Enter where the terminal
    reports it) starts a new line, pasted text is kept whole. Up on the first line and Down on
    the last walk the history of sent messages; ``?`` in an empty box asks for help."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 10; }
    """
    BINDINGS = [Binding("ctrl+j,shift+enter", "newline", "New line", show=False),
                Binding("up", "history(-1)", "Previous message / line up", show=False),
                Binding("down", "history(1)", "Next message / line down", show=False)]

    class Submitted(Message):
        """Enter was pressed; ``value``: the box's text."""

        def __init__(self, prompt: "PromptInput", value: str):
            super().__init__()
            self.prompt, self.value = prompt, value

        @property
        def control(self) -> "PromptInput":
            return self.prompt

    class HelpRequested(Message):
        """``?`` was typed into the empty box."""

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.sent: list[str] = []
        self._pos = 0
        self._draft = ""

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in ("ctrl+j", "shift+enter"):
            # here, in key order: as a binding it would run after the keys typed behind it
            # (a fast typist, or tmux send-keys, got "ab" + newline for a, ctrl+j, b)
            event.stop()
            event.prevent_default()
            self.action_newline()
        elif event.character == "?" and not self.text:
            event.stop()
            event.prevent_default()
            self.post_message(self.HelpRequested())

    def action_newline(self) -> None:
        self.insert("\n")

    def remember(self, text: str) -> None:
        if text and (not self.sent or self.sent[-1] != text):
            self.sent.append(text)
        self._pos, self._draft = len(self.sent), ""

    def action_history(self, step: int) -> None:
        row = self.cursor_location[0]
        # inside a multi-line message the arrows move the cursor; at its edge they recall
        if (step < 0 and row > 0) or (step > 0 and row < self.document.line_count - 1) or not self.sent:
            self.action_cursor_up() if step < 0 else self.action_cursor_down()
            return
        if self._pos == len(self.sent):
            self._draft = self.text
        self._pos = max(0, min(len(self.sent), self._pos + step))
        self.value = self._draft if self._pos == len(self.sent) else self.sent[self._pos]


# ------------------------------------------------------------------------------------------
# Panels
# ------------------------------------------------------------------------------------------
class MemoryPanel(Static):
    """GPU / RAM / KV blocks / weight placement, from :class:`MetricsUpdated`."""

    DEFAULT_CSS = """
    MemoryPanel { height: auto; border-top: solid $primary; padding: 0 1; }
    """

    def __init__(self, **kw):
        super().__init__("loading…", **kw)
        self.border_title = "Memory"
        self.snapshot = None
        self.refreshes = 0

    def on_metrics_updated(self, msg: MetricsUpdated) -> None:
        self.show(msg.snapshot)

    def show(self, snap: MetricsSnapshot | None) -> None:
        self.snapshot = snap
        self.refreshes += 1
        self.update("\n".join(memory_lines(snap)))


class ThroughputPanel(Vertical):
    """Decode tokens/s (sparkline over recent steps), prefill, TTFT, latency, queue, bandwidth."""

    DEFAULT_CSS = """
    ThroughputPanel { height: auto; border-top: solid $primary; padding: 0 1; }
    ThroughputPanel Static { height: auto; }
    ThroughputPanel Sparkline { height: 2; margin: 0; }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.border_title = "Throughput"
        self.snapshot = None
        self.last: AnswerStats | None = None
        self.refreshes = 0

    def compose(self) -> ComposeResult:
        yield Static("decode   –", id="tp-top")
        yield Sparkline([], id="tp-spark")
        yield Static("loading…", id="tp-bottom")

    def on_metrics_updated(self, msg: MetricsUpdated) -> None:
        self.show(msg.snapshot)

    def on_last_answer(self, msg: LastAnswer) -> None:
        self.last = msg.stats
        self.show(self.snapshot)

    def show(self, snap: MetricsSnapshot | None) -> None:
        self.snapshot = snap
        self.refreshes += 1
        top, bottom = throughput_lines(snap, self.last)
        self.query_one("#tp-top", Static).update("\n".join(top))
        hist = list(snap.decode_history) if snap is not None else []
        self.query_one("#tp-spark", Sparkline).data = hist[-56:]
        self.query_one("#tp-bottom", Static).update("\n".join(bottom))
