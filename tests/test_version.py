"""One version, written in pyproject.toml, reported by `localgen --version` and
`localgen.__version__`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

import localgen
from localgen.cli.main import app
from localgen.version import package_version, pyproject_version

ROOT = Path(__file__).resolve().parents[1]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_cli_prints_the_declared_version(flag):
    result = CliRunner().invoke(app, [flag])
    assert result.exit_code == 0, result.output
    assert result.output == f"localgen {DECLARED}\n"


def test_version_flag_does_not_load_torch():
    code = ("import sys; from localgen.cli.main import app; "
            "sys.argv = ['localgen', '--version']; "
            "import atexit; atexit.register(lambda: print('torch' in sys.modules)); app()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.splitlines() == [f"localgen {DECLARED}", "False"], out.stderr


def test_package_attribute_matches():
    assert localgen.__version__ == DECLARED


def test_installed_metadata_matches_the_checkout():
    # a stale editable install (pyproject bumped, not reinstalled) fails here
    assert metadata.version("localgen") == DECLARED, "reinstall: pip install -e '.[test]'"


def test_source_tree_pyproject_wins(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "localgen"\nversion = "9.8.7rc1"\n')
    assert package_version(tmp_path) == "9.8.7rc1"


@pytest.mark.parametrize("text", [
    '[project]\nname = "other"\nversion = "9.9.9"\n',  # another project's tree
    '[project]\nname = "localgen"\ndynamic = ["version"]\n',  # no static version
    "[project\n",  # not TOML
])
def test_unusable_pyproject_falls_back_to_metadata(tmp_path, text):
    (tmp_path / "pyproject.toml").write_text(text)
    assert pyproject_version(tmp_path / "pyproject.toml") is None
    assert package_version(tmp_path) == metadata.version("localgen")


def test_no_pyproject_falls_back_to_metadata(tmp_path):
    assert package_version(tmp_path) == metadata.version("localgen")
