"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub 2.4 calls for
`snapshot_download`, `hf_hub_download` and `model_info`, served from files in memory.

    with StandinHub({"owner/tiny": Path("model_dir")}) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf")}
        # a subprocess (or a process that imports huggingface_hub after setting them)

huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported, so set them before the
first import (or in a subprocess's environment). Endpoints, as the real Hub answers them:

- GET  /api/models/{repo}[/revision/{rev}]   model info: sha, siblings (with `?blobs=true`:
  size, blobId, lfs {size, sha256, pointerSize})
- GET  /api/models/{repo}/tree/{rev}          the file list (one page; `oid`, `lfs.oid`)
- HEAD/GET /{repo}/resolve/{rev}/{file}       X-Repo-Commit, ETag (the git blob sha1, or
  for an LFS file the sha256, also as X-Linked-Etag with X-Linked-Size), Content-Length,
  Accept-Ranges; a Range request gets 206 with Content-Range.

Unknown repos, revisions and files get the Hub's X-Error-Code (RepoNotFound,
RevisionNotFound, EntryNotFound). Files named in `lfs_suffixes` (weights) are LFS files.

Faults for tests, each settable while the server runs:
- `cut_once`: file names whose first GET is cut after `cut_after` bytes (default: half
  the body) by closing the connection under the client. huggingface_hub 2.4 resumes within
  the same call with a Range request, from what it has written: it writes in 10 MiB chunks
  (constants.DOWNLOAD_CHUNK_SIZE), so a resume from a non-zero offset needs a cut past one;
- `corrupt`: file names served with one byte flipped (headers still carry the true
  sha256 and size, as a damaged transfer or disk would);
- `stall`: every request is read and then never answered (until the server stops);
- `stall_body`: file names whose GETs send half the body, then nothing more.

`requests` records (method, path, Range header) of every request.

Run as a script to serve directories: `python tests/hub_standin.py owner/name=DIR ...`
prints the URL to put in HF_ENDPOINT and serves until interrupted.
"""

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Mapping, Union
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".npz")
MAIN = "main"

Files = Dict[str, bytes]


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, what the Hub gives as ETag of a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_tree(root: Path) -> Files:
    """Every file under `root`, by its path relative to it."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Repo:
    """One model repository at one commit."""

    def __init__(self, repo_id: str, files: Files, lfs_suffixes=LFS_SUFFIXES):
        self.id = repo_id
        self.files = dict(files)
        self.lfs = {n for n in self.files if n.endswith(tuple(lfs_suffixes))}
        h = hashlib.sha1(repo_id.encode())
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        self.sha = h.hexdigest()  # a stable 40-hex commit id

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if name in self.lfs else git_blob_sha1(data)

    def sibling(self, name: str) -> dict:
        data = self.files[name]
        entry = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
        if name in self.lfs:
            entry["lfs"] = {"size": len(data), "sha256": self.etag(name), "pointerSize": 134}
        return entry

    def tree_entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
        if name in self.lfs:
            entry["lfs"] = {"oid": self.etag(name), "size": len(data), "pointerSize": 134}
        return entry

    def info(self, blobs: bool) -> dict:
        siblings = [self.sibling(n) if blobs else {"rfilename": n} for n in sorted(self.files)]
        gguf = [n for n in self.files if n.endswith(".gguf")]
        return {
            "_id": self.sha[:24],
            "id": self.id,
            "modelId": self.id,
            "author": self.id.split("/")[0],
            "sha": self.sha,
            "private": False,
            "gated": False,
            "disabled": False,
            "tags": ["gguf"] if gguf else ["safetensors"],
            "siblings": siblings,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
        }


