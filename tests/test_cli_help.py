"""Every command's --help has an Examples section, and --help imports neither torch nor
transformers (a fresh interpreter checks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from localgen.cli.main import app


def _commands():
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        subs = getattr(cmd, "commands", None)
        if subs:
            yield from ([name, sub] for sub in subs)
        else:
            yield [name]


@pytest.mark.parametrize("argv", list(_commands()), ids=" ".join)
def test_every_command_shows_examples(argv):
    res = CliRunner().invoke(app, [*argv, "--help"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    assert "Examples:" in res.stdout and f"localgen {' '.join(argv)}" in res.stdout


@pytest.mark.parametrize("argv", [[], ["generate"], ["chat"]], ids=lambda a: " ".join(a) or "top")
def test_help_imports_no_torch(argv):
    code = ("import sys; from localgen.cli.main import app\n"
            f"try:\n    app({[*argv, '--help']!r}, prog_name='localgen')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "sys.stderr.write(repr(heavy))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stderr.strip().endswith("[]"), res.stderr


def _options():
    group = typer.main.get_command(app)
    for argv in _commands():
        cmd = group
        for name in argv:
            cmd = cmd.commands[name]
        for p in cmd.params:
            yield " ".join(argv), p


def test_defaults_are_shown_one_way():
    """A default is stated in the option's [default: …] slot (show_default), never in its prose."""
    import re

    prose = re.compile(r"\(default\b|\bdefault:|; default\b", re.IGNORECASE)
    bad = [f"{cmd} {p.opts[0]}: {p.help}" for cmd, p in _options() if p.help and prose.search(p.help)]
    assert bad == []


def test_a_missing_model_is_reported_without_importing_torch():
    code = ("import sys; from localgen.cli.main import app\n"
            "try:\n    app(['generate', 'hi', '--model', 'llama3'], prog_name='localgen')\n"
            "except SystemExit as e:\n    sys.stderr.write(f'exit {e.code} ')\n"
            "sys.stderr.write(repr([m for m in ('torch', 'transformers') if m in sys.modules]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "error: model 'llama3' not found" in res.stderr
    assert res.stderr.strip().endswith("exit 1 []"), res.stderr
