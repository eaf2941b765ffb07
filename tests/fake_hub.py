"""A small in-memory Hugging Face Hub, enough for `push_to_hub` and `from_pretrained` round trips in tests.

Standard library only (`http.server` in a background thread). It speaks the subset of the Hub HTTP API that
`huggingface_hub` uses to create a repo, commit files and download them again:

| route | used by |
|---|---|
| `GET /api/whoami-v2` | `whoami`, `create_repo` without a namespace |
| `POST /api/repos/create` | `create_repo` (409 when the repo exists, as the Hub) |
| `POST /api/validate-yaml` | `ModelCard.push_to_hub` / model card validation |
| `GET /api/{type}s/{ns}/{name}[/revision/{rev}]` | `model_info`, `repo_info`, `repo_exists` |
| `POST /api/{type}s/{ns}/{name}/preupload/{rev}` | `create_commit`; answers `uploadMode: "regular"` for every file |
| `POST /api/{type}s/{ns}/{name}/commit/{rev}` | `create_commit` (NDJSON, files inlined as base64) |
| `GET /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]` | `list_repo_files`, `list_repo_tree`, `snapshot_download` |
| `HEAD`/`GET /[{type}s/]{ns}/{name}/resolve/{rev}/{path}` | `hf_hub_download`, hence every `from_pretrained` |

Because preupload answers "regular", uploads never take the LFS or Xet paths: file contents arrive inline in
the commit body, which is fine for tiny test models. Errors carry the Hub's `X-Error-Code` header
(`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`) so that `huggingface_hub` raises its usual exceptions.

Only the `main` branch exists; a revision may also be any commit sha. Each commit stores a full snapshot of
the repo (a dict of path -> bytes, sharing unchanged contents), so older revisions stay downloadable.

Use it through the `fake_hub` fixture in `tests/conftest.py`, which also points `huggingface_hub` at it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

REPO_TYPES = ("model", "dataset", "space")
EMPTY_TREE_SHA = "0" * 40


def git_blob_sha(content: bytes) -> str:
    """The git object id of a blob, what the Hub reports as the `oid` / ETag of a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    sha: str
    title: str
    files: dict[str, bytes]  # full snapshot after this commit


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool = False
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def at(self, revision: str) -> Commit | None:
        if revision == "main":
            return self.head
        return next((c for c in self.commits if c.sha == revision), None)


class HubError(Exception):
    """An error answer: HTTP status, Hub error code (X-Error-Code) and message."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class FakeHub:
    """The fake Hub's state and HTTP server. `start()` serves on `127.0.0.1:<free port>` in a daemon thread.

    Attributes read by tests: `url` (the endpoint), `requests` (every `(method, path)` served, in order),
    `blocked`, `files(repo_id)` and `commits(repo_id)`.
    """

    def __init__(self, user: str = "tester"):
        self.user = user
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.blocked: list[str] = []  # URLs for other hosts refused by the `fake_hub` fixture's client guard
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake hub is not running; call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test-facing accessors
    def files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """`{path: content}` of a repo at `revision` (a copy). Raises `KeyError` if the repo or revision is unknown."""
        with self._lock:
            commit = self.repos[(repo_type, repo_id)].at(revision)
            if commit is None:
                raise KeyError(f"{repo_id} has no revision {revision!r}")
            return dict(commit.files)

    def commits(self, repo_id: str, repo_type: str = "model") -> list[str]:
        """Commit titles of a repo, oldest first (the first one is the repo creation's "initial commit")."""
        with self._lock:
            return [c.title for c in self.repos[(repo_type, repo_id)].commits]

    # ------------------------------------------------------------------ operations
    def create_repo(self, repo_id: str, repo_type: str, private: bool) -> Repo:
        with self._lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, None, f"You already created this {repo_type} repo: {repo_id}")
            repo = Repo(repo_id=repo_id, repo_type=repo_type, private=private)
            repo.commits.append(Commit(sha=_new_sha(repo_id, "initial"), title="initial commit", files={}))
            self.repos[(repo_type, repo_id)] = repo
            return repo

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        with self._lock:
            repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_type} {repo_id}")
        return repo

    def revision(self, repo: Repo, revision: str) -> Commit:
        with self._lock:
            commit = repo.at(revision)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def commit(self, repo: Repo, revision: str, lines: list[dict]) -> Commit:
        if revision != "main":
            raise HubError(400, None, f"the fake hub only commits to 'main', got {revision!r}")
        header = next((line["value"] for line in lines if line["key"] == "header"), {})
        with self._lock:
            parent = repo.head
            if header.get("parentCommit") not in (None, parent.sha):
                raise HubError(412, None, f"parentCommit {header['parentCommit']} is not the head {parent.sha}")
            files = dict(parent.files)
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    continue
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, None, f"unsupported file encoding {value.get('encoding')!r}")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if value["path"] not in files:
                        raise HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {value['path']}")
                    del files[value["path"]]
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                else:  # lfsFile / copy operations need the LFS path, which preupload never offers
                    raise HubError(400, None, f"the fake hub does not support commit operation {key!r}")
            commit = Commit(
                sha=_new_sha(repo.repo_id, parent.sha, header.get("summary", "")),
                title=header.get("summary") or "Upload files",
                files=files,
            )
            repo.commits.append(commit)
            return commit


