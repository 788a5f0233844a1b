"""Checkpoints at URLs: a `Store` over fsspec (`hf://`, `s3://`, `gs://`, any protocol it knows) or `httpfs`.

Nothing here imports fsspec until such a URL is opened; `https://` and `http://` need no extra (`httpfs`: the
standard library's client). Inside clipcli a URL travels as the `Path` that pathlib makes of it
(`https://host/a` becomes `https:/host/a`: parents, names and suffixes work as for files), and the store turns
it back into the URL for each request; `errors.shown_path` restores the `//` for people.

Every read is one ranged request (fsspec's `cat_file(url, start, end)`): headers through a buffered file
object, tensors' bytes chunk by chunk from the engine's threads (several requests in flight); over http(s), a
ranged GET left open for the chunks that follow, one for each part of a pass that workers read on in (`streams`,
`engine.in_parts`). A transient failure (a 5xx or 429 answer, a connection reset, a body cut short) is retried
with exponential backoff.
"""

from __future__ import annotations

import io
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

from clipcli.checkpoint.httpfs import ShortReadError
from clipcli.checkpoint.source import Source, SourceFile
from clipcli.errors import UsageError, split_query

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
ATTEMPTS = 5  # tries of one request before its error is the user's
BACKOFF_S = 0.1  # the wait before the second try; doubled before each next one
_HEAD_BUFFER = 64 << 10  # bytes a header read asks for at once (a safetensors header: one or two requests)
_WAIT_S = 2.0  # how long a read waits for the thread reading the bytes before it in a stream (`_Streams`)
_STREAMS = 16  # ranged GETs a file keeps open for the reads to come
INSTALL = "pip install 'clipcli[remote]'"
_PACKAGES = {  # what a protocol needs beyond fsspec (the name to install, for the message)
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "hf": "huggingface_hub",
}
_LOGGERS = ("fsspec", "aiohttp", "s3fs", "aiobotocore", "botocore", "gcsfs", "google", "huggingface_hub", "httpx")
_TRANSIENT = {  # exception types (by name: the client libraries are optional) worth another try
    "ClientPayloadError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ConnectionError",
    "TimeoutError",
    "TransportError",
    "ProtocolError",
    "IncompleteRead",
    "ReadTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "ShortReadError",
}


def is_url(path: object) -> bool:
    """Whether `path` is a URL (`scheme://...`, as text): a `Path` never is one."""
    return isinstance(path, str) and _URL.match(path) is not None


def open_store(url: str) -> tuple[RemoteStore, Path]:
    """The store that reads `url`'s protocol, and the path of `url` inside clipcli.

    Raises:
        UsageError: when the protocol is unknown, or the package it needs is not installed (naming it).
    """
    protocol = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    slashes = len(url) - len(url[len(protocol) + 1 :].lstrip("/")) - len(protocol) - 1
    if protocol in ("http", "https"):
        from clipcli.checkpoint.httpfs import HttpFileSystem

        store = RemoteStore(HttpFileSystem(), protocol, slashes)
        store.lists = False
        store.streams = _STREAMS // 2
        store.typed, store.query = split_query(url)
        return store, Path(store.typed)
    try:
        import fsspec
    except ImportError as e:
        raise UsageError(f"reading {protocol}:// URLs needs fsspec: {INSTALL}", url) from e
    import logging

    for name in _LOGGERS:  # their warnings and retries are theirs: clipcli's error is the one line the user sees
        logging.getLogger(name).addHandler(logging.NullHandler())
    options: dict[str, Any] = {}
    if protocol == "hf" and os.environ.get("HF_ENDPOINT"):
        options["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")  # read now, not when huggingface_hub was imported
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as e:
        package = _PACKAGES.get(protocol) or getattr(e, "name", None) or "its fsspec implementation"
        raise UsageError(f"reading {protocol}:// URLs needs {package}: {INSTALL}", url) from e
    except ValueError as e:  # fsspec: "Protocol not known"
        raise UsageError(f"no reader knows the protocol {protocol}://", url) from e
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    # a file system that reads through its buffered file objects (the Hub's) would read ahead a block: not here
    generic = type(fs).cat_file is AbstractFileSystem.cat_file and not isinstance(fs, AsyncFileSystem)
    return RemoteStore(fs, protocol, slashes, {"cache_type": "none"} if generic else {}), Path(url)


