"""`localgen batch` guards in one process: OUT's lock and the checks before the model loads,
duplicate ids' error records, the input line cap, the SIGTERM handler's install and restore."""

from __future__ import annotations

import json
import os
import signal
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from test_batch_fakes import FakeLLM
from typer.testing import CliRunner

from localgen.batch import iter_input_lines, run_batch
from localgen.batch.output_lock import OutputError, OutputLock, OutputLocked, lock_path
from localgen.batch.runner import line_byte_limit
from localgen.cli import batch_cmd
from localgen.cli.main import app


def write(path: Path, lines: list[str | dict]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_out(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def native(i: int) -> dict:
    return {"id": f"q{i}", "prompt": f"w{i}_0 w{i}_1"}


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The CLI's engine is a FakeLLM; the list records each model load."""
    made: list[str] = []

    def load(model, **kw):
        made.append(model)
        return FakeLLM()

    monkeypatch.setattr(batch_cmd, "load_llm", load)
    return made


# ------------------------------------------------------------------------------------------------
# the lock and the checks before loading


def test_a_locked_output_is_refused_naming_the_owner(tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [native(1)]), tmp_path / "out.jsonl"
    with OutputLock.acquire(out) as lock:
        owner = json.loads(lock.path.read_text())
        assert owner["pid"] == os.getpid() and owner["host"] and owner["started"]
        with pytest.raises(OutputLocked, match=f"pid {os.getpid()}") as exc:
            run_batch(FakeLLM(), inp, out)
        assert str(out) in str(exc.value) and exc.value.owner["pid"] == os.getpid()
        assert not out.exists()  # the refused run wrote nothing
        run_batch(FakeLLM(), inp, out, output_lock=lock)  # the holder may run
        with pytest.raises(ValueError, match="output_lock"):
            run_batch(FakeLLM(), inp, tmp_path / "other.jsonl", output_lock=lock)
    assert not lock_path(out).exists()
    assert [r["id"] for r in read_out(out)] == ["q1"]


def test_two_names_for_one_output_share_its_lock(tmp_path):
    out = tmp_path / "out.jsonl"
    (tmp_path / "link.jsonl").symlink_to(out)
    with OutputLock.acquire(tmp_path / "link.jsonl"):
        with pytest.raises(OutputLocked):
            OutputLock.acquire(tmp_path / "sub" / ".." / "out.jsonl")


def test_cli_refuses_a_locked_output_before_loading(tmp_path, loads):
    inp, out = write(tmp_path / "in.jsonl", [native(1)]), tmp_path / "out.jsonl"
    with OutputLock.acquire(out):
        res = CliRunner().invoke(app, ["batch", str(inp), "-o", str(out), "--no-progress"])
    assert res.exit_code == 1 and not loads
    assert f"is being written by localgen batch, pid {os.getpid()}" in res.stderr
    assert "wait for it" in res.stderr and "Traceback" not in res.output


def test_a_stale_lock_file_does_not_block(tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [native(1)]), tmp_path / "out.jsonl"
    # left by a run that was killed: the flock died with it, only the text remains
    lock_path(out).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "yesterday"}))
    assert run_batch(FakeLLM(), inp, out).done == 1
    assert not lock_path(out).exists()


def test_cli_names_an_unwritable_output_before_loading(tmp_path, loads):
    inp = write(tmp_path / "in.jsonl", [native(1)])
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(app, ["batch", str(inp), "-o", str(tmp_path / "afile" / "out.jsonl")])
    assert res.exit_code == 1 and not loads
    assert res.stderr.count("\n") == 1 and "afile" in res.stderr and "error:" in res.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write a read-only file")
def test_cli_names_a_read_only_output_before_loading(tmp_path, loads):
    inp, out = write(tmp_path / "in.jsonl", [native(1)]), tmp_path / "out.jsonl"
    out.write_text("")
    out.chmod(0o444)
    res = CliRunner().invoke(app, ["batch", str(inp), "-o", str(out)])
    assert res.exit_code == 1 and not loads
    assert f"cannot write {out}" in res.stderr


def test_missing_output_folder_is_made(tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [native(1)]), tmp_path / "new" / "dir" / "out.jsonl"
    assert run_batch(FakeLLM(), inp, out).done == 1 and out.exists()


