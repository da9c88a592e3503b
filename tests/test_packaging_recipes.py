"""packaging/'s recipes agree with the CLI they run, and install-tool.sh rejects bad input with a
clear message. (The recipes run for real in packaging/smoke.sh, which CI runs before the tests.)"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
import yaml
from typer.main import get_command

from localgen.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "packaging"


def serve_command() -> click.Command:
    return get_command(app).commands["serve"]


def dockerfile_entrypoint(path: Path) -> list[str]:
    (line,) = [ln for ln in path.read_text().splitlines() if ln.startswith("ENTRYPOINT ")]
    return json.loads(line[len("ENTRYPOINT "):])


def unit_exec_start() -> list[str]:
    (line,) = [ln for ln in (PKG / "localgen.service").read_text().splitlines()
               if ln.startswith("ExecStart=")]
    return shlex.split(line[len("ExecStart="):])


def option_names(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


@pytest.mark.parametrize("argv", [
    dockerfile_entrypoint(PKG / "Dockerfile"),
    dockerfile_entrypoint(PKG / "Dockerfile.cuda"),
    unit_exec_start(),
], ids=["Dockerfile", "Dockerfile.cuda", "localgen.service"])
def test_recipes_run_serve_with_options_it_has(argv):
    assert Path(argv[0]).name == "localgen" and argv[1] == "serve"
    known = {opt for p in serve_command().params for opt in p.opts}
    assert set(option_names(argv)) <= known, set(option_names(argv)) - known
    host = argv[argv.index("--host") + 1]
    assert host in ("0.0.0.0", "127.0.0.1")


def test_api_key_variable_is_the_one_serve_reads():
    (key,) = [p for p in serve_command().params if p.name == "api_key"]
    assert key.envvar == "LOCALGEN_API_KEY"
    for name in ("Dockerfile", "Dockerfile.cuda", "localgen.service", "README.md"):
        assert key.envvar in (PKG / name).read_text(), name
    compose = yaml.safe_load((PKG / "compose.yaml").read_text())["services"]["localgen"]
    assert key.envvar in compose["environment"]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_serves_healthchecks_and_exposes_one_port(name):
    text = (PKG / name).read_text()
    entry = dockerfile_entrypoint(PKG / name)
    port = entry[entry.index("--port") + 1]
    assert re.search(rf"^EXPOSE {port}$", text, re.M)
    assert f"http://127.0.0.1:{port}/health" in text
    assert re.search(r"^USER 10001:10001$", text, re.M)  # not root
    assert 'VOLUME ["/data"]' in text
    assert "HF_HOME=/data/" in text and "LOCALGEN_CONFIG_DIR=/data/" in text


def test_compose_reserves_a_gpu_for_the_cuda_image():
    svc = yaml.safe_load((PKG / "compose.yaml").read_text())["services"]["localgen"]
    assert svc["build"]["dockerfile"] == "packaging/Dockerfile.cuda"
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def run_install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PKG / "install-tool.sh"), *args], capture_output=True,
                          text=True, timeout=60)


def test_install_tool_help():
    out = run_install("--help")
    assert out.returncode == 0 and "--torch-index" in out.stdout and "#" not in out.stdout


@pytest.mark.parametrize("args, message", [
    (("--frobnicate",), "unknown option --frobnicate"),
    (("/nowhere/localgen-0-py3-none-any.whl",),
     "/nowhere/localgen-0-py3-none-any.whl: no such file"),
    (("--tool", "conda", __file__), "--tool is pipx or uv, not conda"),
])
def test_install_tool_refuses_bad_input(args, message):
    out = run_install(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
