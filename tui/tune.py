"""The `localgen tune` wizard (Textual): hardware -> profile -> model and workload -> policy -> saved.

1. Hardware: the saved profile, a shipped one (each described from its own file) or measure now.
2. Measuring (when asked): the probes with a progress bar.
3. Model and workload, every field labelled; Search runs the policy search on a worker thread with
   a progress bar and Cancel, so the screen never freezes.
4. The policy, its prediction, memory per tier and the alternatives, then one sentence on why it
   wins (``localgen.policy.explain``, the sentence ``tune --yes`` prints); Save writes it and
   shows where, and how to undo it (``localgen tune --reset``).
"""

from __future__ import annotations

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, Select, Static
from textual.worker import get_current_worker

from localgen.policy.explain import cost_model_for, undo_hint, why_sentence
from localgen.policy.tuning import TuneRequest, result_lines, run_search, save_result
from localgen.profiler.hardware import GiB, ProfileNotFoundError, load_profile, shipped_profile_names

_CSS = """
Screen { padding: 0 1; }
.title { text-style: bold; margin: 1 0 0 0; }
.row { height: auto; }
.row Label { width: 22; padding: 1 0 0 0; }
.row Input, .row Select { width: 1fr; }
.hint { color: $text-muted; }
#error { color: $error; height: auto; }
#why { text-style: bold; margin: 1 0; }
Horizontal { height: auto; }
Button { margin: 0 1 0 0; }
"""


class SearchCancelled(Exception):
    """The user pressed Cancel while the policy search ran."""


def hw_summary(hw) -> str:
    """One line about a profile: GPU, CPU and RAM, disk, and when it was measured."""
    gpu = f"GPU {hw.gpu_name}, {hw.gpu_mem / GiB:.1f} GiB" if hw.has_gpu else "no GPU (the CPU computes)"
    return (f"{hw.name} ({hw.date}): {gpu}; CPU {hw.cpu_name}, {hw.cpu_mem / GiB:.1f} GiB; "
            f"disk {hw.disk_mem / GiB:.0f} GiB at {hw.dtoc_bdw / 1e9:.2f} GB/s read")


def profile_description(name: str) -> str:
    """A shipped profile described from its file: where its numbers come from, then the machine."""
    hw = load_profile(name)
    src = hw.source or {}
    origin = ("published figures (" + src["paper"].split(":")[0] + ")" if "paper" in src
              else f"measured by `localgen profile` on {hw.date}")
    machine = src.get("machine", "")
    return f"{hw_summary(hw)}. {origin[0].upper() + origin[1:]}" + (f"; {machine}" if machine else "") + "."


def _row(label: str, widget) -> Horizontal:
    return Horizontal(Label(label, classes="field-label"), widget, classes="row")


class HardwareScreen(Screen):
    """Step 1: which hardware profile to use (saved, shipped, or measure now)."""

    def compose(self) -> ComposeResult:
        yield Header()
        app: TuneApp = self.app
        try:
            saved = load_profile(app.profile_name)
            app.hw = saved
            text = hw_summary(saved)
        except ProfileNotFoundError:
            text = "No saved hardware profile: measure this machine, or pick a shipped one."
        opts = [(n, n) for n in shipped_profile_names()]
        with VerticalScroll():
            yield Label("1. Hardware", classes="title")
            yield Static(text, id="hw")
            yield _row("Shipped profile", Select(opts, prompt="pick one to use it", id="shipped"))
            yield Static("\n".join(f"• {n}: {profile_description(n)}" for n in shipped_profile_names()),
                         id="profiles", classes="hint")
            yield Horizontal(Button("Use this profile", id="use", variant="primary"),
                             Button("Measure now", id="measure"))
        yield Footer()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.value is not Select.BLANK:
            self.app.hw = load_profile(str(event.value))
            self.query_one("#hw", Static).update(hw_summary(self.app.hw))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "measure":
            self.app.push_screen(ProfileScreen())
        elif self.app.hw is not None:
            self.app.push_screen(ModelScreen())
        else:
            self.notify("Pick a shipped profile or measure this machine first.", severity="warning")


