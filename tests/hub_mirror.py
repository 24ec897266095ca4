"""A local, offline stand-in for the Hugging Face Hub: the routes that huggingface_hub, transformers and datasets use
to download model and dataset repositories, and the ones ``create_repo`` + ``upload_folder`` use to push. The tests
push and load through it; ``scripts/evaluation/serve_wikitext.py`` serves a local WikiText-2 file through it to
lm-eval.

Select it with ``HF_ENDPOINT=mirror.url`` in the environment of a fresh process (huggingface_hub reads the endpoint
when it is imported). Written by hand on the standard library: no Hub-compatible test server ships on PyPI that runs
without a separate binary, and huggingface_hub keeps its own test helpers out of its wheel.

Repositories are in memory: ``{(repo_type, repo_id): {path: bytes}}``; every commit gets a new sha. Every request is
recorded in ``calls``, every repository creation's payload in ``created`` and every commit's header in ``commits``, so
that a test can check what the clients did. Reading is open to all; creating and committing need ``token``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "hf_local_test_token"
USER = "me"
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
ACTIONS = ("revision", "tree", "paths-info", "preupload", "commit")
DATE = "2026-11-23T00:00:00.000Z"


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class Repo:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.sha = _sha(b"empty")

    def commit(self, files: dict[str, bytes]) -> str:
        self.files.update(files)
        self.sha = _sha(self.sha.encode() + json.dumps(sorted((p, _sha(d)) for p, d in self.files.items())).encode())
        return self.sha


class HubMirror:
    """Start with ``with HubMirror() as hub:``; ``hub.url`` is the endpoint."""

    def __init__(self, token: str = TOKEN):
        self.token = token
        self.repos: dict[tuple[str, str], Repo] = {}
        self.calls: list[dict] = []
        self.created: dict[str, dict] = {}  # repo id -> create_repo payload
        self.commits: list[dict] = []  # {"repo": repo id, "header": commit header}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubMirror":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_folder(self, repo_id: str, folder: str | Path, repo_type: str = "model") -> None:
        """Commit every file under ``folder`` to ``repo_id`` (created if new)."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos.setdefault((repo_type, repo_id), Repo()).commit(files)

    def files(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        return self.repos[(repo_type, repo_id)].files

    def paths(self) -> list[str]:
        return [c["path"] for c in self.calls]

    def env(self) -> dict[str, str]:
        """Environment variables that point a fresh process at this mirror (the cache dir is the caller's)."""
        return {"HF_ENDPOINT": self.url, "HF_TOKEN": self.token, "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}

    def process_env(self, home: str | Path, **extra: str) -> dict[str, str]:
        """This environment for a fresh process pointed at the mirror, with its own Hub cache under ``home`` (an
        inherited ``HF_HUB_CACHE`` would override it) and ``extra`` variables."""
        env = dict(os.environ, **self.env(), HF_HOME=str(home), **extra)
        env.pop("HF_HUB_CACHE", None)
        return env


def write_text_dataset(folder: str | Path, splits: dict[str, list[list[str]]], config: str = "default") -> Path:
    """A text dataset laid out as on the Hub: ``config/SPLIT-0000i-of-0000n.parquet`` shards (one list of texts a
    shard; an empty list is a shard without rows) and a card declaring each split's shards. Returns ``folder``."""
    import datasets

    folder = Path(folder)
    (folder / config).mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"text": datasets.Value("string")})
    card = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split, shards in splits.items():
        card += [f"  - split: {split}", f"    path: {config}/{split}-*.parquet"]
        for index, texts in enumerate(shards):
            datasets.Dataset.from_dict({"text": texts}, features=features).to_parquet(
                folder / config / f"{split}-{index:05d}-of-{len(shards):05d}.parquet")
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))
    return folder


def _split_repo(parts: list[str]) -> tuple[str, list[str]]:
    """(repo id, rest) from path segments that start with the repo id: ``ns/name`` or a bare ``name``."""
    for size in (2, 1):
        if len(parts) == size or (len(parts) > size and parts[size] in ACTIONS + ("resolve",)):
            return "/".join(parts[:size]), parts[size:]
    return "/".join(parts[:2]), parts[2:]


