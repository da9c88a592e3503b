"""`localgen serve` reports the version `localgen --version` prints: in /health (also while the
model loads) and in every /v1/models entry. The routes run on a service stand-in that only has
the attributes these two routes read; test_server.py covers them against the real engine."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from localgen.server.app import create_app
from localgen.server.generation import ServerConfig

DECLARED = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())[
    "project"]["version"]


def client(state: str, **config) -> TestClient:
    service = SimpleNamespace(state=state, llm=SimpleNamespace(tokenizer=None))
    return TestClient(create_app(service, ServerConfig(model_names=("m", "alias"), **config)))


def test_health_reports_the_version_ready_and_loading():
    ready = client("ready").get("/health")
    assert (ready.status_code, ready.json()) == (200, {"status": "ok", "version": DECLARED})
    loading = client("loading").get("/health")
    assert (loading.status_code, loading.json()) == (503, {"status": "loading",
                                                           "version": DECLARED})


def test_models_report_the_version_behind_the_key():
    c = client("ready", api_key="k")
    assert c.get("/v1/models").status_code == 401
    cards = c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"]
    assert [(m["id"], m["localgen_version"]) for m in cards] == [("m", DECLARED),
                                                                 ("alias", DECLARED)]
    one = c.get("/v1/models/alias", headers={"Authorization": "Bearer k"}).json()
    assert (one["id"], one["localgen_version"]) == ("alias", DECLARED)
