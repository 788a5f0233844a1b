"""`http://` and `https://` with the standard library: ranged GETs on keep-alive connections, one per thread.

The shape of an fsspec file system as `remote.RemoteStore` uses it (`info`, `cat_file`, `ls`), plus `read_into`,
which reads a range straight into the engine's buffer. fsspec's own HTTP file system (aiohttp, bodies handed
from its event loop's thread) moved a third to a tenth of the bytes a second on the loopback benchmark, and
took a second to import; this one needs no extra.
"""

from __future__ import annotations

import http.client
import threading
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

_REDIRECTS = 5  # followed for one request (a CDN behind a resolve URL)
_TIMEOUT_S = 60  # for a connection and for each read of it


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
