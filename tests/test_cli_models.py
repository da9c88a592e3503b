"""`localgen models --json`: one object per model, the same rows as the table."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from localgen.cli.main import app
from localgen.models.sources import EMBEDDED_NAME, embedded_gguf_path


def test_models_json_lists_the_embedded_model_and_given_paths(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    missing = tmp_path / "missing.gguf"
    res = CliRunner().invoke(app, ["models", "--json", str(missing)], env=env)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == [EMBEDDED_NAME, "missing.gguf"]
    embedded, bad = rows
    assert embedded["kind"] == "embedded" and embedded["architecture"] == "LlamaForCausalLM"
    assert embedded["size_bytes"] == embedded_gguf_path().stat().st_size
    assert embedded["path"] == str(embedded_gguf_path()) and embedded["error"] is None
    assert bad["error"] == "no such file or directory" and bad["size_bytes"] == 0


def test_models_table_is_the_default(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    res = CliRunner().invoke(app, ["models"], env=env)
    assert res.exit_code == 0 and "Local models" in res.stdout and "embedded" in res.stdout
    assert not res.stdout.lstrip().startswith("[")
