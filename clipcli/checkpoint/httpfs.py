"""`http://` and `https://` over sockets: ranged GETs on keep-alive HTTP/1.1 connections, bodies received in place.

The shape of an fsspec file system as `remote.RemoteStore` uses it (`info`, `cat_file`, `ls`), plus `read_into`,
which reads a range straight into the engine's buffer. fsspec's own HTTP file system (aiohttp, bodies handed
from its event loop's thread) moved a third to a tenth of the bytes a second on the loopback benchmark, and
took a second to import; `http.client` took a tenth of a URL run's start-up to import (with `email` and `ssl`),
for the few fields of an answer read here. `ssl` is imported for `https://` only.

What an answer may be: HTTP/1.x, its body's length in `Content-Length` (as every range answer has), or no body
known to follow (a HEAD, 204, 304); another error or redirect answer is read no further and its connection is
closed.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from typing import Any, NamedTuple
from urllib.parse import quote, urljoin, urlsplit

_REDIRECTS = 5  # followed for one request (a CDN behind a resolve URL)
_TIMEOUT_S = 60  # for a connection and for each read of it
_HEAD_MAX = 64 << 10  # bytes an answer's status line and header fields may take
_DRAINED = 64 << 10  # an error or redirect answer's body up to this size is read, to reuse its connection
# a plain socket is received by the kernel with the flag, the timeout in a `struct timeval` of two longs
_WAITALL = getattr(socket, "MSG_WAITALL", 0) if sys.platform.startswith(("linux", "darwin")) else 0


class HttpStatusError(OSError):
    """An HTTP answer that is an error; `status` says which (the retries read it)."""

    def __init__(self, status: int, reason: str, url: str):
        super().__init__(f"HTTP {status} {reason}".strip())
        self.status = status
        self.url = url


class ShortReadError(OSError):
    """A response body shorter than the range asked for, before the end of the file."""


def _count(text: str) -> int | None:
    """A number a server sent (a status, a length): ASCII digits, fewer than 19 (str.isdigit also takes
    '²', which int() refuses, and a number of thousands of digits is past what int() converts); else None."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


class _Answer(NamedTuple):
    status: int
    reason: str
    fields: dict[str, str]  # header fields, by lower-case name
    length: int | None  # the body's bytes (0 where none follows), None where unknown
    keep: bool  # whether the server keeps the connection open after it

    def field(self, name: str) -> str | None:
        return self.fields.get(name.lower())