class RemoteSource:
    """One remote file: its size (asked once) and ranged reads, each retried on transient failures. Its first
    `_HEAD_BUFFER` bytes are fetched once and kept: the registry, the format and the header all read them.

    `read_within` reads ahead where the file system can leave a ranged GET open (`httpfs`): see `_Streams`.
    """

    def __init__(self, store: RemoteStore, url: str, size: int):
        self.name = url
        self._store = store
        self._size = size
        self._head: bytes | None = None
        self._head_lock = threading.Lock()
        open_range = getattr(store.fs, "open_range", None)
        self._streams = None if open_range is None else _Streams(lambda start, end: open_range(url, start, end))

    def size(self) -> int:
        return self._size

    def read_into(self, offset: int, view: memoryview) -> int:
        n = max(0, min(len(view), self._size - offset))
        if not n:
            return 0
        if offset + n <= _HEAD_BUFFER:
            with self._head_lock:
                if self._head is None:
                    self._head = self._get(0, min(_HEAD_BUFFER, self._size))
            view[:n] = self._head[offset : offset + n]
            return n
        self._get_into(offset, view[:n])
        return n

    def read_within(self, offset: int, view: memoryview, end: int) -> int:
        """`read_into`, for a reader whose reads go on in order (from any of its threads) up to byte `end`: the
        bytes come from one ranged GET up to `end`, left open for the reads that follow (`_Streams`)."""
        n = max(0, min(len(view), self._size - offset))
        if self._streams is None or offset + n <= _HEAD_BUFFER or not n:
            return self.read_into(offset, view)
        end = min(max(end, offset + n), self._size)
        streams = self._streams
        retried(lambda: streams.read_into(offset, view[:n], end))
        return n

    def close(self) -> None:
        if self._streams is not None:
            self._streams.close()

    def _get_into(self, offset: int, view: memoryview) -> None:
        read_into = getattr(self._store.fs, "read_into", None)
        if read_into is None:
            view[:] = self._get(offset, len(view))
        else:  # straight into the buffer
            retried(lambda: read_into(self.name, offset, view))

    def _get(self, offset: int, n: int) -> bytes:
        def get() -> bytes:
            data = self._store.fs.cat_file(self.name, start=offset, end=offset + n, **self._store.read_options)
            if len(data) > n:
                raise OSError(f"the server does not honour range requests ({len(data):,} bytes for {n:,})")
            if len(data) < n:
                raise ShortReadError(f"{len(data):,} of {n:,} bytes arrived")
            return data

        return retried(get)


class _Stream:
    """A ranged GET of one file's bytes [at, end) being read in order: `body` is None until it is sent."""

    def __init__(self, at: int, end: int):
        self.at, self.end = at, end
        self.body: Any = None
        self.busy = True  # a thread is sending it or reading from it


