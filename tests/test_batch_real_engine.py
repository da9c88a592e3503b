"""`localgen batch` end to end through the real engine with a tiny local model: native and OpenAI
lines, a bad line, resume after a rerun."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from localgen.cli.main import app
from tests.tiny_models import make_hf_model


def test_batch_command_with_a_real_tiny_model(tmp_path):
    model = make_hf_model(tmp_path, "qwen2")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "a", "prompt": "hello world", "max_tokens": 6, "temperature": 0},
        {"id": "b", "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 5},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 4}},
        {"id": "d", "prompt": "x", "temperature": -3},
    ]
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["batch", str(inp), "-o", str(out), "--model", str(model), "--device", "cpu",
            "--kv-cache-memory", "4MiB", "--no-progress"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output  # line 4 is bad
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {r.get("custom_id") or r.get("id"): r for r in recs}
    assert by_id["a"]["usage"]["completion_tokens"] <= 6 and by_id["a"]["text"] is not None
    assert by_id["c"]["response"]["status_code"] == 200
    assert by_id["c"]["response"]["body"]["usage"]["completion_tokens"] <= 4
    bad = [r for r in recs if r.get("error")]
    assert len(bad) == 1 and bad[0]["line"] == 4 and "temperature" in bad[0]["error"]
    before = out.read_text()
    res = CliRunner().invoke(app, args)  # rerun: everything good is already done
    assert res.exit_code == 1
    assert out.read_text() == before
