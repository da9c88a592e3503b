"""`localgen batch` across processes: two runs racing on one OUT, SIGKILL at random moments
then resume, SIGTERM as Ctrl-C (for `generate` too). Children run tests/batch_child.py."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parent / "batch_child.py"
WAIT_S = 20.0  # the most any child or condition is waited for: a hung child fails, never hangs


def spawn(*args: str | Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def write_input(path: Path, n: int) -> set[str]:
    # prompts of 1..9 words: requests finish out of order
    lines = [json.dumps({"id": f"q{i}", "prompt": " ".join(f"w{i}_{k}" for k in range(1 + (i * 5) % 9))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return {f"q{i}" for i in range(n)}


def complete_lines(out: Path) -> list[dict]:
    """Every newline-terminated line of OUT, parsed (a line that does not parse fails the test);
    a last line without its newline (a write cut by SIGKILL) is left out."""
    if not out.exists():
        return []
    data = out.read_bytes()
    body = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in body.decode("utf-8").splitlines()]


def assert_each_once(out: Path, ids: set[str]) -> None:
    records = complete_lines(out)
    assert out.read_bytes().endswith(b"\n")  # no torn tail either
    counts = Counter(r["id"] for r in records if "text" in r)
    assert set(counts) == ids and set(counts.values()) == {1}, counts
    assert not [r for r in records if "error" in r]


def test_two_runs_racing_on_one_output(tmp_path):
    ids = write_input(tmp_path / "in.jsonl", 40)
    out, gate = tmp_path / "out.jsonl", tmp_path / "go"
    # Both start at once; the winner's engine waits at the gate, holding the lock, until the
    # loser has exited, so the two runs overlap whichever wins.
    kids = [spawn("cli", tmp_path / "in.jsonl", out, "--gate", gate, "--step-s", "0.001") for _ in range(2)]
    loser = None
    deadline = time.monotonic() + WAIT_S
    while loser is None and time.monotonic() < deadline:
        loser = next((k for k in kids if k.poll() is not None), None)
        time.sleep(0.01)
    gate.touch()
    assert loser is not None, "neither run stopped: the second one did not see the lock"
    winner = kids[1 - kids.index(loser)]
    w_out, w_err = winner.communicate(timeout=WAIT_S)
    l_out, l_err = loser.communicate(timeout=WAIT_S)
    assert winner.returncode == 0, w_err
    assert loser.returncode == 1, l_err
    assert f"pid {winner.pid}" in l_err and str(out) in l_err and "wait for it" in l_err, l_err
    assert "loading model" not in l_err and "Traceback" not in l_err  # failed before the model loaded
    assert "done 40" in w_err
    assert_each_once(out, ids)
    assert not Path(f"{out}.lock").exists()  # the winner removed its lock file


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_random_moments_then_resume(tmp_path, seed):
    ids = write_input(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out.jsonl"
    rng = random.Random(seed)
    for _ in range(3):
        kid = spawn("run", tmp_path / "in.jsonl", out, "--step-s", "0.002")
        time.sleep(rng.uniform(0.1, 0.7))  # the child needs ~0.1 s to start and ~1 s for all lines
        kid.kill()
        kid.communicate(timeout=WAIT_S)
        # whatever moment the kill hit: every finished line parses, and no id is there twice
        counts = Counter(r["id"] for r in complete_lines(out) if "text" in r)
        assert not counts or max(counts.values()) == 1, counts
    kid = spawn("run", tmp_path / "in.jsonl", out)  # the stale lock file must not block it
    _, err = kid.communicate(timeout=WAIT_S)
    assert kid.returncode == 0, err
    assert_each_once(out, ids)


def test_sigterm_stops_batch_like_ctrl_c(tmp_path):
    ids = write_input(tmp_path / "in.jsonl", 60)
    out, ready = tmp_path / "out.jsonl", tmp_path / "ready"
    kid = spawn("cli", tmp_path / "in.jsonl", out, "--step-s", "0.01", "--ready", ready)
    wait_for(lambda: len(complete_lines(out)) >= 3, "the first results")
    kid.send_signal(signal.SIGTERM)
    stdout, stderr = kid.communicate(timeout=WAIT_S)
    assert kid.returncode == 143, stderr  # 128 + SIGTERM; Ctrl-C gives 130
    assert "done " in stderr and "of 60 lines" in stderr, stderr
    assert "interrupted" in stderr and "rerun the same command" in stderr and "Traceback" not in stderr
    done = int(stderr.split("done ", 1)[1].split(",", 1)[0])
    assert done == len(complete_lines(out)) >= 3  # every result it counted is saved
    assert not Path(f"{out}.lock").exists()
    kid = spawn("cli", tmp_path / "in.jsonl", out)
    stdout, stderr = kid.communicate(timeout=WAIT_S)
    assert kid.returncode == 0, stderr
    assert f"skipped {done} (already done)" in stderr
    assert_each_once(out, ids)


def test_sigterm_stops_generate_like_ctrl_c(tmp_path):
    ready = tmp_path / "ready"
    prompt = " ".join(f"w{i}" for i in range(60))
    kid = spawn("generate", prompt, "--step-s", "0.05", "--ready", ready)
    wait_for(ready.exists, "the first step")
    time.sleep(0.1)
    kid.send_signal(signal.SIGTERM)
    stdout, stderr = kid.communicate(timeout=WAIT_S)
    assert kid.returncode == 143, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert stdout.startswith("w0")  # what streamed before the signal is out
