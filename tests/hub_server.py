"""A local stand-in for the Hugging Face Hub's HTTP API, so the real `huggingface_hub` client can
download over real HTTP with no network (HF_ENDPOINT=<url>). It answers the calls
`snapshot_download` makes: repository info at a revision (`/api/models/{repo}/revision/{rev}`),
the recursive file tree (`/api/models/{repo}/tree/{commit}`), and file metadata and bytes
(`HEAD`/`GET /{repo}/resolve/{commit}/{path}`, with the `X-Repo-Commit` and `ETag` headers the
client keys its cache on: sha256 for LFS files, the git blob sha1 otherwise). Every request is
recorded, so a test can say what was and was not fetched."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return not path.endswith((".json", ".md", ".txt"))


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    revisions: tuple[str, ...] = ("main",)  # branch/tag names that resolve to `commit`


@dataclass
class HubServer:
    repos: dict[str, Repo]
    requests: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._answer(self, head=False)

            def do_HEAD(self):
                hub._answer(self, head=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fetched(self) -> set[str]:
        """Repository paths whose bytes were downloaded (`repo/path`)."""
        return {m[1] + "/" + m[2] for method, p in self.requests if method == "GET"
                for m in [re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", unquote(urlparse(p).path))] if m}

    # ---- the API --------------------------------------------------------------------------------
    def _repo(self, repo_id: str, revision: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None or revision not in (repo.commit, *repo.revisions):
            return None
        return repo

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        self.requests.append((h.command, h.path))
        path = unquote(urlparse(h.path).path)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
            repo = self._repo(m[1], m[2])
            if repo is None:
                code = "RepoNotFound" if m[1] not in self.repos else "RevisionNotFound"
                return _send(h, 404, {"error": code}, {"X-Error-Code": code}, head)
            return _send(h, 200, {"id": m[1], "sha": repo.commit,
                                  "siblings": [{"rfilename": f} for f in repo.files]}, {}, head)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path):
            repo = self._repo(m[1], m[2])
            if repo is None:
                return _send(h, 404, {"error": "RevisionNotFound"}, {"X-Error-Code": "RevisionNotFound"}, head)
            items = []
            for name, data in repo.files.items():
                item = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                if is_lfs(name):
                    item["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                items.append(item)
            return _send(h, 200, items, {}, head)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo = self._repo(m[1], m[2])
            data = repo.files.get(m[3]) if repo else None
            if data is None:
                return _send(h, 404, {"error": "EntryNotFound"}, {"X-Error-Code": "EntryNotFound"}, head)
            etag = hashlib.sha256(data).hexdigest() if is_lfs(m[3]) else git_blob_sha1(data)
            return _send(h, 200, data, {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"'}, head)
        _send(h, 404, {"error": "not part of this stand-in"}, {}, head)


def _send(h: BaseHTTPRequestHandler, status: int, body, headers: dict, head: bool) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/octet-stream" if isinstance(body, bytes) else "application/json")
    h.send_header("Content-Length", str(len(raw)))
    for k, v in headers.items():
        h.send_header(k, v)
    h.end_headers()
    if not head:
        h.wfile.write(raw)