class ProfileScreen(Screen):
    """Step 2: run the probes with a progress bar, save, continue."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Vertical(Label("2. Measuring this machine", classes="title"), ProgressBar(id="bar"),
                       Static("", id="step"))
        yield Footer()

    def on_mount(self) -> None:
        self.measure()

    @work(thread=True, exclusive=True)
    def measure(self) -> None:
        from localgen.profiler.hardware import default_offload_dir
        from localgen.profiler.probes import run_profile

        def step(name, i, n):
            self.app.call_from_thread(self._progress, name, i, n)

        hw = run_profile(self.app.offload_dir or default_offload_dir(), progress=step)
        hw.save()
        self.app.hw = hw
        self.app.call_from_thread(self.app.switch_screen, ModelScreen())

    def _progress(self, name, i, n) -> None:
        self.query_one("#bar", ProgressBar).update(total=n, progress=i)
        self.query_one("#step", Static).update(name)


class ModelScreen(Screen):
    """Step 3: model spec and workload; Search runs on a worker thread (Cancel stops it)."""

    BINDINGS = [Binding("escape", "cancel_search", "Cancel search")]

    def compose(self) -> ComposeResult:
        r: TuneRequest = self.app.req
        yield Header()
        with VerticalScroll():
            yield Label("3. Model and workload", classes="title")
            yield Static(hw_summary(self.app.hw), classes="hint")
            with Vertical(id="form"):
                yield _row("Model", Input(r.model, placeholder="preset, hub id, local dir or GGUF path",
                                          id="model"))
                yield _row("Workload", Select([("chat (batch 1, lowest latency)", "chat"),
                                               ("batch (throughput)", "batch")],
                                              value=r.workload, allow_blank=False, id="workload"))
                yield _row("Prompt tokens", Input(str(r.prompt_len), id="prompt_len", type="integer"))
                yield _row("Generated tokens", Input(str(r.gen_len), id="gen_len", type="integer"))
                yield _row("4-bit compression", Select([("auto: whichever is faster", "auto"),
                                                        ("off", "off"), ("on", "on")],
                                                       value=r.compression, allow_blank=False,
                                                       id="compression"))
                yield _row("Memory tiers", Select([("fastest over GPU, RAM and disk", "any"),
                                                   ("fewest that hold the model", "fewest")],
                                                  value=r.tiers, allow_blank=False, id="tiers"))
            with Horizontal():
                yield Button("Search", id="search", variant="primary")
                yield Button("Cancel", id="cancel", disabled=True)
            yield ProgressBar(total=1.0, show_eta=False, id="search-bar")
            yield Static("", id="search-step", classes="hint")
            yield Static("", id="error")
        yield Footer()

    def read_form(self) -> TuneRequest:
        """The fields into the app's TuneRequest; ValueError naming a bad number."""
        r = self.app.req
        r.model = self.query_one("#model", Input).value.strip() or r.model
        r.workload = self.query_one("#workload", Select).value
        for fid, label in (("prompt_len", "prompt tokens"), ("gen_len", "generated tokens")):
            raw = self.query_one(f"#{fid}", Input).value.strip()
            value = int(raw) if raw.isdigit() else 0
            if value < 1:
                raise ValueError(f"{label} must be a whole number >= 1, got {raw!r}")
            setattr(r, fid, value)
        r.compression = self.query_one("#compression", Select).value
        r.tiers = self.query_one("#tiers", Select).value
        return r

    @on(Button.Pressed, "#search")
    def start_search(self) -> None:
        err = self.query_one("#error", Static)
        try:
            req = self.read_form()
        except ValueError as e:
            err.update(str(e))
            return
        err.update("")
        self._searching(True)
        self.search(req, self.app.hw)

    @on(Button.Pressed, "#cancel")
    def action_cancel_search(self) -> None:
        for w in self.workers:
            if w.name == "search" and not w.is_finished:
                w.cancel()
                self.query_one("#search-step", Static).update("cancelling…")

    def _searching(self, on_: bool) -> None:
        self.query_one("#form").disabled = on_
        self.query_one("#search", Button).disabled = on_
        self.query_one("#cancel", Button).disabled = not on_
        if on_:
            self.query_one("#search-bar", ProgressBar).update(progress=0)
            self.query_one("#cancel", Button).focus()

    @work(thread=True, exclusive=True, name="search", exit_on_error=False)
    def search(self, req: TuneRequest, hw) -> None:
        worker = get_current_worker()

        def progress(fraction: float, what: str) -> None:
            if worker.is_cancelled:
                raise SearchCancelled()
            self.app.call_from_thread(self._progress, fraction, what)

        try:
            res = run_search(req, hw, progress)
            why = why_sentence(cost_model_for(req.model, hw, req.prompt_len, req.gen_len), res)
        except SearchCancelled:
            self.app.call_from_thread(self._finished, None, None, "Search cancelled.")
        except Exception as e:  # noqa: BLE001 - unknown model, nothing fits: say so and stay
            self.app.call_from_thread(self._finished, None, None, str(e))
        else:
            self.app.call_from_thread(self._finished, res, why, None)

    def _progress(self, fraction: float, what: str) -> None:
        self.query_one("#search-bar", ProgressBar).update(progress=fraction)
        self.query_one("#search-step", Static).update(what)

    def _finished(self, res, why: str | None, error: str | None) -> None:
        self._searching(False)
        self.app.searches_done += 1
        if res is None:
            self.query_one("#error", Static).update(error or "")
            self.query_one("#search-step", Static).update("")
            self.query_one("#search", Button).focus()
            return
        self.query_one("#search-bar", ProgressBar).update(progress=1.0)
        self.app.result, self.app.why = res, why
        self.app.push_screen(ResultScreen())


