"""All installed import names live under `localgen`, in a wheel install and in an editable one."""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    "import importlib.util, json, localgen, localgen.kernels, localgen.tui, localgen.profiles;"
    "import localgen.kernels.paged_attention_ref;"
    "from importlib import resources;"
    "print(json.dumps({'localgen': localgen.__file__, 'kernels': localgen.kernels.__file__,"
    " 'tui': localgen.tui.__file__,"
    " 'profiles': sorted(p.name for p in resources.files('localgen.profiles').iterdir()),"
    " 'bare': [m for m in ('kernels', 'tui', 'profiles') if importlib.util.find_spec(m)]}))"
)


def run_check(cwd: Path, extra_path: Path | None = None) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_editable_install_imports_under_the_namespace(tmp_path):
    got = run_check(tmp_path)  # cwd outside the repo: only the installed finder can resolve
    assert Path(got["kernels"]).parent == ROOT / "kernels"
    assert Path(got["tui"]).parent == ROOT / "tui"
    assert got["bare"] == []


def test_every_package_is_listed_in_pyproject():
    # an editable install imports any folder under localgen/; a wheel carries only those listed
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            dotted = ".".join((name, *rel))
            assert dotted in listed, f"{dotted} ({init.parent}) is not in pyproject's packages"
    assert set(setuptools["package-dir"]) <= listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True)
    (built,) = wheels.glob("localgen-*.whl")
    return built


@pytest.mark.timeout(600)
def test_wheel_carries_every_runtime_file(wheel):
    # the files read at run time that are not Python modules: an editable install hides a miss
    expected = {f"localgen/kernels/csrc/{p.name}" for p in (ROOT / "kernels" / "csrc").iterdir()
                if p.suffix in (".c", ".h")}
    expected |= {f"localgen/profiles/{p.name}" for p in (ROOT / "profiles").glob("*.json")}
    expected |= {f"localgen/tui/{p.name}" for p in (ROOT / "tui").glob("*.tcss")}
    expected |= {f"localgen/examples/{p.name}" for p in (ROOT / "examples").glob("*.jsonl")}
    assert any(name.endswith(".c") for name in expected)
    assert "localgen/examples/prompts.jsonl" in expected
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = email.parser.Parser().parsestr(zf.read(meta).decode())["Version"]
    assert expected <= names, sorted(expected - names)
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.timeout(600)
def test_wheel_install_imports_under_the_namespace(tmp_path, wheel):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True)
    got = run_check(tmp_path, extra_path=site)
    for key in ("localgen", "kernels", "tui"):
        assert Path(got[key]).is_relative_to(site), got[key]
    assert got["bare"] == []
    assert any(name.endswith(".json") for name in got["profiles"])


def test_console_script_runs():
    exe = Path(sys.executable).parent / "localgen"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    for cmd in ("generate", "batch", "models", "bench"):
        assert cmd in out.stdout
