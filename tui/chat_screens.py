"""Modals and the batch screen of `localgen chat`."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, ProgressBar, Static, TextArea

from localgen.runtime.request import SamplingParams
from localgen.tui.service_seam import BatchJobView, ChatService

_MODAL_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 76; max-width: 100%; height: auto; max-height: 100%;
    border: round $primary; padding: 0 1; background: $surface; }}
{name} .title {{ text-style: bold; }}
{name} .error {{ color: $error; height: auto; }}
{name} Horizontal {{ height: auto; align-horizontal: right; }}
{name} Button {{ margin: 0 0 0 1; min-width: 10; }}
"""


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the system prompt; returns the new text (None: cancelled)."""

    DEFAULT_CSS = _MODAL_CSS.format(name="SystemPromptScreen") + """
    SystemPromptScreen TextArea { height: 8; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("System prompt (applies from the next message)", classes="title")
            yield TextArea(self.text, id="system-text", soft_wrap=True)
            with Horizontal():
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")
            yield Footer()

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


# (field id, label, SamplingParams attribute, parser): the settings `localgen generate` takes
SAMPLING_FIELDS = (
    ("temperature", "temperature (0 = greedy)", float),
    ("top_p", "top-p (1 = off)", float),
    ("top_k", "top-k (0 = off)", int),
    ("min_p", "min-p (0 = off)", float),
    ("repetition_penalty", "repetition penalty (1 = off)", float),
    ("max_tokens", "max tokens", int),
    ("seed", "seed (blank = none)", int),
)


class SamplingScreen(ModalScreen[SamplingParams | None]):
    """Every sampling setting of `localgen generate`: temperature, top-p, top-k, min-p,
    repetition penalty, max tokens, seed, JSON answers (--json, --json-schema FILE) and stop
    strings (one a line). Returns validated
    SamplingParams (None: cancelled); a bad value is named under the fields."""

    DEFAULT_CSS = _MODAL_CSS.format(name="SamplingScreen") + """
    SamplingScreen .row { height: 1; }
    SamplingScreen .row Label { width: 30; }
    SamplingScreen .row Input { width: 1fr; }
    SamplingScreen #stop { height: 3; background: $boost; }
    SamplingScreen .title { margin: 0 0 1 0; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "ok", "OK")]

    def __init__(self, sampling: SamplingParams):
        super().__init__()
        self.sampling = sampling

    def compose(self) -> ComposeResult:
        s = self.sampling
        with Vertical():
            yield Label("Sampling settings (Enter or Ctrl+S applies)", classes="title")
            for fid, label, _ in SAMPLING_FIELDS:
                value = getattr(s, fid)
                with Horizontal(classes="row"):
                    yield Label(label)
                    yield Input("" if value is None else str(value), id=fid, compact=True,
                                placeholder="blank" if fid == "seed" else "")
            with Horizontal(classes="row"):
                yield Label("JSON answers")
                yield Input(self._format_text(), id="response_format", compact=True,
                            placeholder="blank: text · json: any object · a JSON Schema file")
            yield Label("stop strings (one a line; not shown in the answer)")
            yield TextArea("\n".join(s.stop), id="stop", soft_wrap=False, compact=True)
            yield Static("", id="sampling-error", classes="error")
            with Horizontal():
                yield Button("OK", id="ok", variant="primary")
                yield Button("Cancel", id="cancel")

    def parse(self) -> SamplingParams:
        """The fields as SamplingParams; ValueError naming the bad field."""
        out = dict(asdict(self.sampling))
        for fid, label, kind in SAMPLING_FIELDS:
            raw = self.query_one(f"#{fid}", Input).value.strip()
            if fid == "seed" and not raw:
                out[fid] = None
                continue
            try:
                out[fid] = kind(raw)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise ValueError(f"{label.split(' (')[0]} must be {what}, got {raw!r}") from None
        stops = self.query_one("#stop", TextArea).text.split("\n")
        out["stop"] = tuple(x for x in stops if x)
        out["response_format"] = self._parse_format(self.query_one("#response_format", Input).value.strip())
        return SamplingParams(**out).validate()

    def _format_text(self) -> str:
        rf = self.sampling.response_format
        if rf is None or rf.get("type") == "text":
            return ""
        if rf.get("type") == "json_object":
            return "json"
        return f"(schema {rf.get('json_schema', {}).get('name', '?')}: kept)"

    def _parse_format(self, raw: str) -> dict | None:
        """The JSON answers field as OpenAI's response_format (`generate --json` / `--json-schema
        FILE`); ValueError naming a file that cannot be read or is not a usable schema."""
        import json

        from localgen.runtime.structured import check_response_format

        if raw == self._format_text():
            return self.sampling.response_format
        if not raw:
            return None
        if raw.lower() == "json":
            return {"type": "json_object"}
        path = Path(raw).expanduser()
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"JSON answers: cannot read a JSON Schema from {path}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
        name = "".join(c if c.isalnum() or c in "_-" else "_" for c in path.stem)[:64] or "schema"
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        check_response_format(rf)
        return rf

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def action_ok(self) -> None:
        try:
            self.dismiss(self.parse())
        except ValueError as e:
            self.query_one("#sampling-error", Static).update(str(e))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class SaveScreen(ModalScreen[str | None]):
    """Where to save the transcript; PATH.md and PATH.json are written."""

    DEFAULT_CSS = _MODAL_CSS.format(name="SaveScreen")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, default: str):
        super().__init__()
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Save transcript as (writes .md and .json)", classes="title")
            yield Input(self.default, id="save-path")
            with Horizontal():
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        path = self.query_one(Input).value.strip()
        self.dismiss(path or None)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def default_transcript_path() -> str:
    return str(Path.cwd() / time.strftime("localgen-chat-%Y%m%d-%H%M%S"))


class JobRow(Vertical):
    """One batch job: its files, a progress bar and the figures."""

    DEFAULT_CSS = """
    JobRow { height: auto; margin: 0 0 1 0; }
    JobRow ProgressBar { width: 100%; }
    JobRow .job-stats { color: $text-muted; }
    """

    def __init__(self, job: BatchJobView):
        super().__init__()
        self.job = job

    def compose(self) -> ComposeResult:
        yield Static(self._title(), classes="job-title")
        yield ProgressBar(total=None, show_eta=False)
        yield Static("queued", classes="job-stats")

    def _title(self) -> str:
        return f"{os.path.basename(self.job.in_path)} → {os.path.basename(self.job.out_path)}"

    def on_mount(self) -> None:
        self.refresh_job()

    def refresh_job(self) -> None:
        job, p = self.job, self.job.progress
        bars = self.query(ProgressBar)
        if not bars:
            return  # not composed yet: on_mount refreshes
        bar = bars.first()
        if p is not None:
            if p.done + p.failed == 0 and job.state == "running":
                # the requests run side by side and often finish together: until the first one
                # does, the bar pulses (tokens count up below) rather than sitting at 0%
                bar.update(total=None)
            else:
                bar.update(total=max(p.total, 1), progress=p.done + p.failed)
            stats = (f"{job.state}: {p.done}/{p.total} done, {p.failed} failed · "
                     f"{p.tokens} tok · {p.tokens_per_s:.1f} tok/s · {p.elapsed:.1f} s")
        else:
            stats = job.state
        if job.state == "failed" and job.error is not None:
            stats = f"failed: {job.error}"
        elif job.state == "done" and job.summary is not None:
            s = job.summary
            bar.update(total=max(s.total, 1), progress=max(s.total, 1))
            stats = (f"done: {s.done} written, {s.skipped_resume} resumed, {s.failed} failed · "
                     f"{s.tokens} tok in {s.seconds:.1f} s")
        self.query_one(".job-stats", Static).update(stats)


class BatchScreen(Screen):
    """Submit a JSONL file as a background batch job; watch every job's progress. The chat
    keeps streaming behind this screen (Esc goes back)."""

    DEFAULT_CSS = """
    BatchScreen { padding: 0 1; }
    BatchScreen .title { text-style: bold; }
    BatchScreen .hint { color: $text-muted; }
    BatchScreen #batch-form { height: auto; }
    BatchScreen #batch-form Input { width: 1fr; }
    BatchScreen #batch-error { color: $error; height: auto; }
    BatchScreen #jobs { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "back", "Back to chat"), Binding("f5", "back", "Back to chat", show=False)]

    def __init__(self, service: ChatService):
        super().__init__()
        self.service = service
        self.rows: dict[str, JobRow] = {}

    def compose(self) -> ComposeResult:
        yield Label("Batch jobs (JSONL in, JSONL out; chat answers go first)", classes="title")
        yield Label("Native lines {\"id\",\"prompt\"|\"messages\",...} or OpenAI Batch lines.",
                    classes="hint")
        with Vertical(id="batch-form"):
            yield Input(placeholder="input .jsonl path", id="batch-in")
            yield Input(placeholder="output .jsonl (default: <input>.out.jsonl)", id="batch-out")
            yield Button("Submit", id="batch-submit", variant="primary")
        yield Static("", id="batch-error")
        yield VerticalScroll(id="jobs")
        yield Footer()

    def on_mount(self) -> None:
        for job in self.service.batch_jobs:
            self._add_row(job)

    def _add_row(self, job: BatchJobView) -> None:
        if job.job_id in self.rows:
            return
        row = JobRow(job)
        self.rows[job.job_id] = row
        self.query_one("#jobs").mount(row)

    @on(Input.Submitted)
    @on(Button.Pressed, "#batch-submit")
    def submit(self) -> None:
        src = self.query_one("#batch-in", Input).value.strip()
        dst = self.query_one("#batch-out", Input).value.strip()
        err = self.query_one("#batch-error", Static)
        if not src:
            err.update("give the input .jsonl path")
            return
        src_p = Path(src).expanduser()
        if not src_p.is_file():
            err.update(f"no such file: {src_p}")
            return
        dst_p = Path(dst).expanduser() if dst else src_p.with_name(src_p.stem + ".out.jsonl")
        err.update("")
        job = self.app.submit_batch(src_p, dst_p)
        self._add_row(job)

    def refresh_job(self, job: BatchJobView) -> None:
        if job.job_id not in self.rows:
            self._add_row(job)
        else:
            self.rows[job.job_id].refresh_job()

    def action_back(self) -> None:
        self.app.pop_screen()