def test_output_error_is_not_a_lock_error(tmp_path):
    (tmp_path / "out.jsonl").mkdir()
    with pytest.raises(OutputError, match="is a folder") as exc:
        OutputLock.acquire(tmp_path / "out.jsonl")
    assert not isinstance(exc.value, OutputLocked)
    assert not lock_path(tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# duplicate ids


def test_duplicate_id_record_does_not_collide_and_resume_keeps_it(tmp_path):
    inp = write(tmp_path / "in.jsonl", [native(1), {"id": "q1", "prompt": "again"}, native(2)])
    out = tmp_path / "out.jsonl"
    s1 = run_batch(FakeLLM(), inp, out)
    recs = read_out(out)
    assert [r for r in recs if r.get("id") == "q1"] == [r for r in recs if "text" in r and r["id"] == "q1"]
    (dup,) = [r for r in recs if "error" in r]
    assert dup == {"id": None, "line": 2, "duplicate_of": "q1", "error": 'id: duplicate "q1" (first used on line 1)'}
    s2 = run_batch(FakeLLM(), inp, out)  # a rerun appends nothing and still reports the line
    assert (s1.done, s1.failed, s2.done, s2.skipped_resume, s2.failed) == (2, 1, 0, 2, 1)
    assert read_out(out) == recs


def test_openai_duplicate_custom_id_record_keeps_the_batch_shape(tmp_path):
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a b"}}
    out = tmp_path / "out.jsonl"
    run_batch(FakeLLM(), write(tmp_path / "in.jsonl", [line, line]), out)
    recs = read_out(out)
    (ok,) = [r for r in recs if r["error"] is None]
    (dup,) = [r for r in recs if r["error"] is not None]
    assert ok["custom_id"] == "c1" and ok["error"] is None
    assert set(dup) == {"id", "custom_id", "response", "error", "duplicate_of"}
    assert dup["id"].startswith("batch_req_") and dup["custom_id"] is None and dup["response"] is None
    assert dup["duplicate_of"] == "c1" and dup["error"]["code"] == "invalid_request"
    assert dup["error"]["message"] == 'line 2: custom_id: duplicate "c1" (first used on line 1)'


def test_a_bad_line_still_claims_its_id(tmp_path):
    # Were line 2 to run, its result would mark line 1 done once line 1 is fixed: lost.
    inp = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": 42}, {"id": "a", "prompt": "second"}])
    out = tmp_path / "out.jsonl"
    s1 = run_batch(FakeLLM(), inp, out, raw_prompts=True)
    assert (s1.done, s1.failed) == (0, 2)
    write(inp, [{"id": "a", "prompt": "first"}, {"id": "a", "prompt": "second"}])
    s2 = run_batch(FakeLLM(), inp, out, raw_prompts=True)
    assert (s2.done, s2.failed) == (1, 1)
    assert [r["text"] for r in read_out(out) if "text" in r] == ["first"]


# ------------------------------------------------------------------------------------------------
# the input line cap


class PromptCappedLLM(FakeLLM):
    max_prompt_bytes = 4096  # as localgen.api.LLM states it: prompt text past this cannot fit
    token_limit = 64


@pytest.mark.parametrize("engine", [PromptCappedLLM, FakeLLM])  # the cap from the engine; the 16 MiB default
def test_a_50mb_line_is_rejected_unread_and_the_rest_runs(tmp_path, engine):
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        f.write(json.dumps(native(1)) + "\n")
        f.write('{"id": "big", "prompt": "' + "a" * (50 * 2**20) + '"}\n')
        f.write(json.dumps(native(3)) + "\n")
    out = tmp_path / "out.jsonl"
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        summary = run_batch(engine(), inp, out)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # loose bounds: what they guard against is reading, parsing and tokenizing the line whole
    assert seconds < 5 and peak < 20 * 2**20, (seconds, peak)
    assert (summary.total, summary.done, summary.failed) == (3, 2, 1)
    recs = read_out(out)
    assert {r["id"] for r in recs if "text" in r} == {"q1", "q3"}
    (err,) = [r for r in recs if "error" in r]
    assert err["line"] == 2 and err["id"] is None
    if engine is PromptCappedLLM:
        assert err["error"] == (f"too long: {50 * 2**20 + 27} bytes, over the {4096 * 6 + 64 * 2**10}-byte limit "
                                f"for one line: the model's context of 64 tokens holds at most 4096 bytes of prompt")
    else:
        assert err["error"] == f"too long: {50 * 2**20 + 27} bytes, over the {16 * 2**20}-byte limit for one line"


def test_line_cap_from_the_engine_or_the_caller():
    assert line_byte_limit(FakeLLM()) == (16 * 2**20, "")
    assert line_byte_limit(PromptCappedLLM())[0] == 4096 * 6 + 64 * 2**10
    assert line_byte_limit(PromptCappedLLM(), 100) == (100, "")
    with pytest.raises(ValueError, match="max_line_bytes"):
        line_byte_limit(FakeLLM(), 0)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_line_cap_boundary(tmp_path, ending):
    path = tmp_path / "in.jsonl"
    lines = [b"a" * 10, b"b" * 11, b"c" * 5000, b"", b"d" * 3]
    path.write_bytes(b"\xef\xbb\xbf" + ending.join(lines))  # BOM, and a last line without ending
    got = list(iter_input_lines(path, max_line_bytes=10, limit_note=" (why)"))
    assert [(n, x) for n, x in got if isinstance(x, str)] == [(1, "a" * 10), (5, "ddd")]
    errors = {n: x.message for n, x in got if not isinstance(x, str)}
    assert errors == {2: "too long: 11 bytes, over the 10-byte limit for one line (why)",
                      3: "too long: 5000 bytes, over the 10-byte limit for one line (why)"}


def test_cap_passed_to_run_batch(tmp_path):
    inp = write(tmp_path / "in.jsonl", [native(1), {"id": "long", "prompt": "x " * 100}, native(3)])
    out = tmp_path / "out.jsonl"
    summary = run_batch(FakeLLM(), inp, out, max_line_bytes=100)
    assert (summary.done, summary.failed) == (2, 1)
    assert Counter("text" in r for r in read_out(out)) == {True: 2, False: 1}


# ------------------------------------------------------------------------------------------------
# SIGTERM


def test_sigterm_handler_is_installed_and_restored():
    def mine(signum, frame):
        raise AssertionError("not reached")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with batch_cmd.SigtermAsInterrupt() as term:
            assert signal.getsignal(signal.SIGTERM) == term._handle
            assert term.exit_status == 130
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