class _Connection:
    """One keep-alive connection to a host (TLS for https), opened when first used, reopened after `close`."""

    def __init__(self, scheme: str, netloc: str):
        self.scheme, self.netloc = scheme, netloc
        self.sock: socket.socket | None = None
        self.kept = b""  # bytes received past an answer's header fields: its body's first ones
        self.plain = False  # blocking, with the kernel's receive timeout: bodies received with MSG_WAITALL

    def send(self, data: bytes) -> None:
        if self.sock is None:
            self._open()
        self.sock.sendall(data)  # type: ignore[union-attr]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.kept = None, b""

    def answer(self, method: str) -> _Answer:
        """The status line and header fields of the next answer (informational ones skipped).

        Raises:
            ConnectionError: when the connection ends first, or the answer is not HTTP/1.x.
        """
        while True:
            data = self.kept
            while b"\r\n\r\n" not in data:
                if len(data) > _HEAD_MAX:
                    raise ConnectionError("an answer whose header fields do not end")
                more = self._recv(_HEAD_MAX)
                if not more:
                    raise ConnectionError("the server closed the connection without an answer")
                data += more
            head, _, self.kept = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            status = _count(code) if len(code) == 3 else None
            if not version.startswith("HTTP/1.") or status is None:
                raise ConnectionError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
            if 100 <= status < 200:
                continue
            fields = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
            if method == "HEAD" or status in (204, 304):
                size: int | None = 0
            elif "chunked" in fields.get("transfer-encoding", "").lower():
                size = None
            else:
                size = _count(fields.get("content-length", ""))
            connection = fields.get("connection", "").lower()
            keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
            return _Answer(status, reason.strip(), fields, size, keep)

    def fill(self, view: memoryview) -> None:
        """Fills `view` with the next bytes of a body.

        The kernel fills a plain socket's buffer in one `recv` with MSG_WAITALL while the thread holds no GIL,
        instead of a `recv` of a few hundred KiB at a time, each taking the GIL back from the threads that compute.

        Raises:
            ShortReadError: when the body ends early. TimeoutError: when no byte arrives for `_TIMEOUT_S`.
        """
        if self.sock is None:
            raise ConnectionError("the connection was closed")
        got = min(len(self.kept), len(view))
        if got:
            view[:got] = self.kept[:got]
            self.kept = self.kept[got:]
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:], len(view) - got, _WAITALL if self.plain else 0)  # type: ignore[union-attr]
            except BlockingIOError as e:  # the kernel's timeout
                raise TimeoutError(f"no bytes for {_TIMEOUT_S} s") from e
            if not n:
                raise ShortReadError(f"{got:,} of {len(view):,} bytes arrived")
            got += n

    def _recv(self, n: int) -> bytes:
        try:
            return self.sock.recv(n)  # type: ignore[union-attr]
        except BlockingIOError as e:
            raise TimeoutError(f"no bytes for {_TIMEOUT_S} s") from e

    def _open(self) -> None:
        parts = urlsplit(f"{self.scheme}://{self.netloc}")
        host = parts.hostname or ""
        port = parts.port or (443 if self.scheme == "https" else 80)
        name = host.encode() if host.isascii() else host  # an ASCII name needs no IDNA codec (its import)
        sock = socket.create_connection((name, port), _TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.scheme == "https":
            import ssl

            self.sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            self.plain = False
            return
        if _WAITALL:  # blocking (a socket with a timeout is non-blocking): MSG_WAITALL waits for every byte
            seconds, fraction = divmod(_TIMEOUT_S, 1)
            timeval = struct.pack("ll", int(seconds), int(fraction * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            sock.settimeout(None)
        self.sock, self.plain = sock, bool(_WAITALL)


class HttpFileSystem:
    """Files at http(s) URLs, over keep-alive connections: each request takes an idle one to its host (or opens
    one) and gives it back once its answer is read whole."""

    def __init__(self) -> None:
        self._idle: dict[tuple, list[_Connection]] = {}
        self._opened: list[_Connection] = []  # every one, for `close_connections`
        self._lock = threading.Lock()

    def close_connections(self) -> None:
        """Closes every connection (when the checkpoint is closed)."""
        with self._lock:
            for connection in self._opened:
                connection.close()
            self._opened.clear()
            self._idle.clear()

    def info(self, url: str) -> dict[str, Any]:
        """The file's size, from a HEAD (or, where HEAD does not say it, a GET of its first byte).

        Raises:
            FileNotFoundError: for a 404 or 410. HttpStatusError: for another error answer.
        """
        answer, key, connection = self._request("HEAD", url, {})
        self._finish(answer, key, connection, url)
        size = answer.field("Content-Length")
        if size is None or answer.field("Content-Encoding"):
            answer, key, connection = self._request("GET", url, {"Range": "bytes=0-0"})
            self._finish(answer, key, connection, url)
            size = (answer.field("Content-Range") or "").rpartition("/")[2]
        return {"name": url, "type": "file", "size": _count(size or "")}

    def cat_file(self, url: str, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        n = self.read_into(url, start, memoryview(buf))
        return bytes(buf[:n])

    def read_into(self, url: str, offset: int, view: memoryview) -> int:
        """Fills `view` with the file's bytes from `offset` on, by one ranged GET.

        Raises:
            as `open_range` and `Body.read_into`.
        """
        self.open_range(url, offset, offset + len(view)).read_into(view)
        return len(view)

    def open_range(self, url: str, start: int, end: int) -> Body:
        """The body of a GET of the file's bytes [start, end), to be read in order, in parts.

        Raises:
            FileNotFoundError, HttpStatusError: as `info`. OSError: when the server answers with the whole file
                (it ignores Range), with another length or none. ConnectionError: when the request cannot be sent.
        """
        answer, key, connection = self._request("GET", url, {"Range": f"bytes={start}-{end - 1}"})
        try:
            _check(answer, url)
            if answer.status != 206:
                raise OSError(f"the server does not honour range requests (HTTP {answer.status} for a range)")
            if answer.length is None:
                raise OSError("the server's answer to a range request does not say its length")
            if answer.length != end - start:
                raise ShortReadError(f"a body of {answer.length:,} bytes for a range of {end - start:,}")
        except BaseException:
            connection.close()
            raise
        return Body(self, key, connection, end - start, answer.keep)

    def ls(self, url: str, detail: bool = False) -> list[str]:
        raise OSError("plain HTTP cannot list a directory: name a file or a sharded index")

    def _request(self, method: str, url: str, headers: dict[str, str]) -> tuple[_Answer, tuple, _Connection]:
        """The answer to a request (redirects followed), and the connection its body is read from (the caller's)."""
        for _ in range(_REDIRECTS + 1):
            parts = urlsplit(url)
            key = (parts.scheme.lower(), parts.netloc)
            # a space or a character past ASCII typed as such (in the path or the query) goes as curl sends it
            # encoded: %20, UTF-8's bytes; a %XX typed stays as it is
            path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")
            query = quote(parts.query, safe="/?%:@!$&'()*+,;=~")
            target = path + (f"?{query}" if query else "")
            fields = {"Host": parts.netloc, "Accept-Encoding": "identity", **headers}
            lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in fields.items())]
            connection = self._take(key)
            try:
                connection.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                answer = connection.answer(method)
            except OSError as e:
                connection.close()
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            location = answer.field("Location")
            if answer.status in (301, 302, 303, 307, 308) and location:
                self._finish(answer, key, connection, url)
                url = urljoin(url, location)
                continue
            return answer, key, connection
        raise OSError(f"more than {_REDIRECTS} redirects")

    def _finish(self, answer: _Answer, key: tuple, connection: _Connection, url: str) -> None:
        """Reads a small answer's body and gives its connection back (or closes it); then `_check`s it."""
        if answer.length is not None and answer.length <= _DRAINED:
            try:
                connection.fill(memoryview(bytearray(answer.length)))
            except OSError:
                connection.close()
            else:
                if answer.keep:
                    self._give(key, connection)
                else:
                    connection.close()
        else:
            connection.close()
        _check(answer, url)

    def _take(self, key: tuple) -> _Connection:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
            connection = _Connection(*key)
            self._opened.append(connection)
            return connection

    def _give(self, key: tuple, connection: _Connection) -> None:
        """Takes back a connection whose last answer was read whole (one the server closes reopens when used)."""
        with self._lock:
            self._idle.setdefault(key, []).append(connection)


class Body:
    """The body of one ranged GET, read in order, in parts, by one thread at a time; its connection goes back to
    the pool once the last byte is read, and is closed if the body is left unread (`close`)."""

    def __init__(self, fs: HttpFileSystem, key: tuple, connection: _Connection, length: int, keep: bool = True):
        self._fs, self._key, self._connection, self._keep = fs, key, connection, keep
        self.left = length  # bytes not yet read

    def read_into(self, view: memoryview) -> None:
        """Fills `view` with the body's next `len(view)` bytes (at most `left`).

        Raises:
            ShortReadError: when the body ends early. TimeoutError: when no byte arrives for `_TIMEOUT_S`.
                (The body is closed after any error.)
        """
        try:
            self._connection.fill(view)
            self.left -= len(view)
            if not self.left:
                if self._keep:
                    self._fs._give(self._key, self._connection)
                else:
                    self._connection.close()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drops the connection (the rest of the body is not read)."""
        self.left = 0
        self._connection.close()


def _check(answer: _Answer, url: str) -> None:
    if answer.status in (404, 410):
        raise FileNotFoundError(2, "No such file or directory", url)
    if answer.status >= 400:
        raise HttpStatusError(answer.status, answer.reason, url)
