"""The `localgen tune` wizard (Textual): hardware -> profile -> model and workload -> policy -> saved.

Screens follow issue 4: hardware found, profile run with progress, model and workload, the chosen
policy with its prediction, memory per tier and the alternatives (one sentence each), then save.
"""

from __future__ import annotations

from textual import work
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, ProgressBar, Select, Static

from localgen.policy.tuning import TuneRequest, result_lines, run_search, save_result
from localgen.profiler.hardware import GiB, ProfileNotFoundError, load_profile, shipped_profile_names


def _hw_summary(hw) -> str:
    gpu = f"{hw.gpu_name}, {hw.gpu_mem / GiB:.1f} GiB" if hw.has_gpu else "no GPU (the CPU computes)"
    return (f"Profile {hw.name} ({hw.date}): GPU {gpu}; CPU {hw.cpu_name}, {hw.cpu_mem / GiB:.1f} GiB; "
            f"disk {hw.disk_mem / GiB:.0f} GiB at {hw.dtoc_bdw / 1e9:.2f} GB/s read")


class HardwareScreen(Screen):
    """Step 1: which hardware profile to use (saved, shipped, or measure now)."""

    def compose(self) -> ComposeResult:
        yield Header()
        app: TuneApp = self.app
        try:
            saved = load_profile(app.profile_name)
            app.hw = saved
            text = _hw_summary(saved)
        except ProfileNotFoundError:
            text = "No saved hardware profile: measure this machine, or pick a shipped one."
        opts = [(n, n) for n in shipped_profile_names()]
        yield Vertical(Label("1. Hardware", id="title"), Static(text, id="hw"),
                       Select(opts, prompt="shipped profile", id="shipped"),
                       Horizontal(Button("Use this profile", id="use", variant="primary"),
                                  Button("Measure now", id="measure")))
        yield Footer()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.value is not Select.BLANK:
            self.app.hw = load_profile(str(event.value))
            self.query_one("#hw", Static).update(_hw_summary(self.app.hw))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "measure":
            self.app.push_screen(ProfileScreen())
        elif self.app.hw is not None:
            self.app.push_screen(ModelScreen())


class ProfileScreen(Screen):
    """Step 2: run the probes with a progress bar, save, continue."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Vertical(Label("2. Measuring this machine"), ProgressBar(id="bar"), Static("", id="step"))
        yield Footer()

    def on_mount(self) -> None:
        self.measure()

    @work(thread=True, exclusive=True)
    def measure(self) -> None:
        from localgen.cli.profile_cmd import default_offload_dir
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
    """Step 3: model spec and workload."""

    def compose(self) -> ComposeResult:
        r: TuneRequest = self.app.req
        yield Header()
        yield Vertical(
            Label("3. Model and workload"), Static(_hw_summary(self.app.hw)),
            Input(r.model, placeholder="preset, hub id, local dir or GGUF path", id="model"),
            Select([("chat (batch 1, lowest latency)", "chat"), ("batch (throughput)", "batch")],
                   value=r.workload, allow_blank=False, id="workload"),
            Input(str(r.prompt_len), placeholder="prompt tokens", id="prompt_len", type="integer"),
            Input(str(r.gen_len), placeholder="generated tokens", id="gen_len", type="integer"),
            Select([("4-bit: auto", "auto"), ("4-bit: off", "off"), ("4-bit: on", "on")],
                   value=r.compression, allow_blank=False, id="compression"),
            Select([("tiers: fastest over GPU, RAM and disk", "any"),
                    ("tiers: fewest that hold the model", "fewest")],
                   value=r.tiers, allow_blank=False, id="tiers"),
            Button("Search", id="search", variant="primary"), Static("", id="error"))
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        r = self.app.req
        r.model = self.query_one("#model", Input).value.strip() or r.model
        r.workload = self.query_one("#workload", Select).value
        r.prompt_len = int(self.query_one("#prompt_len", Input).value or r.prompt_len)
        r.gen_len = int(self.query_one("#gen_len", Input).value or r.gen_len)
        r.compression = self.query_one("#compression", Select).value
        r.tiers = self.query_one("#tiers", Select).value
        try:
            self.app.result = run_search(r, self.app.hw)
        except Exception as e:  # unknown model, nothing fits: say so and stay
            self.query_one("#error", Static).update(f"[red]{e}[/red]")
            return
        self.app.push_screen(ResultScreen())


class ResultScreen(Screen):
    """Step 4: the chosen policy, prediction, memory per tier, alternatives; save."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Vertical(Label("4. Policy"), Static("\n".join(result_lines(self.app.result)), id="result"),
                       Horizontal(Button("Save as default", id="save", variant="primary"),
                                  Button("Back", id="back")), Static("", id="saved"))
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "back":
            self.app.pop_screen()
            return
        path = save_result(self.app.req, self.app.hw, self.app.result)
        self.app.saved_path = path
        self.query_one("#saved", Static).update(f"saved to {path}")
        self.app.exit(path)


class TuneApp(App):
    """The wizard. ``profile_name``: start from this profile (name or path) instead of the saved one."""

    TITLE = "localgen tune"
    BINDINGS = [("q", "quit", "Quit")]

    def __init__(self, req: TuneRequest | None = None, profile_name: str | None = None, offload_dir=None):
        super().__init__()
        self.req = req or TuneRequest()
        self.profile_name, self.offload_dir = profile_name, offload_dir
        self.hw = None
        self.result = None
        self.saved_path = None

    def on_mount(self) -> None:
        self.push_screen(HardwareScreen())