class _Streams:
    """Read-ahead for one file: ranged GETs left open, each read in order by whichever thread asks for its next
    bytes, so a tensor's chunks cost one request, and the server sends on while the threads compute.

    A read at `offset` takes the stream that has got there; waits while another thread reads the bytes before it
    (they were handed out in order: that thread asks for them next); or opens a stream from `offset` to the
    caller's `end`, never beyond where another stream starts (no byte is asked for twice). After `_WAIT_S` in
    vain, a stream that no read came back to (its reader failed, or stopped) is given up, and a read behind a slow
    one reads its own range alone. What waits in a stream's socket is bounded by the kernel's buffers; streams left
    unread are closed past `_STREAMS` and with the file.
    """

    def __init__(self, open_range: Any):
        self._open = open_range  # (start, end) -> a body with read_into(view), close() and left
        self._streams: list[_Stream] = []
        self._changed = threading.Condition()

    def read_into(self, offset: int, view: memoryview, end: int) -> None:
        stream = self._take(offset, offset + len(view), end)
        try:
            if stream.body is None:
                stream.body = self._open(stream.at, stream.end)
            stream.body.read_into(view)
        except BaseException:
            self._drop(stream)
            raise
        with self._changed:
            stream.at += len(view)
            stream.busy = False
            if stream.at >= stream.end and stream in self._streams:
                self._streams.remove(stream)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            for stream in self._streams:
                if stream.body is not None and not stream.busy:
                    stream.body.close()
            self._streams.clear()

    def _take(self, offset: int, stop: int, end: int) -> _Stream:
        """The stream this read is to come from, marked busy (a new one, or one for this read alone)."""
        deadline = time.monotonic() + _WAIT_S
        with self._changed:
            while True:
                ahead = next((s for s in self._streams if s.at <= offset < s.end), None)
                if ahead is None:
                    until = min([end, *(s.at for s in self._streams if offset < s.at)])  # no byte asked twice
                    stream = _Stream(offset, max(until, stop))
                    self._streams.append(stream)
                    self._limit()
                    return stream
                if ahead.at == offset and not ahead.busy:
                    ahead.busy = True
                    return ahead
                left = deadline - time.monotonic()
                if left <= 0 and ahead.busy:  # a read before this one is slow: this one reads alone
                    return _Stream(offset, stop)
                if left <= 0:  # no read came for the bytes before this one's: the stream is given up
                    self._streams.remove(ahead)
                    if ahead.body is not None:
                        ahead.body.close()
                    continue
                self._changed.wait(left)

    def _drop(self, stream: _Stream) -> None:
        """Forgets a stream after a failure (its body closed): the retry opens another from where it was."""
        if stream.body is not None:
            stream.body.close()
        with self._changed:
            if stream in self._streams:
                self._streams.remove(stream)
            self._changed.notify_all()

    def _limit(self) -> None:
        """Closes the oldest idle streams past `_STREAMS` (reads that never came back for the rest)."""
        idle = [s for s in self._streams if not s.busy]
        for stream in idle[: max(0, len(self._streams) - _STREAMS)]:
            if stream.body is not None:
                stream.body.close()
            self._streams.remove(stream)


