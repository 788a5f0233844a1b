"""Real servers on the loopback interface for the remote tests: HTTP with Range, moto's S3, a stand-in Hub."""

from __future__ import annotations

import contextlib
import email.message
import email.utils
import hashlib
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeServer(ThreadingHTTPServer):
    """Serves files by name (`/NAME` → a local file), honouring `Range`, counting the body bytes it sends.

    `fail` holds the failures to come, one per GET that matches: `"503"` (an error answer), `"cut"` (the
    connection closed half-way through the body) or `"stall"` (half the body, then nothing more until the client
    hangs up). `connections` counts the connections accepted. `routes` adds answers of its own (`path -> (status,
    headers, body)`) for the Hub's API. `directories` says how a directory's own URL (`/d` or `/d/`, where files
    `d/...` are served) is answered: `"404"`; `"403"` (nginx's and Apache's default without an index page);
    `"redirect"` (`/d` → 301 to `/d/`, which is 403, as they do); `"html"` (a listing, honouring Range);
    `"html-whole"` (a listing that ignores Range).
    """

    daemon_threads = True
    block_on_close = False

    def __init__(self, files: dict[str, Path]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = dict(files)
        self.fail: list[str] = []
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.sent = 0
        self.ignore_range = False  # answer every GET with the whole file, as a server without Range support does
        self.directories = "404"
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.connections = 0
        self.query: str | None = None  # when set, a request without this query is refused (403), as a presigned URL's
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.sent = 0
            self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection carries many ranged requests
    disable_nagle_algorithm = True  # as web servers do (nginx's tcp_nodelay): no body's tail waits for an ACK
    server: RangeServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def log_message(self, *args: Any) -> None:
        pass

    def parse_request(self) -> bool:
        """The request line and header fields of a plain HTTP/1.x request, read without the `email` parser that
        `BaseHTTPRequestHandler` uses (most of this server's time per ranged GET: a real server costs little per
        request, and on the benchmark's loopback this one shares the client's cores); anything else as it does."""
        words = self.raw_requestline.decode("latin-1").split()
        if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
            return super().parse_request()
        self.command, self.path, self.request_version = words
        self.requestline = " ".join(words)
        self.headers = email.message.Message()
        while (line := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip()] = value.strip()
        connection = (self.headers.get("Connection") or "").lower()
        self.close_connection = connection == "close" or (words[2] == "HTTP/1.0" and connection != "keep-alive")
        return True

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        with self.server.lock:
            self.server.requests.append((self.command, path, self.headers.get("Range")))
        if self.server.query is not None and self.path.partition("?")[2] != self.server.query:
            self._send(403, {"Content-Length": "9"}, b"forbidden" if body else b"")
            return
        route = self.server.routes.get(path)
        if route is not None:
            status, headers, data = route
            self._send(status, {**headers, "Content-Length": str(len(data))}, data if body else b"")
            return
        file = self.server.files.get(path.lstrip("/"))
        if file is None and self.server.directories != "404" and self._directory(path, body):
            return
        if file is None:  # the Hub says which kind of 404 it is
            headers = {"X-Error-Code": "RepoNotFound"} if path.startswith("/api/models/") else {}
            self._send(404, {**headers, "Content-Length": "9"}, b"not found" if body else b"")
            return
        size = os.path.getsize(file)
        start, end = 0, size
        status = 200
        match = _RANGE.match(self.headers.get("Range") or "")
        if match and size and not self.server.ignore_range:
            first, last = match.groups()
            start, end = (size - int(last), size) if not first else (int(first), min(size, int(last or size - 1) + 1))
            status = 206
        if body and self.server.fail:
            with self.server.lock:
                failure = self.server.fail.pop(0) if self.server.fail else None
            if failure == "503":
                self._send(503, {"Content-Length": "4"}, b"busy")
                return
            if failure in ("cut", "stall"):
                self._send_file(status, file, start, end, size, cut=failure)
                return
        if not body:
            self._send(200, {"Content-Length": str(size), "Accept-Ranges": "bytes"}, b"")
            return
        self._send_file(status, file, start, end, size)

    def _directory(self, path: str, body: bool) -> bool:
        """Answers a directory's own URL as `directories` says; False where `path` is no directory."""
        inside = path.strip("/") + "/"
        if not any(name.startswith(inside) for name in self.server.files):
            return False
        how = self.server.directories
        if how == "403" or (how == "redirect" and path.endswith("/")):
            self._send(403, {"Content-Length": "9"}, b"forbidden" if body else b"")
        elif how == "redirect":
            self._send(301, {"Location": f"{path}/", "Content-Length": "0"}, b"")
        else:
            page = f"<!DOCTYPE html><html><body><h1>Index of {path}</h1></body></html>\n".encode()
            match = _RANGE.match(self.headers.get("Range") or "")
            headers = {"Content-Type": "text/html", "Content-Length": str(len(page))}
            status = 200
            if how == "html" and match and body:
                first, last = int(match.group(1) or 0), min(len(page) - 1, int(match.group(2) or len(page) - 1))
                page, status = page[first : last + 1], 206
                headers.update({"Content-Range": f"bytes {first}-{last}/{headers['Content-Length']}"})
                headers["Content-Length"] = str(len(page))
            self._send(status, headers, page if body else b"")
        return True

    def _send(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        with self.server.lock:  # counted before it is sent: a client that has the bytes sees them counted
            self.server.sent += len(data)
        self.wfile.write(data)

    def _send_file(self, status: int, file: Path, start: int, end: int, size: int, cut: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        self.wfile.flush()
        todo = (end - start) // 2 if cut else end - start
        with self.server.lock:  # counted before it is sent, as in _send
            self.server.sent += todo
        with open(file, "rb") as f:
            at = start
            while todo > 0:  # sendfile: the loopback benchmark measures clipcli, not this server
                n = os.sendfile(self.connection.fileno(), f.fileno(), at, min(todo, 8 << 20))
                if not n:
                    break
                at += n
                todo -= n
        if cut == "stall":
            self.connection.recv(1)  # until the client gives up and closes the connection
        if cut:
            self.close_connection = True
            with contextlib.suppress(OSError):  # the client may have hung up first
                self.connection.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def range_server(files: dict[str, Path]) -> Iterator[RangeServer]:
    """A `RangeServer` running in a thread of its own until the block ends."""
    server = RangeServer(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def s3_server(bucket: str, files: dict[str, Path]) -> Iterator[str]:
    """moto's S3 server with `bucket` holding `files` (key → local file); yields its endpoint URL. The AWS
    variables point at it (`AWS_ENDPOINT_URL`, test credentials) until the block ends."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request on stderr

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        for key, path in files.items():
            client.upload_file(str(path), bucket, key)
        yield endpoint
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        server.stop()


def hub_routes(server: RangeServer, repo: str, revision: str, files: dict[str, Path]) -> None:
    """Makes `server` answer as the Hugging Face Hub does for one model repository at one revision.

    The routes are those huggingface_hub's `HfFileSystem` (2.4) calls to read files: the repository's info
    (`/api/models/{repo}`, or at a revision `/api/models/{repo}/revision/{rev}`), the tree of each directory
    (`/api/models/{repo}/tree/{rev}[/{dir}]`, one page), and each file's bytes with Range at
    `/{repo}/resolve/{rev}/{path}`; a repository it does not hold is a 404 with the Hub's `X-Error-Code`.
    """
    sha = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    entries = []
    for path, local in files.items():
        size = os.path.getsize(local)
        entries.append({"type": "file", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": size, "path": path})
        server.files[f"{repo}/resolve/{revision}/{path}"] = local
        server.files[f"{repo}/resolve/{sha}/{path}"] = local
    info = {"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": [{"rfilename": p} for p in files]}
    as_json = {"Content-Type": "application/json", "Date": email.utils.formatdate(usegmt=True)}
    server.routes[f"/api/models/{repo}"] = (200, as_json, json.dumps(info).encode())
    dirs = sorted({str(Path(p).parent) for p in files} - {"."})
    for rev in (revision, sha):
        server.routes[f"/api/models/{repo}/revision/{rev}"] = (200, as_json, json.dumps(info).encode())
        for d in ["", *dirs]:
            below = [e for e in entries if str(Path(e["path"]).parent) == (d or ".")]
            below += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": s} for s in dirs if _parent(s) == d]
            tree = json.dumps(below).encode()
            server.routes[f"/api/models/{repo}/tree/{rev}" + (f"/{d}" if d else "")] = (200, as_json, tree)


def _parent(path: str) -> str:
    parent = str(Path(path).parent)
    return "" if parent == "." else parent