class StandinHub:
    """A threaded HTTP server on 127.0.0.1 (an ephemeral port) serving `repos`.

    Args:
        repos: repo id -> a directory (every file under it) or {path in repo: bytes}.
        lfs_suffixes: file name endings stored as LFS files (sha256 ETag).
    """

    def __init__(
        self, repos: Mapping[str, Union[Path, str, Files]], lfs_suffixes=LFS_SUFFIXES
    ) -> None:
        self.repos = {
            rid: Repo(rid, read_tree(Path(f)) if isinstance(f, (str, Path)) else f, lfs_suffixes)
            for rid, f in repos.items()
        }
        self.cut_once: set = set()
        self.cut_after = None  # bytes sent before a cut; None: half the body
        self.corrupt: set = set()
        self.stall = False
        self.stall_body: set = set()
        self.requests: list = []
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "StandinHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # releases stalled handlers
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "StandinHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def gets(self, name: str) -> list:
        """The Range header (or None) of every GET of a file named `name`."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    def _take_cut(self, name: str) -> bool:
        with self._lock:
            if name in self.cut_once:
                self.cut_once.discard(name)
                return True
            return False


def _handler(hub: StandinHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: tests read hub.requests instead
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        # -- plumbing --------------------------------------------------------
        def _serve(self, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            with hub._lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            if hub.stall:
                hub._stopped.wait()
                self.close_connection = True
                return
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                self._api(parts[2:], url.query)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo("/".join(parts[:2]))
                if repo is not None and self._revision(repo, parts[3]):
                    self._file(repo, "/".join(parts[4:]), body)
            else:
                self._error(404, "EntryNotFound", f"{path}: not an endpoint of this stand-in")

        def _json(self, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _repo(self, repo_id: str):
            repo = hub.repos.get(repo_id)
            if repo is None:  # the Hub answers 401 for a repo it will not show
                self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return repo

        def _revision(self, repo: Repo, rev: str) -> bool:
            if rev in (MAIN, repo.sha):
                return True
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return False

        def _api(self, parts, query: str) -> None:
            # {owner}/{name}[/revision/{rev}] or {owner}/{name}/tree/{rev}[/{path}]
            repo = self._repo("/".join(parts[:2]))
            if repo is None:
                return
            rest = parts[2:]
            if not rest or rest[0] == "revision":
                if rest and not self._revision(repo, unquote(rest[1])):
                    return
                self._json(repo.info(blobs="blobs=true" in query.lower()))
            elif rest[0] == "tree" and len(rest) >= 2:
                if not self._revision(repo, unquote(rest[1])):
                    return
                prefix = "/".join(rest[2:])
                names = [n for n in sorted(repo.files) if n.startswith(prefix)]
                self._json([repo.tree_entry(n) for n in names])
            else:
                self._error(404, "EntryNotFound", f"{self.path}: not an endpoint of this stand-in")

        def _file(self, repo: Repo, name: str, body: bool) -> None:
            if name not in repo.files:
                self._error(404, "EntryNotFound", f"{name} does not exist on {MAIN}")
                return
            data = repo.files[name]
            if name in hub.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF]) if data else data
            start, status = 0, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and body:
                start = int(rng[6:].split("-")[0] or 0)
                status = 206
            chunk = data[start:]
            self.send_response(status)
            etag = repo.etag(name)
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("ETag", f'"{etag}"')
            if name in repo.lfs:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(chunk)))
            self.end_headers()
            if not body:
                return
            if name in hub.stall_body:  # half the bytes, then silence
                self.wfile.write(chunk[: len(chunk) // 2])
                self.wfile.flush()
                hub._stopped.wait()
                self.close_connection = True
                return
            if hub._take_cut(name):  # some bytes, then the connection goes away
                cut = len(chunk) // 2 if hub.cut_after is None else hub.cut_after
                self.wfile.write(chunk[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(chunk)

    return Handler


def main(argv) -> None:
    repos = dict(arg.split("=", 1) for arg in argv)
    with StandinHub(repos) as hub:
        print(hub.url, flush=True)
        try:
            hub._stopped.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main(sys.argv[1:])
