"""A Hugging Face hub on 127.0.0.1 for download tests: the endpoints huggingface_hub calls.

- ``GET /api/models/{repo}[/revision/{rev}]``: ``sha`` and ``siblings`` (size, blobId, lfs);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file list ``snapshot_download`` reads;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` (the git blob id),
  ``Content-Length``. An LFS file (.gguf, .safetensors) answers as the hub does: 302 to a CDN
  URL on another host name (``localhost``) with ``X-Linked-Etag`` (its SHA-256) and
  ``X-Linked-Size``; the CDN serves the bytes, ``Range: bytes=N-`` gets 206, and like a signed
  S3 URL it refuses a request that carries an ``Authorization`` header (400).

Errors as the hub sends them: 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` /
``EntryNotFound``; a private repo answers 401 without a token, a gated one 401 with
``X-Error-Code: GatedRepo`` on its files. Faults per file: ``drop_once`` (the first GET closes
the connection halfway), ``corrupt`` (same size, one byte flipped), ``short`` (GET sends fewer
bytes than HEAD announced), ``fail_resume`` (a GET with ``Range`` gets 503: the client gives up).
``requests`` records (method, path, Range header), ``downloads`` (repo, file, Range header) for
each GET that sent a file's bytes.
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
    downloads: list[tuple[str, str, str | None]] = field(default_factory=list)
    url: str = ""

    def add(self, repo_id: str, files: dict[str, bytes | Path], **kw) -> Repo:
        data = {k: (v.read_bytes() if isinstance(v, Path) else v) for k, v in files.items()}
        self.repos[repo_id] = Repo(data, **kw)
        return self.repos[repo_id]

    def gets(self, repo_id: str) -> list[str]:
        """Files of `repo_id` whose bytes were sent (GET), in order."""
        return [f for r, f, _ in self.downloads if r == repo_id]

    def ranges(self, repo_id: str, file: str) -> list[str | None]:
        """The Range header of each GET that sent bytes of `file` (None: from the start)."""
        return [rng for r, f, rng in self.downloads if (r, f) == (repo_id, file)]

    def _by_sha(self, sha: str) -> tuple[str, str] | None:
        for repo_id, repo in self.repos.items():
            for f, d in repo.files.items():
                if is_lfs(f) and hashlib.sha256(d).hexdigest() == sha:
                    return repo_id, f
        return None

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
        if len(parts) == 2 and parts[0] == "cdn":
            return self._cdn(parts[1], head)
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
        if is_lfs(file):  # the hub sends LFS files from its CDN
            sha = hashlib.sha256(data).hexdigest()
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/cdn/{sha}")
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{git_blob_id(data)}"')  # the pointer file's id
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send(repo_id, file, data, head, {"X-Repo-Commit": repo.commit, "ETag": f'"{git_blob_id(data)}"'})

    def _cdn(self, sha: str, head: bool) -> None:
        found = self.hub._by_sha(sha)
        if found is None:
            return self._error(404, "NoSuchKey", "no such object")
        if self.headers.get("Authorization"):  # a signed URL must not get the hub token
            return self._error(400, "InvalidArgument", "Only one auth mechanism allowed")
        repo_id, file = found
        self._send(repo_id, file, self.hub.repos[repo_id].files[file], head, {"ETag": f'"{sha}"'})

    def _send(self, repo_id: str, file: str, data: bytes, head: bool, headers: dict) -> None:
        """The file's bytes (from a Range start), with the faults asked for this file."""
        key = (repo_id, file)
        rng = self.headers.get("Range")
        if rng and not head and key in self.hub.fail_resume:
            return self._error(503, "ServiceUnavailable", "try again later")
        start = int(rng[len("bytes="):].split("-")[0]) if rng and not head else 0
        body = data
        if not head and key in self.hub.corrupt:
            mid = len(data) // 2
            body = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        if not head and key in self.hub.short:
            body = data[:-7]
        body = body[start:]
        self.send_response(206 if start else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) if head else len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if head:
            self.end_headers()
            return
        self.hub.downloads.append((repo_id, file, rng))
        if key in self.hub.drop_once:
            self.hub.drop_once.discard(key)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.end_headers()
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