class ResultScreen(Screen):
    """Step 4: the chosen policy, prediction, memory per tier, alternatives, why; save."""

    BINDINGS = [Binding("escape", "back", "Back")]

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll():
            yield Label("4. Policy", classes="title")
            yield Static("\n".join(result_lines(self.app.result)), id="result")
            yield Static(self.app.why or "", id="why")
            yield Horizontal(Button("Save as default", id="save", variant="primary"),
                             Button("Back", id="back"), Button("Quit", id="quit"))
            yield Static("", id="saved")
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "back":
            self.action_back()
        elif event.button.id == "quit":
            self.app.exit(self.app.saved_path)
        elif event.button.id == "save":
            self.save()

    def action_back(self) -> None:
        self.app.pop_screen()

    def save(self) -> None:
        app = self.app
        try:
            path = save_result(app.req, app.hw, app.result)
        except OSError as e:
            self.query_one("#saved", Static).update(f"[red]could not save: {e}[/red]")
            return
        app.saved_path = path
        self.query_one("#saved", Static).update(f"Saved to {path}.\n{undo_hint(app.req.model)}")
        self.query_one("#save", Button).disabled = True
        self.query_one("#quit", Button).focus()


class TuneApp(App):
    """The wizard. ``profile_name``: start from this profile (name or path) instead of the saved one.
    After it: ``saved_path`` (None: not saved), ``result`` and ``why`` of the last search."""

    TITLE = "localgen tune"
    CSS = _CSS
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, req: TuneRequest | None = None, profile_name: str | None = None, offload_dir=None):
        super().__init__()
        self.req = req or TuneRequest()
        self.profile_name, self.offload_dir = profile_name, offload_dir
        self.hw = None
        self.result = None
        self.why: str | None = None
        self.saved_path = None
        self.searches_done = 0

    def on_mount(self) -> None:
        self.push_screen(HardwareScreen())
