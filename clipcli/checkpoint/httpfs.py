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
    """Files at http(s) URLs, over keep-alive connections: each request takes an idle one to its host (or opens
    one) and gives it back once its answer is read whole."""

    def __init__(self) -> None:
        self._idle: dict[tuple, list[http.client.HTTPConnection]] = {}
        self._opened: list[http.client.HTTPConnection] = []  # every one, for `close_connections`
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
        response, key, connection = self._request("HEAD", url, {})
        response.read()
        self._give(key, connection)
        _check(response, url)
        size = response.getheader("Content-Length")
        if size is None or response.getheader("Content-Encoding"):
            response, key, connection = self._request("GET", url, {"Range": "bytes=0-0", "Accept-Encoding": "identity"})
            response.read()
            self._give(key, connection)
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
            as `open_range` and `Body.read_into`.
        """
        self.open_range(url, offset, offset + len(view)).read_into(view)
        return len(view)

    def open_range(self, url: str, start: int, end: int) -> Body:
        """The body of a GET of the file's bytes [start, end), to be read in order, in parts.

        Raises:
            FileNotFoundError, HttpStatusError: as `info`. OSError: when the server answers with the whole file
                (it ignores Range) or with another length. ConnectionError: when the request cannot be sent.
        """
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        response, key, connection = self._request("GET", url, headers)
        try:
            _check(response, url)
            if response.status != 206:
                raise OSError(f"the server does not honour range requests (HTTP {response.status} for a range)")
            if response.length is not None and response.length != end - start:
                raise ShortReadError(f"a body of {response.length:,} bytes for a range of {end - start:,}")
        except BaseException:
            connection.close()
            raise
        return Body(self, key, connection, response, end - start)

    def ls(self, url: str, detail: bool = False) -> list[str]:
        raise OSError("plain HTTP cannot list a directory: name a file or a sharded index")

    def _request(
        self, method: str, url: str, headers: dict[str, str]
    ) -> tuple[http.client.HTTPResponse, tuple, http.client.HTTPConnection]:
        """The answer to a request (redirects followed), and the connection it is read from (the caller's)."""
        for _ in range(_REDIRECTS + 1):
            parts = urlsplit(url)
            key = (parts.scheme.lower(), parts.netloc)
            path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")  # a space typed as such, not %20
            target = path + (f"?{parts.query}" if parts.query else "")
            connection = self._take(key)
            try:
                connection.request(method, target, headers=headers)
                response = connection.getresponse()
            except (http.client.HTTPException, OSError) as e:
                connection.close()
                raise ConnectionError(f"{type(e).__name__}: {e}") from e
            location = response.getheader("Location")
            if response.status in (301, 302, 303, 307, 308) and location:
                response.read()
                self._give(key, connection)
                url = urljoin(url, location)
                continue
            return response, key, connection
        raise OSError(f"more than {_REDIRECTS} redirects")

    def _take(self, key: tuple) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop()
            scheme, netloc = key
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            connection = kind(netloc, timeout=_TIMEOUT_S)
            self._opened.append(connection)
            return connection

    def _give(self, key: tuple, connection: http.client.HTTPConnection) -> None:
        """Takes back a connection whose last answer was read whole (one the server closes reopens when used)."""
        with self._lock:
            self._idle.setdefault(key, []).append(connection)


class Body:
    """The body of one ranged GET, read in order, in parts, by one thread at a time; its connection goes back to
    the pool once the last byte is read, and is closed if the body is left unread (`close`)."""

    def __init__(
        self,
        fs: HttpFileSystem,
        key: tuple,
        connection: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        length: int,
    ):
        self._fs, self._key, self._connection, self._response = fs, key, connection, response
        self.left = length  # bytes not yet read

    def read_into(self, view: memoryview) -> None:
        """Fills `view` with the body's next `len(view)` bytes (at most `left`).

        Raises:
            ShortReadError: when the body ends early. TimeoutError: when no byte arrives for `_TIMEOUT_S`.
                (The body is closed after any error.)
        """
        try:
            sock = self._connection.sock
            if _WAITALL and type(sock) is socket.socket and self._response.length is not None:  # plain, not TLS
                _receive(self._response, sock, view)
            else:
                got = 0
                while got < len(view):
                    n = self._response.readinto(view[got:])
                    if not n:
                        raise ShortReadError(f"{got:,} of {len(view):,} bytes arrived")
                    got += n
            self.left -= len(view)
            if not self.left:
                self._response.length = 0
                self._response.read()  # closes the response, not the connection
                self._fs._give(self._key, self._connection)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drops the connection (the rest of the body is not read)."""
        self.left = 0
        self._connection.close()


def _check(response: http.client.HTTPResponse, url: str) -> None:
    if response.status in (404, 410):
        response.read()
        raise FileNotFoundError(2, "No such file or directory", url)
    if response.status >= 400:
        response.read()
        raise HttpStatusError(response.status, response.reason, url)


def _receive(response: http.client.HTTPResponse, sock: socket.socket, view: memoryview) -> None:
    """Fills `view` with the next bytes of the body of `response`.

    What http.client has buffered comes first; the rest is one `recv` with MSG_WAITALL on a blocking socket: the
    kernel fills the buffer while the thread holds no GIL, instead of a `recv` of a few hundred KiB at a time, each
    taking the GIL back from the threads that compute. SO_RCVTIMEO bounds the wait as the connection's timeout does.

    Raises:
        ShortReadError: when the body ends early. TimeoutError: when no byte arrives for `_TIMEOUT_S`.
    """
    got = response.fp.readinto1(view) if len(view) else 0  # type: ignore[union-attr]  # what is buffered, or one read
    if got < len(view):  # (then nothing is left buffered)
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