class RemoteStore:
    """Files at URLs of one protocol, through an fsspec file system. Sources and sizes are asked once."""

    forkable = False  # an fsspec event loop does not survive a fork: the engine's workers are threads here
    lists = True  # whether `list` lists a directory (plain HTTP cannot: a directory shows by a file in it)
    typed: str | None = None  # plain HTTP's URL as typed, less its query: names below it (from files) percent-encoded
    query = ""  # plain HTTP's query as typed (`?X-Amz-Signature=...`), sent with every URL of the store
    # into how many parts of a file, each read on by workers of its own, the engine may cut a pass (`engine.in_parts`):
    # a ranged GET left open (`_Streams`) is received by one thread at a time, several by several cores at once
    streams = 1
    reads_ahead = True  # in the order of a pass's tasks (`engine.read_ahead`): workers take them in that order

    def __init__(self, fs: Any, protocol: str, slashes: int = 2, read_options: dict[str, Any] | None = None):
        self.fs = fs
        self.protocol = protocol
        self._slashes = slashes  # after the scheme: 2, or 3 in `file:///tmp/a`
        self.read_options = read_options or {}  # for every cat_file
        self._info: dict[str, dict[str, Any] | None] = {}
        self._sources: dict[str, RemoteSource] = {}
        self._lock = threading.Lock()

    def url(self, path: Path | str) -> str:
        """The URL of a path inside clipcli (`https:/host/a` → `https://host/a`); a URL stays as it is.

        Over plain HTTP the URL typed is sent as typed, and a name below it or beside it (a shard of an index, a
        `.distcp` file, a marker) is percent-encoded whole: it came from a file, and is never a query or fragment.
        The query typed (a presigned URL's signature, a token) goes with each: paths inside clipcli, and so every
        report and message, never show it (it is a credential), and a suffix is read without it.
        """
        text = self._url(path)
        return text if not self.query or "?" in text else text + self.query

    def _url(self, path: Path | str) -> str:
        text = os.fspath(path)
        if self.typed is not None and not _URL.match(text):  # a path inside clipcli, not a URL already
            text = self._encoded(Path(text))
        head = f"{self.protocol}:/"
        if text.lower().startswith(head) and not text[len(head) :].startswith("/"):
            return f"{text[: len(head) - 1]}{'/' * self._slashes}{text[len(head) :]}"
        return text

    def _encoded(self, path: Path) -> str:
        """`path` with the part below the URL typed (or its directory) percent-encoded (`typed` is set)."""
        typed = Path(self.typed)  # type: ignore[arg-type]
        if path == typed:
            return self._url(self.typed)  # type: ignore[arg-type]
        for base in (typed, typed.parent):
            if base in path.parents:
                below = quote(path.relative_to(base).as_posix(), safe="/")
                return f"{self._url(os.fspath(base)).rstrip('/')}/{below}"
        return os.fspath(path)

    def _path(self, name: str) -> Path:
        """The path inside clipcli of a name that the file system lists (with or without its protocol)."""
        return Path(name if "://" in name else f"{self.protocol}:/{name.lstrip('/')}")

    def info(self, path: Path | str) -> dict[str, Any] | None:
        """fsspec's `info` of the path, or None when nothing is there."""
        url = self.url(path)
        with self._lock:
            if url in self._info:
                return self._info[url]
        try:
            info = retried(lambda: self.fs.info(url))
        except FileNotFoundError:
            info = None
        with self._lock:
            self._info[url] = info
        return info

    def open(self, path: Path) -> BinaryIO:
        return io.BufferedReader(SourceFile(self.source(path)), _HEAD_BUFFER)  # type: ignore[return-value]

    def source(self, path: Path | str) -> Source:
        url = self.url(path)
        with self._lock:
            if url in self._sources:
                return self._sources[url]
        info = self.info(url)
        if info is None:
            raise FileNotFoundError(2, "No such file or directory", url)
        if info.get("type") == "directory":
            raise IsADirectoryError(21, "Is a directory", url)
        size = info.get("size")
        if size is None:
            raise OSError(f"the server does not say the size of {url}")
        with self._lock:
            return self._sources.setdefault(url, RemoteSource(self, url, int(size)))

    def kind(self, path: Path) -> str | None:
        info = self.info(path)
        if info is None:
            return None
        return "directory" if info.get("type") == "directory" else "file"

    def known_directory(self, path: Path) -> None:
        """Records that `path` is a directory, found by a file in it that its format names (plain HTTP lists none)."""
        with self._lock:
            self._info[self.url(path)] = {"name": self.url(path), "type": "directory"}

    def size(self, path: Path) -> int:
        return self.source(path).size()

    def list(self, directory: Path) -> list[Path]:
        names = retried(lambda: self.fs.ls(self.url(directory), detail=False))
        own = self.url(directory).rstrip("/")
        return sorted(p for p in map(self._path, names) if self.url(p).rstrip("/") != own)

    def real(self, path: Path) -> Path:
        return Path(path)

    def release(self, source: Source) -> None:
        pass

    def forked(self) -> None:
        raise RuntimeError("a remote store is read by threads, not forked workers")

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
        close = getattr(self.fs, "close_connections", None)  # httpfs's; fsspec's file systems keep theirs
        if close is not None:
            close()


def retried(call: Any) -> Any:
    """`call()`, tried again after a transient failure (`ATTEMPTS` tries, backing off from `BACKOFF_S`).

    Raises:
        FileNotFoundError, PermissionError: at once. OSError: naming the last failure, when the tries run out
            or it was not transient.
    """
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as e:
            if _status(e) == 404:  # a client library's own error for it (the Hub's for a missing repository)
                raise FileNotFoundError(2, "No such file or directory", _describe(e)) from e
            if attempt + 1 < ATTEMPTS and _transient(e):
                time.sleep(BACKOFF_S * 2**attempt)
                continue
            if isinstance(e, OSError) and not _transient(e):
                raise
            raise OSError(_describe(e)) from e
    raise AssertionError("unreachable")


def _status(e: BaseException) -> int | None:
    """The HTTP status an error of a client library carries (aiohttp's `status`, httpx's and requests'
    `response.status_code`), if any."""
    status = getattr(e, "status", None)
    if status is None:
        status = getattr(getattr(e, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _transient(e: BaseException) -> bool:
    status = _status(e)
    if status is not None:
        return status >= 500 or status in (408, 429)
    return any(c.__name__ in _TRANSIENT for c in type(e).__mro__) or isinstance(e, ConnectionError)


def _describe(e: BaseException) -> str:
    status = _status(e)
    text = " ".join(str(e).split())[:200] or type(e).__name__
    return f"HTTP {status}: {text}" if status is not None and str(status) not in text else text
