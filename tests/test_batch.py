"""`localgen batch`: formats, bad lines, resume, BOM/CRLF, OpenAI shape, --limit, CLI exit status.

All against the fake engine of test_batch_fakes.py (the lead adds a real-model test).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from test_batch_fakes import FakeLLM
from typer.testing import CliRunner

from localgen.batch import BatchInterrupted, LineError, parse_line, run_batch, scan_output
from localgen.cli import batch_cmd
from localgen.cli.main import app
from localgen.cli.units import format_size, parse_size

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl"


def write(path: Path, lines: list[str | dict], *, bom: bool = False, crlf: bool = False) -> Path:
    nl = "\r\n" if crlf else "\n"
    text = nl.join(x if isinstance(x, str) else json.dumps(x) for x in lines) + nl
    data = text.encode("utf-8")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def successes(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("error") is None and ("text" in r or r.get("response"))]


def native(i: int, words: int = 3, **kw) -> dict:
    return {"id": f"q{i}", "prompt": " ".join(f"w{i}_{k}" for k in range(words)), **kw}


# ------------------------------------------------------------------------------------------------
# parsing


def test_parse_native_prompt_and_messages():
    job = parse_line(json.dumps({"id": "a", "prompt": "hi there", "temperature": 0, "stop": "\n", "max_tokens": 5}), 3)
    assert (job.key, job.prompt, job.line_no) == ("a", "hi there", 3)
    assert job.sampling == {"temperature": 0, "stop": "\n", "max_tokens": 5}
    req = job.to_request("r1")
    assert req.messages == [{"role": "user", "content": "hi there"}] and req.prompt is None  # chat template
    assert job.to_request("r1", raw_prompts=True).prompt == "hi there"
    assert req.sampling.stop == ("\n",) and req.sampling.temperature == 0.0

    job = parse_line(json.dumps({"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}], "category": "x"}), 1)
    assert job.key == 7 and job.messages == [{"role": "user", "content": "yo"}]


def test_parse_openai_lines():
    chat = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o", "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
                     "max_completion_tokens": 9, "max_tokens": 99, "temperature": 0.5, "n": 1, "logprobs": False, "stream": False}}
    job = parse_line(json.dumps(chat), 1)
    assert job.format == "openai" and job.messages[0] == {"role": "system", "content": "be brief"}
    assert job.sampling == {"max_tokens": 9, "temperature": 0.5}
    comp = {"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["Once upon"], "seed": 3, "stop": ["."]}}
    job = parse_line(json.dumps(comp), 2)
    assert job.prompt == "Once upon" and job.sampling == {"seed": 3, "stop": ["."]}
    assert job.to_request("r").prompt == "Once upon"  # completions prompts are never templated
    job = parse_line(json.dumps({**comp, "body": {"prompt": [1, 2, 3]}}), 3)
    assert job.prompt_token_ids == [1, 2, 3]


def test_sampling_precedence_and_max_tokens_cap():
    job = parse_line(json.dumps({"id": "a", "prompt": "x", "temperature": 0.7, "max_tokens": 10}), 1)
    req = job.to_request("r", defaults={"temperature": 0.0, "seed": 5}, max_tokens_cap=4)
    assert (req.sampling.temperature, req.sampling.seed, req.sampling.max_tokens) == (0.7, 5, 4)
    req = job.to_request("r", max_tokens_cap=50)
    assert req.sampling.max_tokens == 10  # a cap, not a raise
    job = parse_line(json.dumps({"id": "a", "prompt": "x"}), 1)
    assert job.to_request("r", max_tokens_cap=50).sampling.max_tokens == 50


BAD_LINES = [
    # (line, words expected in the error message)
    ('{"id": "b1", "prompt": "unterminated', ["broken JSON"]),
    ('["a", "list"]', ["JSON object"]),
    ({"prompt": "no id"}, ["id", "missing"]),
    ({"id": ["x"], "prompt": "bad id"}, ["id", "string"]),
    ({"id": "b5"}, ["prompt or messages", "missing"]),
    ({"id": "b6", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, ["prompt and messages", "not both"]),
    ({"id": "b7", "prompt": 42}, ["prompt", "string"]),
    ({"id": "b8", "prompt": "   "}, ["prompt", "empty"]),
    ({"id": "b9", "prompt": "x", "temperature": "hot"}, ["temperature", "number"]),
    ({"id": "b10", "prompt": "x", "top_p": 0}, ["top_p", "(0, 1]"]),
    ({"id": "b11", "prompt": "x", "max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"id": "b12", "prompt": "x", "max_tokens": 2.5}, ["max_tokens", "integer"]),
    ({"id": "b13", "prompt": "x", "stop": [1]}, ["stop", "string"]),
    ({"id": "b14", "messages": [{"role": "wizard", "content": "x"}]}, ["messages[0].role", "wizard"]),
    ({"id": "b15", "messages": []}, ["messages", "empty"]),
    ({"id": "q0", "prompt": "dup of line 1"}, ["id", "duplicate", "line 1"]),
    ({"id": "b17", "prompt": " ".join(["w"] * 100)}, ["too long", "context"]),
    ({"id": "b18", "prompt": "x", "priority": "urgent"}, ["priority"]),
]
BAD_OPENAI = [
    ({"custom_id": "o1", "method": "POST", "url": "/v1/embeddings", "body": {}}, ["url", "not supported"]),
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, ["custom_id", "missing"]),
    ({"custom_id": "o3", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, ["method", "POST"]),
    ({"custom_id": "o4", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "n": 2}}, ["body.n", "n=1"]),
    ({"custom_id": "o5", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}}, ["body.max_completion_tokens", ">= 1"]),
    ({"custom_id": "o6", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "x"}}, ["body.messages", "missing"]),
    ({"custom_id": "o7", "method": "POST", "url": "/v1/completions", "body": "x"}, ["body", "object"]),
    ({"custom_id": "o8", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}, ["temperature", "[0, 100]"]),
]


def _bad_file(tmp_path: Path) -> tuple[Path, dict[int, list[str]], dict[int, list[str]], set[str]]:
    """Good and bad lines interleaved, with blank lines; returns expected messages by line."""
    lines: list[str | dict] = [native(0)]
    bad_native: dict[int, list[str]] = {}
    bad_openai: dict[int, list[str]] = {}
    good = {"q0"}
    for i, (line, words) in enumerate(BAD_LINES + BAD_OPENAI, start=1):
        lines.append("")  # blank lines are skipped but counted
        lines.append(line)
        (bad_openai if (i > len(BAD_LINES)) else bad_native)[len(lines)] = words
        lines.append(native(i))
        good.add(f"q{i}")
    path = write(tmp_path / "in.jsonl", lines)
    with open(path, "ab") as f:  # one line that is not UTF-8
        f.write(b'{"id": "bin", "prompt": "\xff\xfe"}\n')
    bad_native[len(lines) + 1] = ["UTF-8"]
    return path, bad_native, bad_openai, good


def test_every_bad_line_reported_with_its_line_number_and_good_lines_run(tmp_path):
    path, bad_native, bad_openai, good = _bad_file(tmp_path)
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(max_model_len=64), path, out)
    records = read_out(out)
    native_errors = {r["line"]: r for r in records if isinstance(r.get("error"), str)}
    openai_errors = {int(r["error"]["message"].split(":")[0].split()[1]): r for r in records if isinstance(r.get("error"), dict)}
    assert set(native_errors) == set(bad_native)
    assert set(openai_errors) == set(bad_openai)
    for line, words in bad_native.items():
        for w in words:
            assert w in native_errors[line]["error"], (line, native_errors[line])
    for line, words in bad_openai.items():
        rec = openai_errors[line]
        assert rec["response"] is None and rec["error"]["code"] == "invalid_request"
        assert rec["error"]["message"].startswith(f"line {line}: ")
        for w in words:
            assert w in rec["error"]["message"], (line, rec)
    assert openai_errors[min(bad_openai)]["custom_id"] == "o1"
    # ids that could be read are kept on the error record
    dup_line = next(ln for ln, w in bad_native.items() if "duplicate" in w)
    # ... except a duplicate's: the id is line 1's, so its record names it apart
    assert native_errors[dup_line]["id"] is None and native_errors[dup_line]["duplicate_of"] == "q0"
    assert {"b5", "b9", "b17"} <= {r["id"] for r in native_errors.values()}
    assert {r["id"] for r in records if "text" in r} == good
    n_bad = len(bad_native) + len(bad_openai)
    assert (summary.total, summary.done, summary.failed, summary.skipped_resume) == (len(good) + n_bad, len(good), n_bad, 0)
    assert summary.tokens == sum(r["usage"]["completion_tokens"] for r in records if "text" in r)


def test_native_output_record(tmp_path):
    path = write(tmp_path / "in.jsonl", [native(1, words=5, max_tokens=2), native(2, words=2), {"id": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a b"}]}])
    out = tmp_path / "out.jsonl"
    run_batch(FakeLLM(), path, out, raw_prompts=True)
    recs = {r["id"]: r for r in read_out(out)}
    assert recs["q1"] == {"id": "q1", "text": "w1_0 w1_1", "finish_reason": "length",
                          "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}, "model": "fake-model"}
    assert recs["q2"]["finish_reason"] == "stop" and recs["q2"]["text"] == "w2_0 w2_1"
    assert recs["m"]["text"] == "s a b" and recs["m"]["usage"]["prompt_tokens"] == 5


def test_openai_input_gives_openai_output(tmp_path):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "whatever", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}},
        {"custom_id": "comp-1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "alpha beta"}},
    ]
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(), write(tmp_path / "in.jsonl", lines), out)
    assert summary.done == 2 and summary.failed == 0
    recs = {r["custom_id"]: r for r in read_out(out)}
    chat = recs["chat-1"]
    assert chat["id"].startswith("batch_req_") and chat["error"] is None
    assert chat["response"]["status_code"] == 200 and chat["response"]["request_id"]
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "one two"}, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    body = recs["comp-1"]["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "alpha beta" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


@pytest.mark.parametrize("bom,crlf", [(True, False), (False, True), (True, True)])
def test_bom_and_crlf_input(tmp_path, bom, crlf):
    lines = [native(1), "", '{"id": "bad", "prompt": ', native(2)]
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(), write(tmp_path / "in.jsonl", lines, bom=bom, crlf=crlf), out, raw_prompts=True)
    recs = read_out(out)
    assert {r["id"] for r in successes(recs)} == {"q1", "q2"}
    assert [r["line"] for r in recs if "error" in r] == [3]
    assert {r["id"]: r["text"] for r in successes(recs)}["q2"] == "w2_0 w2_1 w2_2"  # no stray \r
    assert (summary.done, summary.failed) == (2, 1)


def test_limit_counts_input_lines(tmp_path):
    lines = [native(1), "not json", native(2), native(3), native(4)]
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(), write(tmp_path / "in.jsonl", lines), out, limit=3)
    assert (summary.total, summary.done, summary.failed) == (3, 2, 1)
    assert {r.get("id") for r in successes(read_out(out))} == {"q1", "q2"}
    summary = run_batch(FakeLLM(), tmp_path / "in.jsonl", out, limit=5)  # widen the limit: resume
    assert (summary.done, summary.skipped_resume, summary.failed) == (2, 2, 1)
    assert len(read_out(out)) == 5  # the same error is not appended twice


def test_window_bounds_queued_requests(tmp_path):
    lines = [native(i, words=1 + i % 7) for i in range(50)]
    llm = FakeLLM(max_num_seqs=3)
    out = tmp_path / "out.jsonl"
    seen = []
    summary = run_batch(llm, write(tmp_path / "in.jsonl", lines), out, max_in_flight=5, progress=seen.append)
    assert summary.done == 50 and llm.max_queued <= 5
    assert llm.completed != sorted(llm.completed, key=lambda r: int(r.rsplit("-", 1)[1]))  # out of order
    assert [r["id"] for r in read_out(out)] != [f"q{i}" for i in range(50)]
    assert seen[-1].done == 50 and seen[-1].total == 50 and seen[-1].tokens == summary.tokens
    assert all(r.sampling.max_tokens == 256 for r in llm.requests.values())


# ------------------------------------------------------------------------------------------------
# resume


def _resume_input(tmp_path: Path, n: int = 30) -> tuple[Path, set[str]]:
    # different prompt lengths: requests finish in a different order than submitted
    lines = [native(i, words=1 + (i * 5) % 9) for i in range(n)]
    return write(tmp_path / "in.jsonl", lines), {f"q{i}" for i in range(n)}


def _assert_complete(out: Path, ids: set[str]) -> None:
    recs = read_out(out)
    counts = Counter(r["id"] for r in recs)
    assert set(counts) == ids and max(counts.values()) == 1, counts
    for r in recs:
        i = int(r["id"][1:])
        assert r["text"] == " ".join(f"w{i}_{k}" for k in range(1 + (i * 5) % 9))


@pytest.mark.parametrize("k", [0, 1, 7, 19])
def test_resume_after_interrupt_appends_nothing_twice_and_loses_nothing(tmp_path, k):
    path, ids = _resume_input(tmp_path)
    out = tmp_path / "out.jsonl"
    llm = FakeLLM(max_num_seqs=4, interrupt_after=k)
    with pytest.raises(BatchInterrupted) as exc:
        run_batch(llm, path, out, max_in_flight=8)
    first = exc.value.summary
    assert first.interrupted and first.done == k == len(read_out(out))
    assert set(llm.aborted) and not llm.has_unfinished()  # queued requests were aborted
    summary = run_batch(FakeLLM(max_num_seqs=4), path, out)
    assert summary.skipped_resume == k and summary.done == len(ids) - k and summary.failed == 0
    _assert_complete(out, ids)
    again = run_batch(FakeLLM(), path, out)  # a third run has nothing to do
    assert (again.done, again.skipped_resume) == (0, len(ids))
    _assert_complete(out, ids)


def test_resume_repairs_a_truncated_last_line(tmp_path):
    path, ids = _resume_input(tmp_path, n=10)
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchInterrupted):
        run_batch(FakeLLM(interrupt_after=4), path, out)
    done_before = {r["id"] for r in read_out(out)}
    # a crash in the middle of writing the 5th record
    with open(out, "ab") as f:
        f.write(b'{"id": "q9", "text": "w9_0 w9_')
    state = scan_output(out)
    assert state.repaired_tail and state.done == {("native", i) for i in done_before}
    assert out.read_bytes().endswith(b"}\n")
    summary = run_batch(FakeLLM(), path, out)
    assert summary.skipped_resume == 4 and summary.done == 6
    _assert_complete(out, ids)


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path, ids = _resume_input(tmp_path, n=3)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "q0", "text": "w0_0", "finish_reason": "stop", "usage": {}, "model": "m"}))
    summary = run_batch(FakeLLM(), path, out)
    assert summary.skipped_resume == 1 and summary.done == 2
    _assert_complete(out, ids)


def test_errors_are_not_done_but_not_written_twice(tmp_path):
    good = native(1)
    bad = {"id": "q2", "prompt": "a b", "top_p": 5}
    path = write(tmp_path / "in.jsonl", [good, bad, "{oops"])
    out = tmp_path / "out.jsonl"
    s1 = run_batch(FakeLLM(), path, out)
    assert (s1.done, s1.failed) == (1, 2)
    s2 = run_batch(FakeLLM(), path, out)  # still bad: nothing new appended, still counted failed
    assert (s2.done, s2.skipped_resume, s2.failed) == (0, 1, 2)
    assert len(read_out(out)) == 3
    fixed = dict(bad, top_p=0.9)
    write(path, [good, fixed, "{oops"])  # the user fixes line 2
    s3 = run_batch(FakeLLM(), path, out)
    assert (s3.done, s3.skipped_resume, s3.failed) == (1, 1, 1)
    recs = read_out(out)
    assert len(recs) == 4 and [r["id"] for r in successes(recs)] == ["q1", "q2"]


def test_openai_resume_uses_custom_id(tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a " * (1 + i % 4)}} for i in range(12)]
    path = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchInterrupted):
        run_batch(FakeLLM(interrupt_after=5), path, out)
    run_batch(FakeLLM(), path, out)
    counts = Counter(r["custom_id"] for r in read_out(out))
    assert set(counts) == {f"c{i}" for i in range(12)} and set(counts.values()) == {1}


# ------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture
def fake_engine(monkeypatch):
    made: list[FakeLLM] = []
    opts: dict = {}

    def load(model, **kw):
        opts.update(kw, model=model)
        llm = FakeLLM(**opts.get("fake", {}))
        made.append(llm)
        return llm

    monkeypatch.setattr(batch_cmd, "load_llm", load)
    return made, opts


def test_cli_exit_status_and_summary(tmp_path, fake_engine):
    made, opts = fake_engine
    runner = CliRunner()
    path = write(tmp_path / "in.jsonl", [native(1), {"id": "q2", "prompt": "x", "top_k": -1}, native(3)])
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(path), "-o", str(out), "--kv-cache-memory", "1.5GB", "--temperature", "0", "--seed", "3", "--max-tokens", "2", "--model", "tiny"])
    assert res.exit_code == 1, res.output
    assert "done 2, skipped 0" in res.stderr and "failed 1, of 3 lines" in res.stderr
    assert "line 2" in res.stderr and "top_k" in res.stderr
    assert opts["kv_cache_memory"] == 1_500_000_000 and opts["model"] == "tiny"
    reqs = list(made[0].requests.values())
    assert all(r.sampling.temperature == 0.0 and r.sampling.seed == 3 and r.sampling.max_tokens == 2 for r in reqs)
    assert all(r.messages is not None for r in reqs)  # chat template by default
    # fix the line and rerun: only it runs, exit 0
    write(path, [native(1), {"id": "q2", "prompt": "x y", "top_k": 1}, native(3)])
    res = runner.invoke(app, ["batch", str(path), "-o", str(out), "--raw"])
    assert res.exit_code == 0, res.output
    assert "done 1, skipped 2" in res.stderr and "failed 0" in res.stderr
    assert [r.prompt for r in made[1].requests.values()] == ["x y"]


def test_cli_limit_and_interrupt(tmp_path, fake_engine):
    made, opts = fake_engine
    path, ids = _resume_input(tmp_path, n=12)
    out = tmp_path / "out.jsonl"
    runner = CliRunner()
    opts["fake"] = {"interrupt_after": 3}
    res = runner.invoke(app, ["batch", str(path), "-o", str(out), "--limit", "8"])
    assert res.exit_code == 130 and "rerun" in res.stderr
    opts["fake"] = {}
    res = runner.invoke(app, ["batch", str(path), "-o", str(out), "--limit", "8"])
    assert res.exit_code == 0, res.output
    assert "done 5, skipped 3" in res.stderr
    _assert_complete(out, {f"q{i}" for i in range(8)})


def test_cli_rejects_bad_options(tmp_path, fake_engine):
    path = write(tmp_path / "in.jsonl", [native(1)])
    runner = CliRunner()
    res = runner.invoke(app, ["batch", str(path), "-o", str(tmp_path / "o.jsonl"), "--kv-cache-memory", "lots"])
    assert res.exit_code == 2 and "512MiB" in res.output
    res = runner.invoke(app, ["batch", str(path), "-o", str(tmp_path / "o.jsonl"), "--temperature", "-1"])
    assert res.exit_code == 2 and "temperature" in res.output
    res = runner.invoke(app, ["batch", str(path), "-o", str(path)])
    assert res.exit_code == 2
    res = runner.invoke(app, ["batch", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2
    assert not fake_engine[0]  # no model loaded for bad options


def test_example_prompts_all_valid(tmp_path):
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(max_model_len=4096), EXAMPLES, out)
    recs = read_out(out)
    assert summary.failed == 0 and summary.done == summary.total >= 6
    assert any("custom_id" in r for r in recs) and any("text" in r for r in recs)
    kinds = [json.loads(x) for x in EXAMPLES.read_text().splitlines() if x.strip()]
    assert any("prompt" in k and "id" in k for k in kinds) and any("messages" in k for k in kinds)
    assert {k.get("url") for k in kinds} >= {"/v1/chat/completions", "/v1/completions"}


# ------------------------------------------------------------------------------------------------
# units


@pytest.mark.parametrize(
    "text,expected",
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("4096", 4096), ("2g", 2 * 2**30),
     ("100 kb", 100_000), (".5KiB", 512), (123, 123)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "1.5XB", "-1GB", "1e9", "two GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="512MiB"):
        parse_size(text)


def test_format_size():
    assert format_size(1536) == "1.5 KiB" and format_size(2 * 2**30) == "2.0 GiB" and format_size(12) == "12 B"


def test_line_error_is_a_value_error():
    e = LineError(4, "id: missing")
    assert isinstance(e, ValueError) and str(e) == "line 4: id: missing"
    assert e.record() == {"id": None, "line": 4, "error": "id: missing"}