def _new_sha(*parts: str) -> str:
    return hashlib.sha1("\0".join((*parts, str(time.time_ns()))).encode()).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake_hub: FakeHub  # set on the per-server subclass

    def log_message(self, format, *args):  # quiet: tests read `fake_hub.requests` instead
        pass

    # ------------------------------------------------------------------ plumbing
    def do_GET(self):
        self._dispatch(head=False)

    def do_HEAD(self):
        self._dispatch(head=True)

    def do_POST(self):
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        self.query = parse_qs(split.query)
        # read every body, used or not: on a kept-alive connection an unread body would be parsed as the next request
        self.body = self._body()
        self.fake_hub.requests.append((self.command, path))
        try:
            self._route(path.strip("/").split("/"), head)
        except HubError as err:
            self._send_json({"error": err.message}, status=err.status, error_code=err.code, head=head)
        except Exception as err:  # noqa: BLE001 -- a bug in the fake should surface as a 500 with the reason, not a hang
            self._send_json({"error": f"fake hub: {type(err).__name__}: {err}"}, status=500, head=head)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    return b"".join(chunks)
                chunks.append(chunk)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(
        self,
        body: bytes,
        status: int = 200,
        headers: dict[str, str] | None = None,
        head: bool = False,
        content_type: str = "application/json",
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_json(
        self,
        payload,
        status: int = 200,
        error_code: str | None = None,
        head: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        headers = dict(headers or {})
        if error_code:
            headers["X-Error-Code"] = error_code
        if status >= 400:
            headers["X-Error-Message"] = payload.get("error", "").encode("ascii", "backslashreplace").decode()
        self._send(json.dumps(payload).encode(), status=status, headers=headers, head=head)

    # ------------------------------------------------------------------ routes
    def _route(self, parts: list[str], head: bool) -> None:
        hub = self.fake_hub
        method = self.command
        if parts[0] == "api":
            if parts[1:] == ["whoami-v2"] and method == "GET":
                return self._send_json(
                    {
                        "type": "user",
                        "name": hub.user,
                        "fullname": hub.user,
                        "orgs": [],
                        "auth": {"type": "access_token", "accessToken": {"displayName": "fake", "role": "write"}},
                    }
                )
            if parts[1:] == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if parts[1:] == ["validate-yaml"] and method == "POST":
                return self._send_json({"errors": [], "warnings": []})
            if len(parts) >= 4 and parts[1].endswith("s") and parts[1][:-1] in REPO_TYPES:
                return self._repo_api(parts[1][:-1], f"{parts[2]}/{parts[3]}", parts[4:], head)
        else:
            repo_type = "model"
            if parts[0].endswith("s") and parts[0][:-1] in ("dataset", "space"):
                repo_type, parts = parts[0][:-1], parts[1:]
            if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
                return self._resolve(repo_type, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        raise HubError(404, None, f"the fake hub has no route for {method} /{'/'.join(parts)}")

    def _create_repo(self) -> None:
        payload = json.loads(self.body or b"{}")
        namespace = payload.get("organization") or self.fake_hub.user
        repo_type = payload.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, None, f"invalid repo type {repo_type!r}")
        repo_id = f"{namespace}/{payload['name']}"
        url = f"{self.fake_hub.url}/{'' if repo_type == 'model' else repo_type + 's/'}{repo_id}"
        try:
            self.fake_hub.create_repo(repo_id, repo_type, private=payload.get("visibility") == "private")
        except HubError as err:
            return self._send_json({"error": err.message, "url": url}, status=err.status)
        self._send_json({"url": url, "name": repo_id})

    def _repo_api(self, repo_type: str, repo_id: str, rest: list[str], head: bool) -> None:
        hub = self.fake_hub
        method = self.command
        repo = hub.repo(repo_type, repo_id)
        if not rest or rest[0] == "revision":
            if method not in ("GET", "HEAD"):
                raise HubError(405, None, f"{method} not allowed on repo info")
            commit = hub.revision(repo, "/".join(rest[1:]) if rest else "main")
            return self._send_json(
                {
                    "id": repo_id,
                    "sha": commit.sha,
                    "private": repo.private,
                    "disabled": False,
                    "gated": False,
                    "siblings": [{"rfilename": p} for p in sorted(commit.files)],
                    "tags": [],
                    "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
                },
                head=head,
                headers={"X-Repo-Commit": commit.sha},
            )
        action, revision = rest[0], "/".join(rest[1:2]) or "main"
        if action == "preupload" and method == "POST":
            payload = json.loads(self.body)
            hub.revision(repo, revision)
            return self._send_json(
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload["files"]
                    ],
                    "commitOid": repo.head.sha,
                }
            )
        if action == "commit" and method == "POST":
            lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
            commit = hub.commit(repo, revision, lines)
            prefix = "" if repo_type == "model" else f"{repo_type}s/"
            return self._send_json(
                {
                    "success": True,
                    "commitOid": commit.sha,
                    "commitUrl": f"{hub.url}/{prefix}{repo_id}/commit/{commit.sha}",
                }
            )
        if action == "tree" and method == "GET":
            return self._tree(repo, revision, "/".join(rest[2:]).strip("/"))
        raise HubError(404, None, f"the fake hub has no route for {method} {action} on {repo_id}")

    def _tree(self, repo: Repo, revision: str, folder: str) -> None:
        files = self.fake_hub.revision(repo, revision).files
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = f"{folder}/" if folder else ""
        if folder and folder not in files and not any(p.startswith(prefix) for p in files):
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            relative = path[len(prefix) :]
            parents = relative.split("/")[:-1]
            for depth in range(1, len(parents) + 1 if recursive else min(1, len(parents)) + 1):
                folders.add(prefix + "/".join(parents[:depth]))
            if recursive or not parents:
                content = files[path]
                entries.append({"type": "file", "path": path, "size": len(content), "oid": git_blob_sha(content)})
        entries += [{"type": "directory", "path": p, "oid": EMPTY_TREE_SHA} for p in sorted(folders)]
        self._send_json(entries)

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self.fake_hub.repo(repo_type, repo_id)
        commit = self.fake_hub.revision(repo, revision)
        if path not in commit.files:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        content = commit.files[path]
        headers = {"ETag": f'"{git_blob_sha(content)}"', "X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
        status, body = 200, content
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and not head:  # resumed downloads: "bytes=START-" or "bytes=START-END"
            start, _, end = ranged[len("bytes=") :].partition("-")
            first, last = int(start or 0), int(end) if end else len(content) - 1
            body, status = content[first : last + 1], 206
            headers["Content-Range"] = f"bytes {first}-{first + len(body) - 1}/{len(content)}"
        # a HEAD answer's Content-Length is the full size, which `huggingface_hub` checks the download against
        self._send(body, status=status, headers=headers, head=head, content_type="application/octet-stream")
