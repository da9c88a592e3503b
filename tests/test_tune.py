"""`localgen tune --yes`, `localgen profile`, and the Textual wizard driven by a pilot."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from localgen.cli.main import app
from localgen.policy import load_saved_policy
from localgen.policy.store import load_saved_meta


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path))
    return tmp_path


def test_tune_yes_saves_the_default():
    r = CliRunner().invoke(app, ["tune", "--yes", "--profile", "flexgen_t4", "--model", "opt-30b",
                                 "--compression", "off", "--workload", "batch"])
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.output and "alternative" in r.output
    p = load_saved_policy("opt-30b")
    assert p is not None and 0.1 <= p.wg <= 0.3


def test_tune_yes_chat_on_cpu_only_profile():
    r = CliRunner().invoke(app, ["tune", "--yes", "--profile", "cpu_2core", "--workload", "chat"])
    assert r.exit_code == 0, r.output
    assert load_saved_policy("smollm2-135m").bls == 1


def test_tune_yes_fewest_tiers_keeps_opt30b_off_the_disk():
    """``--tiers fewest`` (the paper's tuning rule): for localgen's runtime on the T4 the default
    ("any") puts ~10% of OPT-30B's weights on the SSD to run a larger block; "fewest" keeps them in
    RAM, and the saved metadata says which rule chose the policy."""
    args = ["tune", "--yes", "--profile", "flexgen_t4", "--model", "opt-30b", "--compression", "off",
            "--workload", "batch"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert load_saved_policy("opt-30b").wd > 0.05
    r = CliRunner().invoke(app, args + ["--tiers", "fewest"])
    assert r.exit_code == 0, r.output
    p = load_saved_policy("opt-30b")
    assert p.wd == p.cd == p.hd == 0 and p.wc > 0.5
    assert load_saved_meta("opt-30b")["tiers"] == "fewest"


@pytest.mark.parametrize("option,value", [("--workload", "nightly"), ("--compression", "maybe"),
                                          ("--tiers", "ssd")])
def test_tune_rejects_bad_options(option, value):
    r = CliRunner().invoke(app, ["tune", "--yes", option, value])
    assert r.exit_code != 0 and option in r.output and value in r.output


def test_profile_command_quick_cpu(config_dir, tmp_path):
    r = CliRunner().invoke(app, ["profile", "--quick", "--cpu-only", "--offload-dir", str(tmp_path / "off")])
    assert r.exit_code == 0, r.output
    d = json.loads((config_dir / "hardware.json").read_text())
    assert d["gpu_name"] is None and d["dtoc_bdw"] > 0


def test_wizard_pilot_flow():
    try:
        from localgen.tui.tune import TuneApp
    except ImportError:
        from tui.tune import TuneApp
    from localgen.policy.tuning import TuneRequest

    async def drive():
        app_ = TuneApp(TuneRequest(model="opt-30b", compression="off", workload="batch"),
                       profile_name="flexgen_t4")
        async with app_.run_test(size=(120, 50)) as pilot:
            await pilot.click("#use")
            await pilot.pause()
            app_.screen.query_one("#tiers").value = "fewest"
            await pilot.click("#search")
            while app_.searches_done == 0:  # the search runs on a worker thread
                await pilot.pause(0.1)
            await pilot.pause()
            assert app_.result is not None
            await pilot.click("#save")
            await pilot.pause()
        return app_

    app_ = asyncio.run(drive())
    assert app_.saved_path is not None and app_.saved_path.exists()
    p = load_saved_policy("opt-30b")  # "any" would put ~10% of the weights on disk
    assert app_.req.tiers == "fewest" and p.wd == p.cd == 0 and p.wc > 0.5