class _Handler(BaseHTTPRequestHandler):
    """The mirror's routes; ``_handler`` binds a subclass to one ``HubMirror`` through ``hub``."""

    protocol_version = "HTTP/1.1"
    hub: HubMirror

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def do_POST(self):
        self._route()

    # ------------------------------------------------------------------------------------------- replies

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, body, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    # -------------------------------------------------------------------------------------------- routes

    def _route(self):
        url = urlsplit(self.path)
        self.query = parse_qs(url.query)
        self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.hub.calls.append({"method": self.command, "path": url.path, "auth": self.headers.get("Authorization")})
        if url.path == "/api/whoami-v2":
            return self._whoami()
        if url.path == "/api/repos/create" and self.command == "POST":
            return self._create()
        if url.path == "/api/validate-yaml":
            return self._json(200, {})
        if parts[0] == "api" and len(parts) > 2 and parts[1] in REPO_TYPES:
            repo_id, rest = _split_repo(parts[2:])
            return self._api(REPO_TYPES[parts[1]], repo_id, rest)
        repo_type = "model"
        if parts[0] in REPO_TYPES:
            repo_type, parts = REPO_TYPES[parts[0]], parts[1:]
        repo_id, rest = _split_repo(parts)
        if rest[:1] == ["resolve"] and len(rest) >= 3 and self.command in ("GET", "HEAD"):
            return self._resolve(repo_type, repo_id, rest[1], "/".join(rest[2:]))
        return self._error(404, "NotFound", f"no route {self.command} {url.path}")

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
        return False

    def _whoami(self):
        if self._authorized():
            self._json(200, {"type": "user", "name": USER, "auth": {"accessToken": {"role": "write"}}})

    def _create(self):
        if not self._authorized():
            return
        payload = json.loads(self.body)
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        self.hub.created[repo_id] = payload
        self.hub.repos.setdefault((payload.get("type") or "model", repo_id), Repo())
        self._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def _repo(self, repo_type: str, repo_id: str, revision: str) -> Repo | None:
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
        elif revision not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _api(self, repo_type: str, repo_id: str, rest: list[str]):
        action, revision = (rest + [None, "main"])[:2] if rest else (None, "main")
        if action in ("preupload", "commit"):
            if not self._authorized() or self._repo(repo_type, repo_id, revision) is None:
                return
            return self._preupload() if action == "preupload" else self._commit(repo_type, repo_id)
        repo = self._repo(repo_type, repo_id, revision)
        if repo is None:
            return
        if action in (None, "revision"):
            return self._json(200, self._info(repo_type, repo_id, repo))
        if action == "tree":
            return self._json(200, self._tree(repo, "/".join(rest[2:]), self.query.get("recursive") == ["true"]))
        if action == "paths-info":
            wanted = self._paths_requested()
            return self._json(200, [e for e in self._tree(repo, "", True) if e["path"] in wanted])
        return self._error(404, "NotFound", f"no route {self.command} {self.path}")

    def _info(self, repo_type: str, repo_id: str, repo: Repo) -> dict:
        return {"id": repo_id, "_id": repo.sha[:24], "sha": repo.sha, "private": False, "gated": False,
                "disabled": False, "author": repo_id.split("/")[0], "lastModified": DATE, "createdAt": DATE,
                "downloads": 0, "likes": 0, "tags": [], "cardData": {},
                "siblings": [{"rfilename": p, "size": len(d)} for p, d in sorted(repo.files.items())],
                **({"library_name": "transformers"} if repo_type == "model" else {})}

    @staticmethod
    def _tree(repo: Repo, prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/")
        entries: dict[str, dict] = {}
        for path, data in sorted(repo.files.items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            below = path[len(prefix) + 1:] if prefix else path
            segments = below.split("/")
            for depth in range(1, len(segments)):  # the folders on the way
                folder = "/".join(([prefix] if prefix else []) + segments[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": _sha(folder.encode()), "size": 0,
                                                "path": folder})
            if recursive or len(segments) == 1:
                entries[path] = {"type": "file", "oid": _sha(data), "size": len(data), "path": path,
                                 "lastCommit": {"id": repo.sha, "title": "upload", "date": DATE}}
        return list(entries.values())

    def _paths_requested(self) -> set[str]:
        if self.headers.get("Content-Type", "").startswith("application/json"):
            return set(json.loads(self.body)["paths"])
        return set(parse_qs(self.body.decode()).get("paths", []))

    def _preupload(self):
        files = json.loads(self.body)["files"]
        self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                   for f in files]})

    def _commit(self, repo_type: str, repo_id: str):
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        self.hub.commits.append({"repo": repo_id, "header": lines[0]["value"]})
        files = {}
        for line in lines[1:]:
            if line["key"] != "file" or line["value"].get("encoding") != "base64":
                return self._error(400, "BadRequest", f"unsupported commit operation {line['key']}")
            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
        sha = self.hub.repos[(repo_type, repo_id)].commit(files)
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                         "pullRequestUrl": None})

    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str):
        repo = self._repo(repo_type, repo_id, revision)
        if repo is None:
            return
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist at {revision}")
        data = repo.files[path]
        self._send(200, data, {"Content-Type": "application/octet-stream", "ETag": f'"{_sha(data)}"',
                               "X-Repo-Commit": repo.sha})


def _handler(hub: HubMirror) -> type[_Handler]:
    """A request handler class serving ``hub``."""
    return type("Handler", (_Handler,), {"hub": hub})
