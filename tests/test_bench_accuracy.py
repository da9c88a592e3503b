"""`localgen bench accuracy` on a tiny model and tiny data: every config scores the same tokens and
examples, deltas are paired against the first config, and PASS/FAIL follows the targets."""

from __future__ import annotations

import json

import pytest

from localgen.bench import accuracy
from tests.tiny_models import make_hf_model

TEXT = ("the quick brown fox jumps over the lazy dog . a local runner places weights on the gpu , "
        "cpu or disk and generates text quickly . ") * 8
LAMBADA = ["the quick brown fox jumps over the lazy dog", "hello world this is a tiny tokenizer",
           "one two three four five six seven eight nine ten"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    data = root / "data"
    data.mkdir()
    (data / "wikitext2_test.raw").write_text(TEXT)
    (data / "lambada_test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    return make_hf_model(root, "llama3"), data


def test_configs_paired_and_judged(setup):
    model, data = setup
    logs = []
    res = accuracy.run(str(model), max_tokens=48, window=16, max_examples=3, data_dir=data,
                       configs=("fp32", "kv4", "kv4-plain", "w4", "w4+kv4"), log=logs.append)
    by = {r.config: r for r in res}
    assert by["fp32"].passed is None and by["fp32"].weights == "dense" and by["fp32"].kv_cache == "dense"
    assert {r.scored_tokens for r in res} == {by["fp32"].scored_tokens} and by["fp32"].scored_tokens > 30
    assert {r.lambada_examples for r in res} == {3}
    assert by["kv4"].kv_cache == "int4+rotation+recent-block" and by["kv4-plain"].kv_cache == "int4"
    assert by["w4"].weights == "int4-g64"  # not a GGUF: FlexGen's g=64 re-quantization
    assert by["kv4"].perplexity != by["fp32"].perplexity  # compression really ran
    for r in res[1:]:
        assert r.ppl_delta_pct == pytest.approx(100 * (r.perplexity / by["fp32"].perplexity - 1))
        assert r.lambada_delta_points == pytest.approx(100 * (r.lambada_gained - r.lambada_lost) / 3)
        assert r.passed == (r.ppl_delta_pct <= 3 and r.lambada_delta_points >= -1)
    text = "\n".join(logs)
    for r in res[1:]:
        assert f"{r.config:13s} perplexity" in text and ("PASS" if r.passed else "FAIL") in text


def test_cli_check_and_json(setup, tmp_path, monkeypatch):
    model, data = setup
    out = tmp_path / "acc.json"
    argv = ["--model", str(model), "--max-tokens", "32", "--window", "16", "--max-examples", "2",
            "--configs", "fp32,w4g64", "--out", str(out)]
    monkeypatch.setattr(accuracy, "run", _with_data(accuracy.run, data))
    monkeypatch.setattr(accuracy, "PPL_TARGET", -1.0)  # a target nothing meets: the row must FAIL
    assert accuracy.main(argv + ["--check"]) == 1
    doc = json.loads(out.read_text())
    assert [r["config"] for r in doc["results"]] == ["fp32", "w4g64"]
    assert doc["results"][1]["passed"] is False and doc["results"][0]["passed"] is None
    assert doc["targets"] == {"ppl_delta_pct_max": -100.0, "lambada_delta_points_min": -1.0}
    assert accuracy.main(argv) == 0  # without --check the status is 0 either way
    with pytest.raises(ValueError, match="unknown config"):
        accuracy.run(str(model), configs=("fp32", "kv3"), max_tokens=8, max_examples=1)


def _with_data(run, data):
    def wrapped(*a, **kw):
        return run(*a, data_dir=data, **kw)
    return wrapped
