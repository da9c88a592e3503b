"""Real-terminal smoke test: `localgen chat` inside tmux, keys via send-keys, screen via
capture-pane. Needs tmux (Debian/Ubuntu: `apt-get install -y tmux`); skipped without it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.tiny_models import make_hf_model

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install -y tmux)")


def capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True).stdout


def wait_screen(session: str, cond, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = capture(session)
        if cond(screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; screen:\n{screen}")


def test_chat_in_tmux(tmp_path):
    model = make_hf_model(tmp_path, "smollm")
    session = f"lgtest-{uuid.uuid4().hex[:8]}"
    exe = Path(sys.executable).with_name("localgen")
    localgen = str(exe) if exe.exists() else shutil.which("localgen")
    if localgen is None:
        pytest.skip("the localgen console script is not installed (pip install -e .)")
    cmd = ["env", "NO_COLOR=1", "TERM=xterm-256color", f"LOCALGEN_CHATS_DIR={tmp_path / 'chats'}",
           localgen, "chat", "--model", str(model), "--kv-cache-memory", "4MiB",
           "--temperature", "0", "--max-tokens", "24"]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24",
                    " ".join(shlex.quote(c) for c in cmd)], check=True)
    try:
        wait_screen(session, lambda s: "· ready ·" in s, 120, "the model to load")
        subprocess.run(["tmux", "send-keys", "-t", session, "hello world", "Enter"], check=True)
        screen = wait_screen(session, lambda s: "reused" in s and "tok ·" in s, 60, "an answer")
        assert "You" in screen and "hello world" in screen and "Assistant" in screen
        assert "Memory" in screen and "Throughput" in screen and "esc Stop" in screen
        assert "24 tok" in screen  # the stats line of the finished answer
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        wait_screen(session, lambda s: "Assistant" not in s, 20, "the app to quit")  # saved: no question
        saved = list((tmp_path / "chats").glob("*.json"))
        assert len(saved) == 1 and "hello world" in saved[0].read_text()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
