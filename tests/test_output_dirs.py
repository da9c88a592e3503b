"""`localgen profile`, `tune` and `chat` check the folders they write into before measuring or
loading a model, and `profile` never loses measurements it cannot save where asked.

The measurement is replaced by a canned profile (the shipped cpu_2core): these tests are about
where the numbers go. Tests run as root, where a chmod'ed folder still takes writes, so an
unusable folder is a path under a regular file, or ``os.access`` answers no."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from localgen import fileio
from localgen.cli import chat_cmd
from localgen.cli.main import app
from localgen.profiler import probes
from localgen.profiler.hardware import HardwareProfile, load_profile


@pytest.fixture
def measured(monkeypatch):
    """Replaces the measurement: returns the calls made to it."""
    calls = []
    canned = load_profile("cpu_2core")

    def run_profile(offload_dir, *args, **kwargs):
        calls.append(offload_dir)
        return canned

    monkeypatch.setattr(probes, "run_profile", run_profile)
    return calls


@pytest.fixture
def blocked(tmp_path):
    """A path no folder can be made at: under a regular file."""
    f = tmp_path / "a-file"
    f.write_text("")
    return f / "cfg"


def test_profile_checks_the_config_folder_before_measuring(monkeypatch, measured, blocked):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(blocked))
    r = CliRunner().invoke(app, ["profile"])
    assert r.exit_code == 1 and measured == []
    assert str(blocked) in r.stderr and "LOCALGEN_CONFIG_DIR" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_profile_checks_the_offload_folder_before_measuring(tmp_path, monkeypatch, measured, blocked):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "cfg"))
    r = CliRunner().invoke(app, ["profile", "--offload-dir", str(blocked)])
    assert r.exit_code == 1 and measured == []
    assert str(blocked) in r.stderr and "--offload-dir" in r.stderr


def test_profile_saves_measurements_elsewhere_when_the_config_folder_fails(tmp_path, monkeypatch,
                                                                          measured):
    cfg, work = tmp_path / "cfg", tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(cfg))

    def break_config_dir(offload_dir, *args, **kwargs):
        # the folder passed the check, then went away during the measurement
        shutil.rmtree(cfg)
        cfg.write_text("")
        return load_profile("cpu_2core")

    monkeypatch.setattr(probes, "run_profile", break_config_dir)
    r = CliRunner().invoke(app, ["profile", "--offload-dir", str(tmp_path / "off")])
    assert r.exit_code == 1
    printed = json.JSONDecoder().raw_decode(r.stdout[r.stdout.index("{"):])[0]
    assert HardwareProfile.from_dict(printed) == load_profile("cpu_2core")
    [spare] = work.glob("localgen-hardware-*.json")
    assert HardwareProfile.from_json(spare.read_text()) == load_profile("cpu_2core")
    assert str(spare) in r.stderr and "--profile" in r.stderr and str(cfg) in r.stderr


def test_profile_saves_where_asked(tmp_path, monkeypatch, measured):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "cfg"))
    out = tmp_path / "new" / "hw.json"
    r = CliRunner().invoke(app, ["profile", "--output", str(out), "--offload-dir", str(tmp_path / "off")])
    assert r.exit_code == 0, r.output
    assert HardwareProfile.from_json(out.read_text()) == load_profile("cpu_2core")


def test_tune_checks_the_policy_folder_before_searching(monkeypatch, measured, blocked):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(blocked))
    r = CliRunner().invoke(app, ["tune", "--yes", "--profile", "cpu_2core"])
    assert r.exit_code == 1 and measured == []
    assert str(blocked) in r.stderr and "LOCALGEN_CONFIG_DIR" in r.stderr
    assert "Policy:" not in r.stdout


def test_tune_checks_the_offload_folder_when_it_will_measure(tmp_path, monkeypatch, measured, blocked):
    monkeypatch.setenv("LOCALGEN_CONFIG_DIR", str(tmp_path / "cfg"))
    r = CliRunner().invoke(app, ["tune", "--yes", "--offload-dir", str(blocked)])
    assert r.exit_code == 1 and measured == []
    assert str(blocked) in r.stderr and "--offload-dir" in r.stderr


def test_chat_warns_before_loading_that_transcripts_need_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real_access = os.access
    # root writes through a chmod'ed folder, so the kernel's answer is replaced instead
    monkeypatch.setattr(fileio.os, "access",
                        lambda p, mode: False if os.fspath(p) == str(tmp_path) else real_access(p, mode))

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(chat_cmd, "make_service", load)
    r = CliRunner().invoke(app, ["chat"], env={"LOCALGEN_DEBUG": "1"})  # Loaded passes through
    assert isinstance(r.exception, Loaded), r.output  # the chat still starts
    assert str(tmp_path) in r.stderr and "F4 needs another folder" in r.stderr
