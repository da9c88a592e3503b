"""Check a running `localgen serve` from the outside, with the standard library only (smoke.sh
runs it in the fresh wheel venv).

    python serve_check.py BASE_URL API_KEY VERSION SERVER_PID

Waits for /health to answer 200 (failing at once if SERVER_PID exits first, or after
``LOCALGEN_SMOKE_WAIT`` seconds, default 900), then checks: /health and every /v1/models entry
report VERSION; /v1/models refuses a request without the key (401); one greedy
/v1/chat/completions request returns a non-empty answer. Exit status 0 when all hold; 1 with the
failed check on stderr otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request


def call(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET, or a POST when ``body`` is given."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def wait_healthy(base: str, pid: int, limit_s: float) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise SystemExit(f"serve_check: the server (pid {pid}) exited before /health answered")
        try:
            status, health = call(base + "/health")
            if status == 200:
                return health
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet: the model is still loading
        time.sleep(1)
    raise SystemExit(f"serve_check: /health did not answer 200 within {limit_s:.0f} s")


def main(base: str, key: str, version: str, pid: int) -> None:
    t0 = time.monotonic()
    health = wait_healthy(base, pid, float(os.environ.get("LOCALGEN_SMOKE_WAIT", "900")))
    print(f"/health after {time.monotonic() - t0:.0f} s: {health}")
    check(health.get("version") == version,
          f"/health's version is {health.get('version')!r}, not {version!r}")

    status, _ = call(base + "/v1/models")
    check(status == 401, f"/v1/models without the key answered {status}, not 401")
    status, models = call(base + "/v1/models", key)
    check(status == 200 and models.get("data"), f"/v1/models answered {status}: {models}")
    print(f"/v1/models: {models}")
    for card in models["data"]:
        got = card.get("localgen_version")
        check(got == version, f"/v1/models lists {card.get('id')!r} with localgen_version {got!r}")

    model = models["data"][0]["id"]
    status, chat = call(base + "/v1/chat/completions", key, {
        "model": model, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "temperature": 0})
    check(status == 200, f"/v1/chat/completions answered {status}: {chat}")
    answer = chat["choices"][0]["message"]["content"]
    check(bool(answer), f"/v1/chat/completions returned an empty answer: {chat}")
    print(f"/v1/chat/completions: {answer!r} ({chat['usage']})")


def check(ok: bool, message: str) -> None:
    if not ok:
        raise SystemExit(f"serve_check: {message}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3], int(sys.argv[4]))
