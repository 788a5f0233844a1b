"""`http://` and `https://` with the standard library: ranged GETs on keep-alive connections, one per thread.

The shape of an fsspec file system as `remote.RemoteStore` uses it (`info`, `cat_file`, `ls`), plus `read_into`,
which reads a range straight into the engine's buffer. fsspec's own HTTP file system (aiohttp, bodies handed
from its event loop's thread) moved a third to a tenth of the bytes a second on the loopback benchmark, and
took a second to import; this one needs no extra.
"""

from __future__ import annotations

import http.client
import socket
import struct
import sys
import threading
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

_REDIRECTS = 5  # followed for one request (a CDN behind a resolve URL)
_TIMEOUT_S = 60  # for a connection and for each read of it
# a body read whole by the kernel (`_receive`) where the flag and a `struct timeval` of two longs are sure
_WAITALL = getattr(socket, "MSG_WAITALL", 0) if sys.platform.startswith(("linux", "darwin")) else 0


class HttpStatusError(OSError):
    """An HTTP answer that is an error; `status` says which (the retries read it)."""

    def __init__(self, status: int, reason: str, url: str):
        super().__init__(f"HTTP {status} {reason}".strip())
        self.status = status
        self.url = url


class ShortReadError(OSError):
    """A response body shorter than the range asked for, before the end of the file."""


class HttpFileSystem:
    """Files at http(s) URLs. Each thread keeps its own connection to each host, reused while it stays open."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._opened: list[http.client.HTTPConnection] = []  # every thread's, for `close_connections`
        self._lock = threading.Lock()

    def close_connections(self) -> None:
        """Closes every connection of every thread (when the checkpoint is closed)."""
        with self._lock:
            for connection in self._opened:
                connection.close()
            self._opened.clear()

    def info(self, url: str) -> dict[str, Any]:
        """The file's size, from a HEAD (or, where HEAD does not say it, a GET of its first byte).

        Raises:
            FileNotFoundError: for a 404 or 410. HttpStatusError: for another error answer.
        """
        response, _ = self._request("HEAD", url, {})
        response.read()
        _check(response, url)
        size = response.getheader("Content-Length")
        if size is None or response.getheader("Content-Encoding"):
            response, _ = self._request("GET", url, {"Range": "bytes=0-0", "Accept-Encoding": "identity"})
            response.read()
            _check(response, url)
            whole = (response.getheader("Content-Range") or "").rpartition("/")[2]
            size = whole if whole.isdigit() else None
        return {"name": url, "type": "file", "size": None if size is None else int(size)}

    def cat_file(self, url: str, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        n = self.read_into(url, start, memoryview(buf))
        return bytes(buf[:n])

    def read_into(self, url: str, offset: int, view: memoryview) -> int:
        """Fills `view` with the file's bytes from `offset` on, by one ranged GET.

        Raises:
            FileNotFoundError, HttpStatusError: as `info`. ShortReadError: when the body ends early.
            OSError: when the server answers with the whole file (it ignores Range).
        """
        headers = {"Range": f"bytes={offset}-{offset + len(view) - 1}", "Accept-Encoding": "identity"}
        response, key = self._request("GET", url, headers)
        try:
            _check(response, url)
            if response.status != 206:
                raise OSError(f"the server does not honour range requests (HTTP {response.status} for a range)")
            sock = self._connection(key).sock
            if _WAITALL and response.length == len(view) and type(sock) is socket.socket:  # plain, not TLS
                _receive(response, sock, view)
                return len(view)
            got = 0
            while got < len(view):
                n = response.readinto(view[got:])
                if not n:
                    raise ShortReadError(f"{got:,} of {len(view):,} bytes arrived")
                got += n
            if response.length:  # more than asked: the connection cannot be reused
                raise ShortReadError("the body is longer than the range asked for")
            return got
        except BaseException:
            self._drop(key)
            raise

    def ls(self, url: str, detail: bool = False) -> list[str]:
        raise OSError("plain HTTP cannot list a directory: name a file or a sharded index")

    def _request(self, method: str, url: str, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, tuple]:
        for _ in range(_REDIRECTS + 1):
            parts = urlsplit(url)
            key = (parts.scheme.lower(), parts.netloc)
            path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")  # a space typed as such, not %20
            target = path + (f"?{parts.query}" if parts.query else "")
            connection = self._connection(key)
            try:
                connection.request(method, target, headers=headers)
                response = connection.getresponse()
            except (http.client.HTTPException, OSError) as e:
                self._drop(key)
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                response.read()
                url = urljoin(url, location)
                continue
            return response, key
        raise OSError(f"more than {_REDIRECTS} redirects")

    def _connection(self, key: tuple) -> http.client.HTTPConnection:
        connections = self._local.__dict__.setdefault("connections", {})
        if key not in connections:
            scheme, netloc = key
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            connections[key] = kind(netloc, timeout=_TIMEOUT_S)
            with self._lock:
                self._opened.append(connections[key])
        return connections[key]

    def _drop(self, key: tuple) -> None:
        connection = self._local.__dict__.get("connections", {}).pop(key, None)
        if connection is not None:
            connection.close()


def _check(response: http.client.HTTPResponse, url: str) -> None:
    if response.status in (404, 410):
        response.read()
        raise FileNotFoundError(2, "No such file or directory", url)
    if response.status >= 400:
        response.read()
        raise HttpStatusError(response.status, response.reason, url)


def _receive(response: http.client.HTTPResponse, sock: socket.socket, view: memoryview) -> None:
    """Fills `view` with the body of `response`, exactly as long, then closes the response (its connection
    stays open for the next request).

    What http.client has buffered after the headers comes first; the rest is one `recv` with MSG_WAITALL on a
    blocking socket: the kernel fills the buffer while the thread holds no GIL, instead of a `recv` of a few
    hundred KiB at a time, each taking the GIL back from the threads that compute. SO_RCVTIMEO bounds the wait
    as the connection's timeout does.

    Raises:
        ShortReadError: when the body ends early. TimeoutError: when no byte arrives for `_TIMEOUT_S`.
    """
    got = response.fp.readinto1(view)  # type: ignore[union-attr]  # the buffered part (or one read)
    if got < len(view):
        seconds, fraction = divmod(_TIMEOUT_S, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(fraction * 1e6)))
        sock.settimeout(None)  # blocking: MSG_WAITALL waits for every byte (a socket with a timeout is non-blocking)
        try:
            while got < len(view):
                try:
                    n = sock.recv_into(view[got:], len(view) - got, _WAITALL)
                except BlockingIOError as e:
                    raise TimeoutError(f"no bytes for {_TIMEOUT_S} s") from e
                if not n:
                    raise ShortReadError(f"{got:,} of {len(view):,} bytes arrived")
                got += n
        finally:
            sock.settimeout(_TIMEOUT_S)
    response.length = 0
    response.read()  # closes the response, not the connection
