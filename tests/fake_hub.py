"""A Hugging Face hub on 127.0.0.1 for download tests: the endpoints huggingface_hub calls.

- ``GET /api/models/{repo}[/revision/{rev}]``: ``sha`` and ``siblings`` (size, blobId, lfs);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file list ``snapshot_download`` reads;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` (git blob id, or the
  SHA-256 for LFS files: .gguf, .safetensors), ``Content-Length``; ``Range: bytes=N-`` gets 206.

Errors as the hub sends them: 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` /
``EntryNotFound``; a private repo answers 401 without a token, a gated one 401 with
``X-Error-Code: GatedRepo`` on its files. Faults per file: ``drop_once`` (the first GET closes
the connection halfway), ``corrupt`` (same size, one byte flipped), ``short`` (GET sends fewer
bytes than HEAD announced), ``fail_resume`` (a GET with ``Range`` gets 503: the client gives up). ``requests`` records (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_test_token"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith((".gguf", ".safetensors"))


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "c" * 40
    gated: bool = False
    private: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_once: set[tuple[str, str]] = field(default_factory=set)
    corrupt: set[tuple[str, str]] = field(default_factory=set)
    short: set[tuple[str, str]] = field(default_factory=set)
    fail_resume: set[tuple[str, str]] = field(default_factory=set)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes | Path], **kw) -> Repo:
        data = {k: (v.read_bytes() if isinstance(v, Path) else v) for k, v in files.items()}
        self.repos[repo_id] = Repo(data, **kw)
        return self.repos[repo_id]

    def gets(self, repo_id: str) -> list[str]:
        """Files of `repo_id` that were downloaded (GET on resolve), in order."""
        prefix = f"/{repo_id}/resolve/"
        return [p.split("/", 5)[-1] for m, p, _ in self.requests if m == "GET" and p.startswith(prefix)]

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # ---- routing --------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(parts[2] + "/" + parts[3], parts[4:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
        self._error(404, "EntryNotFound", "no such endpoint")

    def _repo(self, repo_id: str, files_request: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        authed = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo is None or (repo.private and not authed):
            # the hub answers 401 for a private repo without a token, 404 when absent
            code = 401 if repo is not None else 404
            self._error(code, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and files_request and not authed:
            self._error(401, "GatedRepo", "Access to model is restricted", repo.commit)
            return None
        return repo

    def _api(self, repo_id: str, rest: list[str]) -> None:
        repo = self._repo(repo_id, files_request=False)
        if repo is None:
            return
        if rest and rest[0] == "tree":
            if not self._revision_ok(repo, rest[1] if len(rest) > 1 else "main"):
                return
            sub = "/".join(rest[2:])
            entries = [self._tree_entry(p, d) for p, d in sorted(repo.files.items())
                       if not sub or p.startswith(sub + "/")]
            return self._json(entries)
        if rest and rest[0] == "revision" and not self._revision_ok(repo, rest[1]):
            return
        siblings = []
        for p, d in sorted(repo.files.items()):
            s = {"rfilename": p, "size": len(d), "blobId": git_blob_id(d)}
            if is_lfs(p):
                s["lfs"] = {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}
            siblings.append(s)
        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.private,
                    "gated": "auto" if repo.gated else False, "siblings": siblings, "tags": []})

    @staticmethod
    def _tree_entry(p: str, d: bytes) -> dict:
        e = {"type": "file", "path": p, "size": len(d), "oid": git_blob_id(d)}
        if is_lfs(p):
            e["lfs"] = {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}
        return e

    def _revision_ok(self, repo: Repo, rev: str) -> bool:
        if rev in ("main", repo.commit):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    def _resolve(self, repo_id: str, rev: str, file: str, head: bool) -> None:
        repo = self._repo(repo_id, files_request=True)
        if repo is None or not self._revision_ok(repo, rev):
            return
        data = repo.files.get(file)
        if data is None:
            return self._error(404, "EntryNotFound", f"{file} does not exist", repo.commit)
        key = (repo_id, file)
        etag = hashlib.sha256(data).hexdigest() if is_lfs(file) else git_blob_id(data)
        start = 0
        rng = self.headers.get("Range")
        if rng and not head and key in self.hub.fail_resume:
            return self._error(503, "ServiceUnavailable", "try again later")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng[len("bytes="):].split("-")[0])
        body = data
        if not head and key in self.hub.corrupt:
            body = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
        if not head and key in self.hub.short:
            body = data[:-7]
        body = body[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) if head else len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if not head and key in self.hub.drop_once:
            self.hub.drop_once.discard(key)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.end_headers()
        if not head:
            self.wfile.write(body)

    # ---- answers --------------------------------------------------------------------------

    def _json(self, obj) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def _error(self, code: int, error_code: str, message: str, commit: str | None = None) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)
