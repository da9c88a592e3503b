"""The tune wizard and the why sentence: the search on a worker (cancellable), every field
labelled, chat by default, each shipped profile described, the sentence the wizard shows equal
to the one `tune --yes` prints, the saved path with its undo, and `tune --reset`."""

from __future__ import annotations

import asyncio
import time

import pytest
from typer.testing import CliRunner

from localgen.cli.main import app as cli
from localgen.policy import load_saved_policy
from localgen.policy.explain import cost_model_for, why_sentence
from localgen.policy.store import policy_path
from localgen.policy.tuning import TuneRequest, run_search
from localgen.profiler.hardware import load_profile, shipped_profile_names
from localgen.tui.tune import HardwareScreen, ModelScreen, ResultScreen, TuneApp


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path))
    return tmp_path


async def wait_for(pilot, cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def text(widget) -> str:
    return str(widget.render())


def test_search_on_a_worker_can_be_cancelled():
    """A long search (OPT-30B, batch, every compression option on the T4 profile) is stopped
    by Cancel once it has reported progress; the form comes back for another try."""

    async def drive():
        app = TuneApp(TuneRequest(model="opt-30b", workload="batch", compression="auto"),
                      profile_name="flexgen_t4")
        async with app.run_test(size=(120, 50)) as pilot:
            await pilot.click("#use")
            await pilot.pause()
            scr = app.screen
            assert isinstance(scr, ModelScreen)
            await pilot.click("#search")
            await wait_for(pilot, lambda: "LPs solved" in text(scr.query_one("#search-step")),
                           what="search progress")
            assert scr.query_one("#form").disabled and not scr.query_one("#cancel").disabled
            assert scr.query_one("#search-bar").progress >= 0
            await pilot.click("#cancel")
            await wait_for(pilot, lambda: app.searches_done == 1, what="the cancelled search to end")
            await pilot.pause()
            assert app.result is None and isinstance(app.screen, ModelScreen)
            assert text(scr.query_one("#error")) == "Search cancelled."
            assert not scr.query_one("#form").disabled and scr.query_one("#cancel").disabled

    asyncio.run(drive())


def test_fields_labelled_chat_by_default_and_profiles_described():
    async def drive():
        app = TuneApp(profile_name="cpu_2core")
        async with app.run_test(size=(120, 60)) as pilot:
            hw_screen = app.screen
            assert isinstance(hw_screen, HardwareScreen)
            described = text(hw_screen.query_one("#profiles"))
            for name in shipped_profile_names():
                hw = load_profile(name)
                assert f"• {name}: {name} ({hw.date})" in described
            assert "Published figures (Sheng et al." in described  # flexgen_t4's source
            for scr in (hw_screen, None):
                if scr is None:
                    await pilot.click("#use")
                    await pilot.pause()
                    scr = app.screen
                for field in scr.query("Input, Select"):
                    row = field.parent
                    labels = [lbl for lbl in row.query("Label") if lbl.parent is row]
                    assert "row" in row.classes and labels and text(labels[0]).strip(), field.id
            assert app.screen.query_one("#workload").value == "chat"

    asyncio.run(drive())
    default = next(p for p in __import__("typer").main.get_command(cli).commands["tune"].params
                   if p.name == "workload").default
    assert default == "chat"


def test_wizard_why_sentence_saved_path_and_undo(config_dir):
    req = TuneRequest()  # the embedded model, chat
    hw = load_profile("cpu_2core")
    expected = why_sentence(cost_model_for(req.model, hw, req.prompt_len, req.gen_len), run_search(req, hw))

    async def drive():
        app = TuneApp(TuneRequest(), profile_name="cpu_2core")
        async with app.run_test(size=(140, 50)) as pilot:
            await pilot.click("#use")
            await pilot.pause()
            await pilot.click("#search")
            await wait_for(pilot, lambda: isinstance(app.screen, ResultScreen), what="the result")
            await pilot.pause()
            assert text(app.screen.query_one("#why")) == expected
            await pilot.click("#save")
            await pilot.pause()
            saved = text(app.screen.query_one("#saved"))
            return app, saved

    app, saved = asyncio.run(drive())
    path = policy_path("smollm2-135m")
    assert app.saved_path == path and path.exists()
    assert f"Saved to {path}." in saved and "localgen tune --reset --model smollm2-135m" in saved
    # the same sentence from `tune --yes`, and --reset undoes the save
    r = CliRunner().invoke(cli, ["tune", "--yes", "--profile", "cpu_2core"])
    assert r.exit_code == 0, r.output
    assert " ".join(expected.split()) in " ".join(r.stdout.split())
    assert "localgen tune --reset --model smollm2-135m" in r.stdout
    r = CliRunner().invoke(cli, ["tune", "--reset"])
    assert r.exit_code == 0 and "removed" in r.output and str(path) in r.output.replace("\n", "")
    assert not path.exists() and load_saved_policy("smollm2-135m") is None
    r = CliRunner().invoke(cli, ["tune", "--reset"])
    assert r.exit_code == 0 and "no saved policy for smollm2-135m" in r.output


def test_why_sentence_reads_the_cost_models_numbers():
    """What the sentence claims, checked against the prediction it was read from."""
    # Llama-2-70B on the shipped h100 profile (chat): its 16-bit weights exceed the usable GPU memory
    hw = load_profile("h100")
    req = TuneRequest(model="llama-2-70b", workload="chat", compression="auto")
    cm = cost_model_for(req.model, hw, req.prompt_len, req.gen_len)
    res = run_search(req, hw)
    s = why_sentence(cm, res)
    assert res.policy.wg >= 0.999 and res.policy.compress_weight
    assert cm.total_weight_bytes(False) > res.prediction.capacity["gpu"] > cm.total_weight_bytes(True)
    assert "the weights fit in GPU memory" in s and "only at 4 bits" in s
    assert f"at batch {res.policy.bls} decoding is bound by" in s
    # OPT-30B without compression on the T4 (chat): split weights, PCIe-bound decode
    hw = load_profile("flexgen_t4")
    req = TuneRequest(model="opt-30b", workload="chat", compression="off")
    cm = cost_model_for(req.model, hw, req.prompt_len, req.gen_len)
    res = run_search(req, hw)
    s = why_sentence(cm, res)
    pr = res.prediction
    assert pr.decode_bottleneck == "ctog" and "bound by copying from RAM to the GPU" in s
    assert f"{pr.decode_terms['ctog'] * 1e3:.3g} ms per layer a step" in s
    assert "do not fit in GPU memory" in s and f"{res.policy.wg:.0%} on the GPU" in s
